"""The unit contract every layer of the library keeps, and the helpers the families share.

Every activation is flattened per sample in row-major ``(C, *spatial)`` order, exactly as
``x.flatten(1)`` does, so a layer mapping ``(B, *in_shape)`` to ``(B, *out_shape)`` has
``J^T`` of shape ``(d_in, d_out)`` with ``d_in = prod(in_shape)`` and ``d_out = prod(out_shape)``.

A unit's life:

* ``__init__`` (plan time, once): from shapes, hyper-parameters and any pruning mask only,
  build the canonical SciPy CSR ``pattern`` and the gather indices that map each stored entry
  to the tensor it is read from (a weight element, an activation element, ...).
* ``run(x, tensors)`` (every step): the layer's forward on ``(B, *in_shape)``; returns the
  output and what ``fill`` and ``param_grads`` need (saved activations, argmax indices, masks).
* ``fill(saved, tensors)``: the entries of ``J^T`` in the pattern's CSR order, ``(nnz,)`` when
  they do not depend on the sample (shared by the batch) or ``(B, nnz)`` otherwise.
* ``apply_transposed(saved, tensors, g)``: ``J^T g`` without forming ``J^T`` (the structured
  operator), for units that declare one.
* ``param_grads(saved, tensors, g_out)``: ``dl/dθ`` for each of the unit's learnable tensors
  from ``g_out = dl/dx_out`` of shape ``(B, d_out)``.

What a unit can do beyond that is declared, not probed: :class:`UnitCapabilities`.

``tensors`` are the *effective* learnable tensors (for a module pruned with
``torch.nn.utils.prune`` that is ``weight_orig * weight_mask``), so the caller decides whether
they carry an autograd graph.

Pruning: entries of ``J^T`` that read a pruned weight (``weight_mask == 0``, or an exactly-zero
weight with ``prune_zeros=True``) are left out of the pattern. Those weights must stay zero
for as long as the plan is used; every ``run`` checks it and raises if one became non-zero.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn

from spscan.kernels.backend import StructuredOperator

__all__ = ["UnitCapabilities", "LayerUnit", "UnitOperator", "coo_to_csr"]


# ----------------------------------------------------------------------------- helpers


def coo_to_csr(rows: np.ndarray, cols: np.ndarray,
               shape: tuple[int, int]) -> tuple[sp.csr_array, Union[np.ndarray, slice]]:
    """Canonical CSR pattern from structural entries ``(rows[k], cols[k])``.

    Returns the pattern (data all ones, sorted indices, no duplicates) and ``order``, the
    permutation such that CSR entry ``e`` is structural entry ``order[e]`` (``slice(None)`` when the
    entries already came in CSR order). Raises if two
    structural entries coincide (a layer generator bug: each unit maps every entry to one source).
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    key = rows * np.int64(shape[1]) + cols
    step = np.diff(key)
    order: Union[np.ndarray, slice]
    if step.size == 0 or bool((step > 0).all()):
        order = slice(None)  # generated in CSR order already: no sort, no copies
        r, c = rows, cols
    else:
        order = np.argsort(key, kind="stable")
        key = key[order]
        step = np.diff(key)
        r, c = rows[order], cols[order]
    if bool((step == 0).any()):
        k = int(np.flatnonzero(step == 0)[0])
        raise ValueError(f"duplicate structural entry ({r[k]}, {c[k]}) in a generated pattern")
    indptr = np.zeros(shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=shape[0]), out=indptr[1:])
    index_dtype = np.int32 if max(shape) < 2**31 - 1 and r.size < 2**31 - 1 else np.int64
    pattern = sp.csr_array(
        (np.ones(r.size), c.astype(index_dtype), indptr.astype(index_dtype)), shape=shape
    )
    return pattern, order


#: the most entries one layer's ``J^T`` pattern is built with. A convolution's holds ``C_out H W C_in k^2 / groups``,
#: a linear map on tokens ``T d_in d_out``: an ImageNet-size ResNet's convolutions hold 10^8 each (gigabytes to
#: plan, and no scan would multiply them faster than the layer's own backward). A larger layer runs as its own
#: call and autograd backward (an opaque node).
MAX_PATTERN_ENTRIES = 1 << 25


