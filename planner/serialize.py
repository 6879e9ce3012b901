"""Plan files: a plain ``.npz`` of int64 arrays, a JSON header and a SHA-256 digest (no pickled objects).

The file holds everything the symbolic phase produced (distinct patterns, which layer uses which,
every planned product with its pair lists, the depth and the cost-model constants), so loading
a plan does no symbolic SpGEMM. A plan file is *untrusted input*: :func:`load_scan` raises
``ValueError`` naming the field for anything it cannot prove consistent, and never returns a
plan whose indices could leave their arrays:

* the digest (over every array and the header) catches accidental corruption;
* every stored pattern is canonical CSR, each is used, and the layer table chains;
* the schedule is rebuilt from ``n`` and ``levels``; the stored products are exactly its products;
* every product is cross-checked against its operands: a dense (GEMM) product has two dense
  operands and the dense output shape; a row-wise product's pattern is its operands' product
  pattern (or dense) and its index data is recomputed from the patterns; a planned pair list is bounds-checked and verified to be
  exactly the pair list :func:`~spscan.planner.symbolic.spgemm_symbolic` gives (every pair feeds
  the entry it is listed under, pairs in inner-index order without repeats, as many as the
  product has);
* every product records its storage decision (dense, or its own pattern); the stored pattern must
  match it, and the decision must be the one the planner's storage rule
  (:class:`~spscan.planner.storage.StorageRule`: the cost of what reads the product at this
  depth, or the profile's explicit ``dense_threshold``) makes from the file's own patterns;
* the header's numbers and the options have the right types and values.

The verification is linear in the number of pairs (no sort), so loading stays cheaper than
planning.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from typing import Any

import numpy as np

from .cost import DeviceProfile
from .patterns import Pattern, PatternTable, validated_pattern
from .planning import ScanPlan
from .storage import MatInfo, StorageRule, decide_alone, dense_positions, matrix_uses
from .patterns import full_pattern, make_pattern
from .rowwise import estimate_product_nnz, pair_list_bytes, structural_product
from .schedule import blelloch_schedule, max_levels
from .symbolic import ProductSymbolic, product_counts

__all__ = ["save_scan", "load_scan", "FORMAT", "VERSION"]

FORMAT = "spscan-plan"
# 3: each product records its storage decision, made by the cost model (version 2: a fixed density
# threshold, not recorded; version 1: no digest)
VERSION = 3
_OLD_VERSIONS = {
    1: "version 1 files have no digest",
    2: "version 2 files store pair-list products by a fixed density threshold and do not record the decision",
}
OPTION_KEYS = ("backend", "device", "dtype", "max_memory", "requested_levels")
#: product storage kinds as stored: a dense GEMM, planned pair lists, or row-wise over the output pattern
_ALGO_CODES = {"gemm": 0, "pairs": 1, "rows": 2}
#: per product: id, stored pattern id, storage kind, GEMM work, pair list id, stored densely by the rule
_PRODUCT_FIELDS = 6
_HEADER_KEYS = {"format", "version", "n", "levels", "explored", "batch_hint", "elem_bytes", "profile",
                "candidates", "options"}


def _digest(arrays: dict[str, np.ndarray]) -> bytes:
    """SHA-256 over every array (name, dtype, shape, bytes) in name order, the digest itself excluded."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        if name == "digest":
            continue
        a = np.ascontiguousarray(arrays[name])
        h.update(json.dumps([name, a.dtype.str, list(a.shape)]).encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.digest()


def _write(path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` with their digest (the only writer of plan files)."""
    arrays = dict(arrays)
    arrays.pop("digest", None)
    arrays["digest"] = np.frombuffer(_digest(arrays), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def save_scan(path, plan: ScanPlan, options: dict[str, Any]) -> None:
    """Write ``plan`` and its front-end ``options`` (JSON-able) to ``path``."""
    if getattr(plan.schedule, "kind", "scan") != "scan":
        raise ValueError(f"only scan plans can be saved, got a {plan.schedule.kind!r} plan")
    uniq: dict[str, int] = {}
    arrays: dict[str, np.ndarray] = {}

    def pid(p: Pattern) -> int:
        if p.key not in uniq:
            k = len(uniq)
            uniq[p.key] = k
            arrays[f"pat{k}_indptr"] = p.indptr
            arrays[f"pat{k}_indices"] = p.indices
            arrays[f"pat{k}_shape"] = np.asarray(p.shape, dtype=np.int64)
        return uniq[p.key]

    layers = np.array([pid(p) for p in plan.patterns], dtype=np.int64)
    products = []
    syms: dict[int, int] = {}
    for mid in sorted(plan.mats):
        info = plan.mats[mid]
        if info.algo == "input":
            continue
        if info.algo not in _ALGO_CODES:
            raise ValueError(f"product {mid}: {info.algo!r} products cannot be saved in plan file version {VERSION}")
        rec = [mid, pid(info.pattern), _ALGO_CODES[info.algo], info.gemm_macs, -1, int(info.densified)]
        if info.sym is not None:
            skey = (id(info.sym), info.scatters)
            if skey not in syms:
                s = len(syms)
                syms[skey] = s
                ptr = np.asarray(info.sym.pair_ptr, dtype=np.int64)
                if info.scatters:  # the file keeps a dense-stored product's pointer over the dense block
                    counts = np.zeros(info.pattern.nnz, dtype=np.int64)
                    counts[dense_positions(info.sym.pattern)] = np.diff(ptr)
                    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
                arrays[f"sym{s}_ptr"] = ptr
                arrays[f"sym{s}_a"] = np.asarray(info.sym.pair_a, dtype=np.int64)
                arrays[f"sym{s}_b"] = np.asarray(info.sym.pair_b, dtype=np.int64)
            rec[4] = syms[skey]
        products.append(rec)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "n": plan.n,
        "levels": plan.levels,
        "explored": plan.explored,
        "batch_hint": plan.batch_hint,
        "elem_bytes": plan.elem_bytes,
        "profile": asdict(plan.profile),
        "candidates": {str(k): v for k, v in plan.candidates.items()},
        "options": options,
    }
    arrays["layers"] = layers
    arrays["products"] = np.asarray(products, dtype=np.int64).reshape(-1, _PRODUCT_FIELDS)
    arrays["header"] = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    _write(path, arrays)


# -- loading ----------------------------------------------------------------------------------


def _read_arrays(path) -> dict[str, np.ndarray]:
    """Every member of the ``.npz``; any failure to parse the container is a ``ValueError``."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single .npy array, not an .npz archive")
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except ValueError as exc:
        raise ValueError(f"{path}: not a readable spscan plan file ({exc})") from exc
    except Exception as exc:  # zipfile/zlib/npy parsing of hostile bytes raises many kinds
        raise ValueError(f"{path}: not a readable spscan plan file ({type(exc).__name__}: {exc})") from exc


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_field(header: dict, key: str, lo: int, hi: float = math.inf) -> int:
    v = header.get(key)
    if not _is_int(v) or not lo <= v <= hi:
        raise ValueError(f"header field {key!r}: expected an int in [{lo}, {hi}], got {v!r}")
    return v


def _index_array(arrays: dict, name: str, ndim: int = 1) -> np.ndarray:
    """A stored index array: present, int64, ``ndim``-dimensional."""
    if name not in arrays:
        raise ValueError(f"array {name!r} is missing")
    a = arrays[name]
    if a.dtype != np.int64 or a.ndim != ndim:
        raise ValueError(f"array {name!r}: expected {ndim}-D int64, got {a.ndim}-D {a.dtype}")
    return a


def _profile(raw: Any) -> DeviceProfile:
    try:
        return DeviceProfile.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"header field 'profile': {e}") from None


def _options(raw: Any, levels: int, kmax: int, elem_bytes: int) -> dict[str, Any]:
    if not isinstance(raw, dict) or sorted(raw) != sorted(OPTION_KEYS):
        raise ValueError(f"header field 'options': expected the keys {list(OPTION_KEYS)}, got {raw!r}")
    if raw["backend"] not in ("torch", "triton"):
        raise ValueError(f"option 'backend': expected 'torch' or 'triton', got {raw['backend']!r}")
    dev = raw["device"]
    if dev is not None:
        import torch

        try:
            ok = isinstance(dev, str) and str(torch.device(dev)) == dev
        except (RuntimeError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"option 'device': expected null or a torch device string, got {dev!r}")
    if raw["dtype"] not in (None, "float32", "float64"):
        raise ValueError(f"option 'dtype': expected null, 'float32' or 'float64', got {raw['dtype']!r}")
    want_elem = 8 if raw["dtype"] == "float64" else 4
    if elem_bytes != want_elem:
        raise ValueError(f"header field 'elem_bytes' is {elem_bytes}, dtype {raw['dtype']} gives {want_elem}")
    mm = raw["max_memory"]
    if mm is not None and not (_is_int(mm) and mm > 0):
        raise ValueError(f"option 'max_memory': expected null or a positive int, got {mm!r}")
    req = raw["requested_levels"]
    if req == "full":
        expect = kmax
    elif _is_int(req) and req >= 0:
        expect = min(req, kmax)
    elif req == "auto":
        expect = levels
    else:
        raise ValueError(f"option 'requested_levels': expected 'auto', 'full' or an int >= 0, got {req!r}")
    if expect != levels:
        raise ValueError(f"option 'requested_levels' is {req!r}, which plans depth {expect}, but the file "
                         f"holds depth {levels}")
    return dict(raw)


_CHUNK = 1 << 18  # pairs verified per pass: the temporaries stay in cache


def _rows(p: Pattern, cache: dict) -> np.ndarray:
    key = ("rows", p.key)
    if key not in cache:
        cache[key] = p.row_of_entry()
    return cache[key]


def _check_pair_entries(where: str, a: Pattern, b: Pattern, c: Pattern, ptr: np.ndarray, pa: np.ndarray,
                        pb: np.ndarray, seg: np.ndarray, cache: dict) -> None:
    """Bounds, placement and order of every pair, in chunks of whole entries (see :func:`_check_pairs`)."""
    a_row, b_row = _rows(a, cache), _rows(b, cache)
    c_key = _rows(c, cache) * c.cols + c.indices  # (i, j) of each entry of C as one int
    nnz_c = c.nnz
    c0 = 0
    while c0 < nnz_c:
        p0 = int(ptr[c0])
        c1 = max(int(np.searchsorted(ptr, p0 + _CHUNK, side="right")) - 1, c0 + 1)
        c1 = min(c1, nnz_c)
        p1 = int(ptr[c1])
        if p1 > p0:
            ea, eb = pa[p0:p1], pb[p0:p1]
            if ea.min() < 0 or ea.max() >= a.nnz:
                raise ValueError(f"{where}: left pair entries must lie in [0, {a.nnz}), got [{ea.min()}, {ea.max()}]")
            if eb.min() < 0 or eb.max() >= b.nnz:
                raise ValueError(f"{where}: right pair entries must lie in [0, {b.nnz}), got [{eb.min()}, {eb.max()}]")
            k = a.indices[ea]
            if not np.array_equal(b_row[eb], k):
                raise ValueError(f"{where}: a pair joins entries with different inner indices")
            if not np.array_equal(a_row[ea] * c.cols + b.indices[eb], np.repeat(c_key[c0:c1], seg[c0:c1])):
                raise ValueError(f"{where}: a pair is listed under another entry than the one it feeds")
            first = np.zeros(p1 - p0, dtype=bool)
            first[ptr[c0:c1][seg[c0:c1] > 0] - p0] = True
            if ((np.diff(k) <= 0) & ~first[1:]).any():
                raise ValueError(f"{where}: pairs of an entry are repeated or not in inner-index order")
        c0 = c1


def _check_pairs(where: str, a: Pattern, b: Pattern, c: Pattern, sym: ProductSymbolic, cache: dict) -> Pattern:
    """Prove that ``sym`` is what the planner gives for ``C = A @ B`` (pattern ``c``).

    Bounds first (so no index below can leave its array), then: each pair ``(pa, pb)`` listed under
    entry ``(i, j)`` of ``C`` has ``A``'s entry in row ``i``, ``B``'s entry in column ``j`` and the
    same inner index ``k``; within an entry the ``k`` strictly increase (no repeats, the planner's
    summation order); the count equals the product's pair count, so no pair is missing. A sparse
    ``c`` must be the product's own pattern (every entry reached). Returns the own pattern (the
    reached positions of a dense ``c``).
    """
    key = (id(sym), a.key, b.key, c.key)
    if key in cache:
        return cache[key]
    ptr, pa, pb = sym.pair_ptr, sym.pair_a, sym.pair_b
    nnz_c = c.nnz
    if ptr.shape != (nnz_c + 1,):
        raise ValueError(f"{where}: pair pointer has {ptr.shape[0]} entries, the product pattern needs {nnz_c + 1}")
    if pa.shape != pb.shape:
        raise ValueError(f"{where}: pair lists differ in length ({pa.shape[0]} vs {pb.shape[0]})")
    npairs = pa.shape[0]
    seg = np.diff(ptr)
    if ptr[0] != 0 or ptr[-1] != npairs or (seg < 0).any():
        raise ValueError(f"{where}: pair pointer must rise from 0 to {npairs}, got [{ptr[0]} .. {ptr[-1]}]"
                         + (" and decreases" if (seg < 0).any() else ""))
    expected = product_counts(a, b)
    if npairs != expected:
        raise ValueError(f"{where}: {npairs} pairs stored, the product of its operands has {expected}")
    if npairs:
        _check_pair_entries(where, a, b, c, ptr, pa, pb, seg, cache)
    reached = int(np.count_nonzero(seg))
    own = c
    if c.is_full:
        if reached < nnz_c:
            pos = np.flatnonzero(seg)
            indptr = np.zeros(c.rows + 1, dtype=np.int64)
            np.cumsum(np.bincount(pos // c.cols, minlength=c.rows), out=indptr[1:])
            own = make_pattern(c.shape, indptr, pos % c.cols)
    elif reached != nnz_c:
        raise ValueError(f"{where}: {nnz_c - reached} stored entries receive no pair (not the product's pattern)")
    cache[key] = own
    return own


def _rowwise(where: str, a: Pattern, b: Pattern, c: Pattern, macs: int, sidx: int, dense: bool,
             cache: dict) -> MatInfo:
    """A row-wise product: no stored indices; its output pattern must be the product's or the dense one
    (either computes the same values), and its index data is recomputed from the three patterns."""
    if macs != 0 or sidx != -1:
        raise ValueError(f"{where}: a row-wise product stores no GEMM work or pair list, got {macs} and {sidx}")
    key = (a.key, b.key, c.key, dense)
    if key not in cache:
        from .rowwise import rowwise_symbolic

        if not c.is_full and _own_rows(a, b, cache).key != c.key:
            raise ValueError(f"{where}: row-wise product stored with a pattern that is neither its operands' "
                             f"product pattern nor dense")
        rw = rowwise_symbolic(a, b, out=c)
        cache[key] = MatInfo(rw.pattern, "rows", rw=rw, densified=dense)
    return cache[key]


def _own_rows(a: Pattern, b: Pattern, cache: dict) -> Pattern:
    """The own pattern of a row-wise product (formed once per operand pair)."""
    key = ("own", a.key, b.key)
    if key not in cache:
        cache[key] = structural_product(a, b)
    return cache[key]


def _storage_name(dense: bool) -> str:
    return "densely" if dense else "with its own pattern"


def _header(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The header object, after the arrays' names, the format, the version and the digest are checked."""
    for name in ("header", "digest", "layers", "products"):
        if name not in arrays:
            raise ValueError(f"array {name!r} is missing")
    raw = arrays["header"]
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"array 'header': expected 1-D uint8 JSON text, got {raw.ndim}-D {raw.dtype}")
    try:
        header = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"array 'header': not JSON text ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"array 'header': expected a JSON object, got {type(header).__name__}")
    if header.get("format") != FORMAT:
        raise ValueError(f"header field 'format' is {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("version") != VERSION:
        why = _OLD_VERSIONS.get(header.get("version")) if _is_int(header.get("version")) else None
        raise ValueError(f"header field 'version' is {header.get('version')!r}; this spscan reads plan file version "
                         f"{VERSION}" + (f" ({why})" if why else "") + ": re-plan and save again")
    if set(header) != _HEADER_KEYS:
        raise ValueError(f"header: expected the fields {sorted(_HEADER_KEYS)}, got {sorted(header)}")
    digest = arrays["digest"]
    if digest.dtype != np.uint8 or digest.shape != (32,) or digest.tobytes() != _digest(arrays):
        raise ValueError("array 'digest': the SHA-256 digest does not match the contents (corrupted file)")
    return header


def _stored_patterns(arrays: dict[str, np.ndarray], n: int) -> tuple[PatternTable, list[Pattern], list[Pattern], int]:
    """``(table, pats, chain, nsym)``: every stored pattern validated and interned, the layers' chain, and
    the number of stored pair lists; nothing else may be stored."""
    npat = 0
    while f"pat{npat}_shape" in arrays:
        npat += 1
    nsym = 0
    while f"sym{nsym}_ptr" in arrays:
        nsym += 1
    known = {"header", "digest", "layers", "products"}
    known |= {f"pat{k}_{f}" for k in range(npat) for f in ("indptr", "indices", "shape")}
    known |= {f"sym{s}_{f}" for s in range(nsym) for f in ("ptr", "a", "b")}
    unknown = sorted(set(arrays) - known)
    if unknown:
        raise ValueError(f"unexpected arrays {unknown[:5]}")
    table = PatternTable()
    pats: list[Pattern] = []
    for k in range(npat):
        shape_arr = _index_array(arrays, f"pat{k}_shape")
        if shape_arr.shape != (2,):
            raise ValueError(f"array 'pat{k}_shape': expected 2 entries, got {shape_arr.shape[0]}")
        shape = (int(shape_arr[0]), int(shape_arr[1]))
        p = validated_pattern(shape, _index_array(arrays, f"pat{k}_indptr"),
                              _index_array(arrays, f"pat{k}_indices"), where=f"stored pattern {k}")
        if p.key in table._by_key:
            raise ValueError(f"stored pattern {k} repeats an earlier one")
        pats.append(table.intern(p))
    layers = _index_array(arrays, "layers")
    if layers.shape != (n,):
        raise ValueError(f"array 'layers' has {layers.shape[0]} entries, header field 'n' is {n}")
    if n and (layers.min() < 0 or layers.max() >= npat):
        raise ValueError(f"array 'layers': pattern ids must lie in [0, {npat}), got [{layers.min()}, {layers.max()}]")
    # a full pattern no layer uses belongs to a product stored densely: it needs only its shape
    layer_ids = set(layers.tolist())
    pats = [full_pattern(*p.shape) if p.is_full and k not in layer_ids else p for k, p in enumerate(pats)]
    chain = [pats[i] for i in layers.tolist()]
    for i in range(1, n):
        if chain[i - 1].cols != chain[i].rows:
            raise ValueError(f"array 'layers': layer {i + 1} has shape {chain[i].shape}, layer {i} has "
                             f"{chain[i - 1].shape}: the chain does not chain")
    return table, pats, chain, nsym


def _candidates(header: dict[str, Any], levels: int, explored: int) -> dict[int, float]:
    cand_raw = header["candidates"]
    if not isinstance(cand_raw, dict):
        raise ValueError(f"header field 'candidates': expected an object, got {cand_raw!r}")
    candidates: dict[int, float] = {}
    for k, v in cand_raw.items():
        if not (k.isdigit() and int(k) <= explored and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) and v >= 0):
            raise ValueError(f"header field 'candidates': entry {k!r}: {v!r} is not a depth in [0, {explored}] "
                             f"with a finite time")
        candidates[int(k)] = float(v)
    if levels not in candidates:
        raise ValueError(f"header field 'candidates' has no entry for the depth in use ({levels})")
    return candidates


class _StoredProducts:
    """The stored products checked against the schedule, their operands and the planner's storage rule.

    Storage decisions are re-made as the planner makes them: a product's storage is settled when the
    step reading it comes (jointly with the other operand of the product taking it), else at the end.
    """

    def __init__(self, arrays, table: PatternTable, pats: list[Pattern], chain: list[Pattern], nsym: int,
                 sched, profile, batch_hint: int) -> None:
        self.arrays, self.table, self.pats, self.nsym = arrays, table, pats, nsym
        self.profile, self.batch_hint = profile, batch_hint
        prod = _index_array(arrays, "products", ndim=2)
        if prod.shape[1:] != (_PRODUCT_FIELDS,):
            raise ValueError(f"array 'products': expected rows of {_PRODUCT_FIELDS} fields, got shape {prod.shape}")
        self.rows = prod.tolist()
        mids = sorted(r[0] for r in self.rows)
        if mids != sorted(sched.products):
            raise ValueError(f"array 'products': holds product ids {mids[:8]}..., the depth-{sched.levels} schedule "
                             f"has {sorted(sched.products)[:8]}... ({len(sched.products)} products)")
        self.by_mid = {r[0]: r for r in self.rows}
        self.mats: dict[int, MatInfo] = {i: MatInfo(p, "input") for i, p in enumerate(chain)}
        self.syms: dict[tuple, ProductSymbolic] = {}
        self.checked: dict = {}
        self.rowwise_cache: dict = {}
        self.used_syms: set[int] = set()
        self.rule = StorageRule(profile, batch_hint)
        self.rule_name = ("the cost of what reads it" if profile.dense_threshold is None
                          else f"the dense threshold {profile.dense_threshold}")
        self.uses = matrix_uses(sched) if sched.products else {}
        self.pending: dict[int, tuple[Pattern, Pattern, Any]] = {}  # product id -> operands, own pattern getter
        self.flags: dict[int, bool] = {}
        for st in sched.steps:  # operands are always products of earlier steps (or inputs)
            self._settle_step(st)
            for op in st.mm:
                self._check(op)
        for mid in sorted(self.pending):
            self._settle(mid, self._alone(mid))
        if len(self.used_syms) != nsym:
            raise ValueError(f"pair lists {sorted(set(range(nsym)) - self.used_syms)[:5]} are stored but no product "
                             f"uses them")

    def _settle(self, mid: int, dense: bool) -> None:
        self.pending.pop(mid)
        if self.flags[mid] != dense:
            raise ValueError(f"product {mid}: stored {_storage_name(self.flags[mid])}, but the planner's storage rule "
                             f"({self.rule_name}, batch hint {self.batch_hint}) stores it {_storage_name(dense)}")

    def _alone(self, mid: int) -> bool:
        a, b, own = self.pending[mid]
        rw = not (a.is_full and b.is_full) and self._rowwise(a, b)
        return decide_alone(self.rule, a, b, self.uses.get(mid, ((), None))[0], rw,
                            lambda: estimate_product_nnz(a, b), own)

    def _rowwise(self, a: Pattern, b: Pattern) -> bool:
        return pair_list_bytes(product_counts(a, b), 0) > self.profile.pair_list_max_bytes

    def _settle_step(self, st) -> None:
        pending, mats, uses = self.pending, self.mats, self.uses
        for op in st.mm:
            pl, pr = op.left in pending, op.right in pending
            if not (pl or pr):
                continue
            lp = pending[op.left][2]() if pl else mats[op.left].pattern
            rp = pending[op.right][2]() if pr else mats[op.right].pattern
            dl = dr = False
            if (pl and not lp.is_full) or (pr and not rp.is_full):
                dl, dr = self.rule.joint(lp, rp, uses[op.left] if pl else None, uses[op.right] if pr else None,
                                         product_counts(lp, rp))
            if pl:
                self._settle(op.left, dl)
            if pr:
                self._settle(op.right, dr)
        for op in st.mv:
            if op.mat in pending:
                self._settle(op.mat, self._alone(op.mat))

    def _check(self, op) -> None:
        """One stored product against its operands: pattern, kind, work and pair lists."""
        mid, pidx, algo, macs, sidx, dense = self.by_mid[op.out]
        where, npat = f"product {mid}", len(self.pats)
        if not 0 <= pidx < npat:
            raise ValueError(f"{where}: pattern id {pidx} not in [0, {npat})")
        if dense not in (0, 1):
            raise ValueError(f"{where}: storage decision {dense} is not 0 (own pattern) or 1 (dense)")
        dense = bool(dense)
        c, a, b = self.pats[pidx], self.mats[op.left].pattern, self.mats[op.right].pattern
        if c.shape != (a.rows, b.cols):
            raise ValueError(f"{where}: pattern has shape {c.shape}, its operands give {(a.rows, b.cols)}")
        if dense and not c.is_full:
            raise ValueError(f"{where}: recorded as stored densely, but its stored pattern is not the full one")
        dense_pair = a.is_full and b.is_full
        self.flags[mid] = dense
        if algo == 0:
            if not (dense_pair and c.is_full):
                raise ValueError(f"{where}: stored as a dense GEMM, but its operands or output are not dense")
            if macs != a.rows * a.cols * b.cols or sidx != -1:
                raise ValueError(f"{where}: GEMM work {macs} / pair list {sidx}, expected "
                                 f"{a.rows * a.cols * b.cols} / -1")
            if dense:
                raise ValueError(f"{where}: a GEMM product is dense by its operands, recorded as densified")
            self.mats[mid] = MatInfo(c, "gemm", gemm_macs=macs)
            self.pending[mid] = (a, b, lambda c=c: c)
            return
        if algo not in (1, 2):
            raise ValueError(f"{where}: storage kind {algo} is not 0 (GEMM), 1 (pairs) or 2 (row-wise)")
        if dense_pair:
            raise ValueError(f"{where}: both operands are dense, the planner multiplies them as a GEMM")
        rowwise = self._rowwise(a, b)
        if rowwise != (algo == 2):
            raise ValueError(f"{where}: stored {'row-wise' if algo == 2 else 'with pair lists'}, but the planner "
                             f"runs it {'row-wise' if rowwise else 'with pair lists'} (pair-list limit "
                             f"{self.profile.pair_list_max_bytes:.0f} bytes)")
        if algo == 2:
            self.mats[mid] = _rowwise(where, a, b, c, macs, sidx, dense, self.rowwise_cache)
            cache = self.rowwise_cache
            own = (lambda c=c: c) if not c.is_full else (lambda a=a, b=b: _own_rows(a, b, cache))
        else:
            own_pattern = self._pairs(where, a, b, c, macs, sidx, dense, mid)
            own = lambda p=own_pattern: p  # noqa: E731
        if not dense and c.is_full and not own().is_full:
            raise ValueError(f"{where}: recorded as stored with its own pattern, but stored dense while its own "
                             f"pattern is not full")
        self.pending[mid] = (a, b, own)

    def _pairs(self, where: str, a: Pattern, b: Pattern, c: Pattern, macs: int, sidx: int, dense: bool,
               mid: int) -> Pattern:
        """A pair-list product: its stored pairs checked; the own pattern they reach."""
        if macs != 0 or not 0 <= sidx < self.nsym:
            raise ValueError(f"{where}: expected GEMM work 0 and a pair list id in [0, {self.nsym}), "
                             f"got {macs} and {sidx}")
        syms, arrays = self.syms, self.arrays
        sym = syms.get((sidx, c.key))
        if sym is None:
            sym = ProductSymbolic(c, _index_array(arrays, f"sym{sidx}_ptr"),
                                  _index_array(arrays, f"sym{sidx}_a"), _index_array(arrays, f"sym{sidx}_b"))
            syms[(sidx, c.key)] = sym
        own_pattern = _check_pairs(where, a, b, c, sym, self.checked)
        self.used_syms.add(sidx)
        if own_pattern.nnz != c.nnz:  # held over the own pattern (pair data O(pairs + nnz))
            ptr = sym.pair_ptr
            reached = np.flatnonzero(np.diff(ptr))
            own_sym = syms.get((sidx, c.key, "own"))
            if own_sym is None:
                own_sym = syms[(sidx, c.key, "own")] = ProductSymbolic(
                    self.table.intern(own_pattern), np.concatenate([[0], ptr[reached + 1]]).astype(np.int64),
                    sym.pair_a, sym.pair_b)
            sym = own_sym
        self.mats[mid] = MatInfo(c, "pairs", sym=sym, densified=dense)
        return own_pattern


def _parse(arrays: dict[str, np.ndarray]) -> tuple[ScanPlan, dict[str, Any]]:
    header = _header(arrays)
    n = _int_field(header, "n", 1)
    table, pats, chain, nsym = _stored_patterns(arrays, n)
    kmax = max_levels(n)
    levels = _int_field(header, "levels", 0, kmax)
    explored = _int_field(header, "explored", levels, kmax)
    batch_hint = _int_field(header, "batch_hint", 1)
    elem_bytes = header.get("elem_bytes")
    if elem_bytes not in (4, 8) or not _is_int(elem_bytes):
        raise ValueError(f"header field 'elem_bytes': expected 4 or 8, got {elem_bytes!r}")
    profile = _profile(header["profile"])
    candidates = _candidates(header, levels, explored)
    options = _options(header["options"], levels, kmax, elem_bytes)
    # products: exactly the schedule's, each consistent with its operands
    sched = blelloch_schedule(n, levels)
    products = _StoredProducts(arrays, table, pats, chain, nsym, sched, profile, batch_hint)
    layers = _index_array(arrays, "layers")
    used = set(layers.tolist()) | {r[1] for r in products.rows}
    if len(used) != len(pats):
        raise ValueError(f"stored patterns {sorted(set(range(len(pats))) - used)[:5]} are used by no layer or product")
    plan = ScanPlan(chain, levels, products.mats, sched, profile, batch_hint, elem_bytes, candidates, explored)
    return plan, options


def load_scan(path) -> tuple[ScanPlan, dict[str, Any]]:
    """Read and verify a plan file written by :func:`save_scan`.

    Returns the plan and the options it was saved with (keys ``OPTION_KEYS``, values checked).
    Raises ``ValueError`` (naming the file and the field) for an unreadable, truncated, corrupted
    or inconsistent file; ``FileNotFoundError`` if there is none.
    """
    arrays = _read_arrays(path)
    try:
        return _parse(arrays)
    except ValueError as exc:
        raise ValueError(f"{path}: corrupted spscan plan: {exc}") from exc
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError) as exc:
        raise ValueError(f"{path}: corrupted spscan plan: missing or malformed {type(exc).__name__}: {exc}") from exc
