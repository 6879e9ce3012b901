"""Plan files: a plain ``.npz`` of integer arrays and a JSON header (no pickled objects).

The file holds everything the symbolic phase produced (distinct patterns, which layer uses which,
every planned product with its pair lists, the depth and the cost-model constants), so loading
a plan does no symbolic work. Loading validates structure and raises ``ValueError`` on any
inconsistency (a truncated or edited file never yields a plan).
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import asdict
from typing import Any

import numpy as np

from .cost import DeviceProfile
from .patterns import Pattern, PatternTable, validated_pattern
from .planning import MatInfo, ScanPlan
from .schedule import blelloch_schedule
from .symbolic import ProductSymbolic

FORMAT = "spscan-plan"
VERSION = 1


def save_scan(path, plan: ScanPlan, options: dict[str, Any]) -> None:
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
        rec = [mid, pid(info.pattern), 0 if info.algo == "gemm" else 1, info.gemm_macs, -1]
        if info.sym is not None:
            if id(info.sym) not in syms:
                s = len(syms)
                syms[id(info.sym)] = s
                arrays[f"sym{s}_ptr"] = info.sym.pair_ptr
                arrays[f"sym{s}_a"] = info.sym.pair_a
                arrays[f"sym{s}_b"] = info.sym.pair_b
            rec[4] = syms[id(info.sym)]
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
    arrays["products"] = np.asarray(products, dtype=np.int64).reshape(-1, 5)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_scan(path) -> tuple[ScanPlan, dict[str, Any]]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{path}: not a readable spscan plan file ({exc})") from exc
    try:
        header = json.loads(arrays["header"].tobytes().decode())
        if header.get("format") != FORMAT:
            raise ValueError(f"format is {header.get('format')!r}, expected {FORMAT!r}")
        if header.get("version") != VERSION:
            raise ValueError(f"version {header.get('version')}, this spscan reads version {VERSION}")
        table = PatternTable()
        pats: dict[int, Pattern] = {}
        k = 0
        while f"pat{k}_indptr" in arrays:
            shape = tuple(int(x) for x in arrays[f"pat{k}_shape"])
            if len(shape) != 2:
                raise ValueError(f"stored pattern {k} has shape {shape}")
            pats[k] = table.intern(validated_pattern(
                shape, arrays[f"pat{k}_indptr"], arrays[f"pat{k}_indices"], where=f"stored pattern {k}"))
            k += 1
        n = int(header["n"])
        layers = arrays["layers"]
        if layers.shape != (n,):
            raise ValueError(f"layer table has {layers.shape} entries, expected ({n},)")
        mats: dict[int, MatInfo] = {i: MatInfo(pats[int(layers[i])], "input") for i in range(n)}
        syms: dict[int, ProductSymbolic] = {}
        for mid, pidx, algo, macs, sidx in arrays["products"].tolist():
            pattern = pats[pidx]
            if algo == 0:
                mats[mid] = MatInfo(pattern, "gemm", gemm_macs=int(macs))
                continue
            if sidx not in syms:
                ptr, a, b = arrays[f"sym{sidx}_ptr"], arrays[f"sym{sidx}_a"], arrays[f"sym{sidx}_b"]
                syms[sidx] = ProductSymbolic(pattern, ptr, a, b)
            mats[mid] = MatInfo(pattern, "pairs", sym=syms[sidx])
        levels = int(header["levels"])
        sched = blelloch_schedule(n, levels)
        for op in (op for st in sched.steps for op in st.mm):
            info, left, right = mats[op.out], mats[op.left].pattern, mats[op.right].pattern
            if info.pattern.shape != (left.rows, right.cols):
                raise ValueError(f"product {op.out} has shape {info.pattern.shape}, operands give "
                                 f"{(left.rows, right.cols)}")
            if info.sym is not None:
                s = info.sym
                if s.pair_ptr.shape != (info.pattern.nnz + 1,) or s.pair_ptr[-1] != s.npairs:
                    raise ValueError(f"product {op.out}: pair pointer does not match its pattern")
                if s.npairs and (s.pair_a.max() >= left.nnz or s.pair_b.max() >= right.nnz
                                 or min(s.pair_a.min(), s.pair_b.min()) < 0):
                    raise ValueError(f"product {op.out}: pair entries out of range")
        profile = DeviceProfile(**header["profile"])
        plan = ScanPlan([mats[i].pattern for i in range(n)], levels, mats, sched, profile,
                        int(header["batch_hint"]), int(header["elem_bytes"]),
                        {int(k): float(v) for k, v in header["candidates"].items()}, int(header["explored"]))
        return plan, header["options"]
    except ValueError as exc:
        raise ValueError(f"{path}: corrupted spscan plan: {exc}") from exc
    except (KeyError, TypeError, IndexError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: corrupted spscan plan: missing or malformed {exc}") from exc