def check_pattern_entries(index: int, name: str, entries: int) -> None:
    """Refuse (ValueError: the planner makes the layer an opaque node) a pattern of more than
    :data:`MAX_PATTERN_ENTRIES` entries."""
    if entries > MAX_PATTERN_ENTRIES:
        raise ValueError(f"layer {index} ({name}): its J^T would hold {entries:,} entries, more than "
                         f"{MAX_PATTERN_ENTRIES:,}: a layer this large runs as its own call and backward")


def _prod(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        if len(v) != n:
            raise ValueError(f"expected {n} values, got {v!r}")
        return tuple(int(t) for t in v)
    return (int(v),) * n


def _flat_index(idx: Sequence[np.ndarray], dims: Sequence[int]) -> np.ndarray:
    """Row-major flat index of a multi-index (numpy broadcasting)."""
    out = np.zeros(np.broadcast(*idx).shape, dtype=np.int64) if len(idx) else np.zeros((), np.int64)
    for i, d in zip(idx, dims):
        out = out * d + i
    return out


class PerDevice:
    """A value made once per ``(dtype, device)`` by ``make(dtype, device)`` and kept for its owner's life: a
    unit's or block's index tables and constant ``J^T`` values, which no step makes or copies to the device
    again. An index table (:meth:`index`) has one dtype, its own: it is keyed by device alone (:meth:`on`)."""

    __slots__ = ("_make", "_made", "array")

    def __init__(self, make: Callable[[Optional[torch.dtype], torch.device], Any],
                 array: Optional[np.ndarray] = None) -> None:
        self._make = make
        self._made: dict[tuple, Any] = {}
        self.array = array  # an index table's host array (None for a made value)

    @classmethod
    def index(cls, array: Any) -> "PerDevice":
        """An int64 index table (a numpy array, or a CPU tensor) with its per-device copies."""
        if isinstance(array, torch.Tensor):
            array = array.numpy()
        a = np.ascontiguousarray(array, dtype=np.int64)
        a = a if a.flags.writeable else a.copy()  # broadcast views are read-only; torch wants writable
        return cls(lambda dtype, device: torch.from_numpy(a).to(device), a)

    def get(self, dtype: Optional[torch.dtype], device: torch.device) -> Any:
        key = (dtype, device)
        v = self._made.get(key)
        if v is None:
            v = self._made[key] = self._make(dtype, device)
        return v

    def on(self, device: torch.device) -> Any:
        """An index table on ``device``."""
        return self.get(None, device)


def _effective(module: nn.Module, role: str) -> Optional[torch.Tensor]:
    if hasattr(module, role + "_orig") and hasattr(module, role + "_mask"):
        # pruned by torch.nn.utils.prune: recompute as its forward pre-hook does, keeping the graph
        return getattr(module, role + "_orig") * getattr(module, role + "_mask")
    return getattr(module, role, None)


def _identity_pattern(d: int) -> sp.csr_array:
    ar = np.arange(d, dtype=np.int32)
    return sp.csr_array((np.ones(d), ar, np.arange(d + 1, dtype=np.int32)), shape=(d, d))


# ----------------------------------------------------------------------------- the contract


@dataclass(frozen=True)
class UnitCapabilities:
    """What a unit can do beyond its pattern, fill and parameter-gradient rule, declared by its
    class (:attr:`LayerUnit.capabilities`) and narrowed per module or per plan-time structure by
    :meth:`LayerUnit.capabilities_for` or the unit's ``__init__``; callers read these flags and
    never probe a unit for methods.

    Attributes:
        shape_preserving: the per-sample output shape is the input's, so planning knows it without
            calling the module (dropout would draw random numbers, train-mode BatchNorm would
            update its running statistics).
        structured_operator: :meth:`LayerUnit.apply_transposed` applies ``J^T`` matrix-free
            (:attr:`LayerUnit.has_operator` reads this flag).
        fused_param_grads: :meth:`LayerUnit.apply_transposed_and_param_grads` computes ``J^T g`` and
            the parameter gradients from one call of the layer's backward kernel.
        mode_dependent: ``shared``, ``has_operator`` or ``has_csr_values`` follow the module's mode
            (train/eval), so the wrapper re-reads them every step.
        low_rank_factors: ``J^T`` is also available as two sparse factors (:class:`LowRankFactors`:
            ``factor_patterns``, ``factor_fill``, ``factor_shared``) that a plan may use instead.
        relu_mask: ``J^T`` is the 0/1 mask of the sign of the unit's saved output (a ReLU), which a
            layer above that keeps that output can apply for it.
        fuses_relu_below: ``chain_step(needed, relu_below=True)`` applies, together with this unit's
            ``J^T``, the :attr:`relu_mask` of the layer right below, whose own step is then
            ``chain_step(needed, masked_above=True)`` (the identity).
    """

    shape_preserving: bool = False
    structured_operator: bool = False
    fused_param_grads: bool = False
    mode_dependent: bool = False
    low_rank_factors: bool = False
    relu_mask: bool = False
    fuses_relu_below: bool = False


class LayerUnit(abc.ABC):
    """One layer of a chain: its pattern, its value fill, its structured operator and its
    parameter-gradient rule.

    Every unit provides :meth:`run` and :meth:`fill` and sets :attr:`pattern` in ``__init__``; it
    overrides :meth:`apply_transposed` exactly when it declares ``structured_operator`` and
    :meth:`apply_transposed_and_param_grads` exactly when it declares ``fused_param_grads``
    (checked when the class is defined); :meth:`param_grads` where it has learnable tensors.

    Attributes:
        index: position of the layer in the (flattened) chain, for messages.
        module: the ``nn.Module`` it stands for.
        in_shape, out_shape: per-sample shapes (no batch dimension).
        pattern: canonical SciPy CSR array of shape ``(d_in, d_out)``; its data is all ones.
        shared: ``True`` if ``fill`` returns ``(nnz,)`` values shared by the batch.
        roles: names of the learnable tensors on the module (``"weight"``, ``"bias"``) that
            ``tensors``/``param_grads`` refer to, in order; absent (``None``) ones are left out.
        capabilities: what this unit declares (:class:`UnitCapabilities`).
    """

    shared: bool = False
    roles: tuple[str, ...] = ()
    capabilities: UnitCapabilities = UnitCapabilities()
    #: the unit reads an integer input (token ids into an embedding): it has no input gradient
    integer_input: bool = False
    pattern: sp.csr_array

    _DECLARED: ClassVar[tuple[tuple[str, str], ...]] = (
        ("structured_operator", "apply_transposed"),
        ("fused_param_grads", "apply_transposed_and_param_grads"),
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for flag, method in LayerUnit._DECLARED:  # a declared capability and its method go together
            overridden = getattr(cls, method) is not getattr(LayerUnit, method)
            if getattr(cls.capabilities, flag) != overridden:
                raise TypeError(f"{cls.__name__}: capabilities.{flag}={getattr(cls.capabilities, flag)} but "
                                f"{method} is {'' if overridden else 'not '}overridden")

    def __init__(self, index: int, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        self.index = index
        self.module = module
        self.in_shape = tuple(in_shape)
        self.out_shape = tuple(out_shape)
        self.d_in = _prod(self.in_shape)
        self.d_out = _prod(self.out_shape)
        self.roles = tuple(r for r in type(self).roles if _effective(module, r) is not None)
        self.capabilities = type(self).capabilities_for(module)

    @classmethod
    def capabilities_for(cls, module: nn.Module) -> UnitCapabilities:
        """What the unit of ``module`` declares, known before it is built (planning reads
        ``shape_preserving`` here to find the output shape)."""
        return cls.capabilities

    # -- learnable tensors
    def tensors(self) -> list[torch.Tensor]:
        """The effective learnable tensors (``orig * mask`` for pruned ones), in ``roles`` order."""
        return [_effective(self.module, r) for r in self.roles]

    def parameters_for_roles(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        """For each role, the ``nn.Parameter`` that holds it and the pruning mask (or ``None``)."""
        out = []
        for r in self.roles:
            if hasattr(self.module, r + "_orig") and hasattr(self.module, r + "_mask"):
                out.append((getattr(self.module, r + "_orig"), getattr(self.module, r + "_mask")))
            else:
                out.append((getattr(self.module, r), None))
        return out

    @property
    def name(self) -> str:
        return type(self.module).__name__

    # -- per step
    @abc.abstractmethod
    def run(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """The layer's forward from its effective tensors, and what ``fill``/``param_grads`` need."""

    @abc.abstractmethod
    def fill(self, saved: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``J^T`` values in the pattern's CSR order: ``(B, nnz)`` per sample or ``(nnz,)`` shared."""

    def param_grads(self, saved: Any, tensors: Sequence[torch.Tensor], g_out: torch.Tensor,
                    needed: Optional[Sequence[bool]] = None) -> list[Optional[torch.Tensor]]:
        """``dl/dθ`` for each role; ``needed[k] = False`` skips role ``k`` (returns ``None``)."""
        return [None] * len(self.roles)

    def batched_weight_grad_key(self) -> Optional[tuple]:
        """Units whose weight gradient (role 0) is ``g^T x``, from the saved input ``x`` ``(B, fan_in)``
        and ``g = dl/dy`` ``(B, fan_out)``, return a key: units with equal keys compute theirs in one
        batched GEMM. ``None`` (the default): the unit's own :meth:`param_grads`."""
        return None

    # -- the structured operator (matrix-free J^T)
    def apply_transposed(self, saved: Any, tensors: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
        """``J^T g`` for ``g`` ``(B, d_out)`` without forming ``J^T``: ``(B, d_in)`` (units that declare
        ``structured_operator``)."""
        raise NotImplementedError(f"{type(self).__name__} has no structured operator")

    def apply_transposed_into(self, saved: Any, tensors: Sequence[torch.Tensor], g: torch.Tensor,
                              out: torch.Tensor) -> torch.Tensor:
        """:meth:`apply_transposed`, written into ``out`` ``(B, d_in)`` where the unit can; the result
        (``out`` or a new tensor) is returned."""
        return self.apply_transposed(saved, tensors, g)

    def apply_transposed_and_param_grads(self, saved: Any, tensors: Sequence[torch.Tensor], g: torch.Tensor,
                                         needed: Sequence[bool]) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """``(J^T g, parameter gradients)`` for ``g = dl/dy``; one backward-kernel call in units that
        declare ``fused_param_grads``, else the two rules one after the other."""
        return self.apply_transposed(saved, tensors, g), self.param_grads(saved, tensors, g, needed)

    @property
    def cost_family(self) -> str:
        """The family whose fitted step costs predict this layer's (:mod:`spscan.planner.step_profile`): the
        unit's class, or ``csr`` for a unit applied through its CSR values."""
        return type(self).__name__ if self.has_operator else "csr"

    @property
    def cost_entries(self) -> int:
        """What a unit's work per sample scales with besides its input and output elements: the stored
        entries of ``J^T``, which a structured operator or a CSR product reads once each. A unit whose
        operator does less than its CSR pattern holds says so (the normalizations: O(d) against dense
        blocks)."""
        return int(self.pattern.nnz)

    def cost_work(self, batch: int) -> float:
        """The work measure of this unit at batch ``batch``: ``B * (cost_entries + d_in + d_out)``."""
        return float(batch) * (self.cost_entries + self.d_in + self.d_out)

    def cost_terms(self, batch: int) -> list[tuple]:
        """The terms a step profile prices for this unit at batch ``batch`` (see
        :meth:`~spscan.planner.step_profile.StepProfile.layers_time`): one layer of :attr:`cost_family`
        and :meth:`cost_work` (what most analytic units are)."""
        return [(self.cost_family, self.cost_work(batch))]

    @property
    def has_operator(self) -> bool:
        """Whether :meth:`apply_transposed` is available (the unit has a structured operator)."""
        return self.capabilities.structured_operator

    @property
    def has_csr_values(self) -> bool:
        """Whether :meth:`fill` can give per-sample CSR values now (a layer that couples the samples
        of a batch cannot: it runs as a structured operator only)."""
        return True

    #: why a unit without CSR values (:attr:`has_csr_values` ``False``) runs only as its operator, for messages
    operator_only_because: str = "in train mode it couples the samples of a batch"

    def operator(self, saved: Any, tensors: Sequence[torch.Tensor],
                 needed: Optional[Sequence[bool]] = None) -> "UnitOperator":
        """This step's ``J^T`` as a :class:`~spscan.kernels.backend.StructuredOperator`. ``needed``: the
        roles whose parameter gradients the operator may compute along with ``J^T g`` when that is
        cheaper (it is then applied to ``g = dl/d output`` exactly once, as in the linear scan)."""
        return UnitOperator(self, saved, tensors, needed)

    def chain_step(self, needed: Optional[Sequence[bool]] = None):
        """This layer's step of a depth-0 operator chain, decided once per signature: a function
        ``step(saved, tensors, g) -> (gi, grads)`` with ``g = dl/dy`` of shape ``(B, *out_shape)`` (or
        ``(B, d_out)``) and ``gi = J^T g`` of shape ``(B, *in_shape)``; ``grads`` is ``None`` when no role is
        ``needed``, else one entry per role (``None`` where not needed), computed from the same ``g``.

        Activations keep their natural shapes from step to step (no flattening between layers, as in
        autograd). The default adapts :meth:`apply_transposed` and
        :meth:`apply_transposed_and_param_grads`; units override it with the one or two ATen calls
        autograd makes for the layer, their arguments fixed here.
        """
        want = list(needed) if needed is not None and any(needed) else None
        in_shape, d_out = self.in_shape, self.d_out
        apply, both = self.apply_transposed, self.apply_transposed_and_param_grads

        def step(saved, tensors, g):
            b = g.shape[0]
            g = g.reshape(b, d_out)
            if want is None:
                return apply(saved, tensors, g).reshape((b,) + in_shape), None
            gi, pg = both(saved, tensors, g, want)
            return gi.reshape((b,) + in_shape), pg

        return step

    @property
    def nnz(self) -> int:
        return int(self.pattern.nnz)

    def sparsity(self) -> float:
        """Fraction of guaranteed zeros: ``1 - nnz / (d_in * d_out)``."""
        return 1.0 - self.nnz / (self.d_in * self.d_out)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(index={self.index}, {self.name}, {self.in_shape}->{self.out_shape}, "
                f"nnz={self.nnz}, {'shared' if self.shared else 'per-sample'})")


class UnitOperator(StructuredOperator):
    """A unit's ``J^T`` for one step: :meth:`apply` is the layer's own input-gradient op (a conv's
    transposed convolution with the shared weight, a mask multiply for ReLU, a matmul for Linear,
    the pooling backward for max-pool); :meth:`values` fills the CSR values only when asked."""

    def __init__(self, unit: LayerUnit, saved: Any, tensors: Sequence[torch.Tensor],
                 needed: Optional[Sequence[bool]] = None) -> None:
        self.unit, self.saved, self.tensors = unit, saved, tensors
        self.shape = (unit.d_in, unit.d_out)
        self.shared = bool(unit.shared)
        self.needed = needed
        self.param_grads: Optional[list] = None  # set when apply() computed them on the way
        self.applied = 0

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return self.apply_into(g, None)

    def apply_into(self, g: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        self.applied += 1
        unit = self.unit
        if unit.capabilities.fused_param_grads and self.needed is not None and any(self.needed):
            gi, self.param_grads = unit.apply_transposed_and_param_grads(self.saved, self.tensors, g, self.needed)
            return gi
        if out is not None:
            return unit.apply_transposed_into(self.saved, self.tensors, g, out)
        return unit.apply_transposed(self.saved, self.tensors, g)

    def values(self) -> torch.Tensor:
        return self.unit.fill(self.saved, self.tensors)
