"""A layer plan's backward (a chain of layers or a traced graph's chain of blocks), decided once per
signature: the step's values or structured operators, the scan, and the parameter gradients.

:class:`StepBackward` is made by :meth:`spscan.chain.model.ModelPlan._step_backward` (cached per which
inputs need gradients, the device and the mode of mode-dependent layers) and run by the autograd
bridge for every ``loss.backward()``. :class:`Jacobians` is what ``spscan.forward`` returns for a
model plan; :func:`unit_param_grads` and :func:`collect_param_grads` turn the scan's gradients into
parameter gradients (same-shaped weight gradients batched into one GEMM).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from spscan.runtime.autograd import keep_graph
from spscan.layers import UnitOperator

__all__ = ["RELEASED", "ForwardState", "FusedUnitOperator", "Jacobians", "StepBackward", "collect_param_grads",
           "needed_per_unit", "unit_param_grads"]


class Jacobians(Sequence[torch.Tensor]):
    """The values of one step's transposed Jacobians, plus what the parameter gradients need.

    Indexing gives ``values[i-1]`` for the core chain's element ``i`` (``J_i^T``, or one of the two
    factors of a factored layer, :attr:`ModelPlan.factored`): ``(B, nnz_i)`` per sample or
    ``(nnz_i,)`` shared, in the pattern's CSR order, so the object can be passed wherever a list of
    values is expected.

    Attributes:
        values: list of value tensors, one per element of the plan's core chain.
        batch: ``B``.
        saved: per layer, what its parameter-gradient rule reads (its input, ...).
        tensors: per layer, the effective learnable tensors used in the forward.
    """

    def __init__(self, values: list[torch.Tensor], batch: int, saved: list[Any], tensors: list[list[torch.Tensor]]):
        self.values = values
        self.batch = batch
        self.saved = saved
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):  # type: ignore[override]
        return self.values[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.values)



def needed_per_unit(units: Sequence[Any], flags: Sequence[Any]) -> list[list[bool]]:
    """The autograd function's flat per-parameter flags (which parameters want a gradient, in the units' role
    order) as one list per unit."""
    needed, pos = [], 0
    for u in units:
        needed.append([bool(f) for f in flags[pos:pos + len(u.roles)]])
        pos += len(u.roles)
    return needed


def unit_param_grads(units: Sequence[Any], saved: Sequence[Any], tensors: Sequence[Sequence[torch.Tensor]],
                     grads: Sequence[Optional[torch.Tensor]], needed: list[list[bool]]) -> list[list[Optional[torch.Tensor]]]:
    """dl/dθ for every unit's roles w.r.t. the effective tensors, from ``grads[k + 1] = dl/dy_k`` (a chain's
    layer-boundary gradients); weight gradients the units declare batchable
    (:meth:`~spscan.layers.LayerUnit.batched_weight_grad_key`: same-shaped Linear layers) share one bmm."""
    out: list[list[Optional[torch.Tensor]]] = [[None] * len(u.roles) for u in units]
    groups: dict[tuple, list[int]] = {}
    for k, u in enumerate(units):
        key = u.batched_weight_grad_key() if u.roles and needed[k][0] else None
        if key is not None:
            groups.setdefault(key, []).append(k)
    batched: set[int] = set()
    for ks in groups.values():
        if len(ks) < 2:
            continue
        # all same-shaped weight gradients as one batched GEMM: (G, out, B) @ (G, B, in)
        g = torch.stack([grads[k + 1] for k in ks]).transpose(1, 2)
        x = torch.stack([saved[k] for k in ks])
        dw = torch.bmm(g, x)
        for j, k in enumerate(ks):
            out[k][0] = dw[j]
            batched.add(k)
    for k, u in enumerate(units):
        if not u.roles or not any(needed[k]):
            continue
        need = list(needed[k])
        if k in batched:
            need[0] = False
        res = u.param_grads(saved[k], tensors[k], grads[k + 1], need)
        for r, v in enumerate(res):
            if k not in batched or r != 0:
                out[k][r] = v
    return out


def collect_param_grads(param_roles, per_unit) -> dict[str, torch.Tensor]:
    """``{parameter name: gradient}`` from per-unit role gradients: pruning masks applied, a parameter
    read by several units (shared weights) summed, roles not computed (``None``) left out."""
    result: dict[str, torch.Tensor] = {}
    for roles, gs in zip(param_roles, per_unit):
        for (name, _, mask), g in zip(roles, gs):
            if g is None:
                continue
            if mask is not None:
                g = g * mask
            result[name] = result[name] + g if name in result else g
    return result


# ----------------------------------------------------------------------------- the wrapper's step


RELEASED = ("Trying to backward through the graph a second time (or directly access saved tensors after they "
            "have already been freed): the spscan-wrapped module's saved activations were freed by the first "
            "backward; specify retain_graph=True there")


class ForwardState:
    """What one forward keeps for the backward (a non-tensor output of the autograd function)."""

    def __init__(self, saved: list[Any], tensors: list[list[torch.Tensor]], x_shape: torch.Size) -> None:
        self.saved, self.tensors, self.x_shape = saved, tensors, x_shape
        self.released = False  # the wrapper's backward freed the activations (graph not retained)
        self.graph = False  # the backward replays from a CUDA graph (spscan.runtime.graphed)


class FusedUnitOperator(UnitOperator):
    """A unit's ``J^T`` in the wrapper's depth-0 scan: applied once, to ``g = dl/dy``, it also computes
    the parameter gradients ``needed`` from that ``g`` — in the same call where the unit has one
    (a conv's ``convolution_backward``), else right after — as autograd does for each layer while
    the gradient is hot, so the scan need not keep every ``dl/dx_i`` for a second pass."""

    release: Optional[tuple[list, int]] = None  # (the forward's saved list, this layer): drop once applied

    def apply_into(self, g: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        unit = self.unit
        if self.needed is None or unit.capabilities.fused_param_grads:
            gi = super().apply_into(g, out)
        else:
            self.applied += 1
            if out is not None:
                gi = unit.apply_transposed_into(self.saved, self.tensors, g, out)
            else:
                gi = unit.apply_transposed(self.saved, self.tensors, g)
            self.param_grads = unit.param_grads(self.saved, self.tensors, g, self.needed)
        if self.release is not None:  # as autograd frees a node's saved tensors once it has run
            saved, k = self.release
            saved[k] = self.saved = None
        return gi


class StepBackward:
    """The wrapper's backward for one signature (see :meth:`ModelPlan._step_backward`), one for a chain of
    layers and a traced graph's chain of blocks alike, decided once: the bound core plan, the parameter
    gradients wanted per unit, and the lowest element the scan must apply when ``dl/dx_0`` is not wanted
    (frozen bottom layers cost nothing). The plan supplies each step's elements
    (:meth:`ModelPlan.step_elements`), the parameter gradients its operators computed while applied
    (:meth:`~ModelPlan.fused_param_grads`) and the rest (:meth:`~ModelPlan.unit_param_grads`).

    Where the core's elements are the layers themselves (:attr:`ModelPlan.layer_elements`) it also decides
    each layer's operator flag, which ``dl/dx_i`` the scan must keep (at depth 0 the operators compute
    their parameter gradients as they are applied, so only ``dl/dx_0`` and the inputs of the rest are
    kept), which activations can go as soon as they are read, and, for a plain linear scan of operators,
    the chain's steps themselves (dispatch, ATen arguments, fused parameter gradients)."""

    def __init__(self, plan, needs: tuple, device: torch.device) -> None:
        units = plan.units
        self.plan = plan
        self.first = bool(needs[1])
        self.needed = needed = needed_per_unit(units, needs[2:])
        self.bound = plan.core.bind(plan.element_shared, None, device, plan.element_operator_flags, self.first)
        fuse = plan.levels == 0
        # no dl/dx_0 wanted: the scan stops at the lowest element a wanted parameter gradient needs
        self.stop = 0 if self.first else plan.lowest_needed_element(needed)
        self.has_roles = any(u.roles for u in units)
        self.keep: Optional[list[bool]] = None
        self.release: list[int] = []
        self.chain: Optional[list[tuple[int, Any]]] = None
        self.layers: list[tuple[Any, bool, Optional[list[bool]]]] = []
        if not plan.layer_elements:
            return
        flags = plan.operator_flags
        # per layer: (unit, its operator flag, the roles its operator computes while applied, or None)
        self.layers = [(u, op, nd if (op and fuse and any(nd)) else None)
                       for u, op, nd in zip(units, flags, needed)]
        chain = self.bound.operator_chain if plan._ends is None else None
        if chain is None:
            return
        chain = tuple(k for k in chain if k >= self.stop)
        applied = set(chain)
        keep = [False] * (len(units) + 1)
        keep[0] = self.first
        for k, (u, op, fused) in enumerate(self.layers):
            if any(needed[k]) and (fused is None or k not in applied):
                keep[k + 1] = True
        self.keep = keep
        # layers whose saved activations nothing reads after their operator ran (not fused operators whose
        # parameter gradients come after the scan, which read them)
        self.release = [k for k in chain if self.layers[k][1] and not (any(needed[k]) and self.layers[k][2] is None)]
        if not fuse:
            return
        # depth 0, every applied layer an operator: the chain's steps decided here once (dispatch, ATen
        # arguments, fused parameter gradients); a step only binds the saved tensors and applies them.
        # A layer whose step applies the ReLU mask of the layer right below (a 2-d max-pool with disjoint
        # windows, at the pooled resolution): the ReLU's step passes g on (dl/dx between them not kept)
        relu_pool = {k for k in applied
                     if k - 1 in applied and units[k].capabilities.fuses_relu_below
                     and units[k - 1].capabilities.relu_mask and not keep[k]}
        masked = {k - 1 for k in relu_pool}
        self.chain = []
        for k in chain:
            nd = needed[k] if any(needed[k]) else None
            if k in relu_pool:
                step = units[k].chain_step(nd, relu_below=True)
            elif k in masked:
                step = units[k].chain_step(nd, masked_above=True)
            else:
                step = units[k].chain_step(nd)
            self.chain.append((k, step))
        # layers whose parameter gradients come after the scan (not applied: the bottom layer when
        # dl/dx_0 is not wanted), from the kept dl/dx_{k+1}
        self.rest = [k for k in range(len(units)) if any(needed[k]) and k not in applied]
        self.release_flags = [k in self.release for k in range(len(units))]
        self.role_slots = [(k, r) for k, u in enumerate(units) for r in range(len(u.roles))]

    def run(self, st: ForwardState, g: torch.Tensor) -> tuple:
        """``(None, dl/dx, *parameter gradients)`` for the autograd function, from ``g = dl/dy``
        ``(B, *out_shape)``."""
        if st.released:
            raise RuntimeError(RELEASED)
        if self.chain is not None:
            return self._run_chain(st, g)
        return self._run_general(st, g.reshape(g.shape[0], -1))

    def _apply_chain(self, st: ForwardState, g: torch.Tensor) -> tuple[list, list]:
        """The chain's steps applied to ``g`` in the engine's order (:attr:`BoundPlan.operator_chain`):
        ``(dl/dx_i kept, flattened, or None; parameter gradients per layer, or None)``. Activations nothing
        reads any more are freed as each step has run (a graph not retained)."""
        saved, tensors, keep = st.saved, st.tensors, self.keep
        n = len(saved)
        grads: list[Optional[torch.Tensor]] = [None] * (n + 1)
        per_unit: list[Any] = [None] * n
        release = self.release_flags if self.release and not keep_graph() else None
        if release is not None:
            st.released = True  # see _run_general
            saved = st.saved = list(saved)
        if keep[n]:
            grads[n] = g.clone()
        for k, step in self.chain:
            g, per_unit[k] = step(saved[k], tensors[k], g)
            if release is not None and release[k]:
                saved[k] = None
            if keep[k]:
                grads[k] = g
        for i, t in enumerate(grads):
            if t is not None and t.dim() != 2:
                grads[i] = t.reshape(t.shape[0], -1)
        return grads, per_unit

    def _run_chain(self, st: ForwardState, g: torch.Tensor) -> tuple:
        units = self.plan.units
        self.bound.check_memory(g.shape[0])
        grads, per_unit = self._apply_chain(st, g)
        saved, tensors = st.saved, st.tensors
        gx = grads[0].reshape(st.x_shape) if self.first else None
        if not self.has_roles:
            return (None, gx)
        rest = self.rest
        if len(rest) == 1:
            k = rest[0]
            per_unit[k] = units[k].param_grads(saved[k], tensors[k], grads[k + 1], self.needed[k])
        elif rest:  # same-shaped Linear layers share one GEMM there
            mask = [nd if k in rest else [False] * len(nd) for k, nd in enumerate(self.needed)]
            for k, gs in enumerate(self.plan.unit_param_grads(saved, tensors, grads, mask)):
                if k in rest:
                    per_unit[k] = gs
        needed = self.needed
        return (None, gx, *[per_unit[k][r] if per_unit[k] is not None and needed[k][r] else None
                            for k, r in self.role_slots])

    def _run_general(self, st: ForwardState, g: torch.Tensor) -> tuple:
        plan = self.plan
        values, elements = plan.step_elements(st, self)
        if self.release and not keep_graph():
            # the graph is freed after this backward: each layer's activations can go once its operator
            # has run (the peak and the pages touched stay near autograd's); a retained graph keeps them
            st.released = True
            saved = st.saved = list(st.saved)
            for k in self.release:
                values[k].release = (saved, k)
        grads = plan._layer_grads(self.bound.run(elements, g, check=False, keep=self.keep, stop=self.stop).grads)
        gx = grads[0].reshape(st.x_shape) if self.first else None
        if not self.has_roles:
            return (None, gx)
        needed = self.needed
        # parameter gradients a unit's operator computed while the scan applied it (one conv backward each);
        # the rest from the scan's gradients, afterwards
        done = plan.fused_param_grads(values)
        rest = [[n and (k not in done or done[k][r] is None) for r, n in enumerate(nd)]
                for k, nd in enumerate(needed)]
        if any(any(r) for r in rest):
            per_unit = plan.unit_param_grads(st.saved, st.tensors, grads, rest)
        else:
            per_unit = [[None] * len(u.roles) for u in plan.units]
        for k, d in done.items():
            for r, v in enumerate(d):
                if v is not None and needed[k][r]:
                    per_unit[k][r] = v
        return (None, gx, *[g for gs in per_unit for g in gs])
