"""Stacked and bidirectional ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` via BPPSA, layer by layer.

A deep recurrent network is a 2-D grid (Naumov, ``papers/naumov-parallel-complexity-fwd-bwd.txt``
§2.2): state ``h^{(l)}_t`` depends on ``h^{(l)}_{t-1}`` (the recurrence of layer ``l``) and on
``z^{(l-1)}_t`` (the output of the layer below, after dropout). Its backward is the upper
block-bidiagonal system of eq. (24), whose diagonal blocks are themselves bidiagonal in the layer
index. This module solves it **exactly, block by block from the top layer down**:

* Layer ``l`` (each direction on its own) is a single-layer recurrence whose input sequence is
  ``z^{(l-1)}``. Given ``dl/dz^{(l)}_t`` for every ``t`` (the upstream gradient of the module's
  output for the top layer) and ``dl/dh^{(l)}_T`` (from ``h_n``, ``c_n``), its backward is the
  affine scan over time of :class:`spscan.recurrent.plan.RecurrentPlan` (``dl/dz^{(l)}_t`` enters as
  the per-step term), which also yields ``dl/dz^{(l-1)}_t = W_ih^{(l)T} (gate gradients)_t`` for
  all ``t`` in one GEMM, and the layer's parameter gradients.
* That input gradient, times the dropout mask between the layers (``mask / (1 - p)``, train mode
  only), is the next-lower layer's ``dl/dz^{(l-1)}``. Nothing else couples the layers, so this
  is the block back-substitution of eq. (24) with each diagonal block solved by a parallel scan.
* A bidirectional layer is two independent recurrences over the same input; the reverse one is
  the same single-layer recurrence over the time-reversed sequence (its output and gradients are
  flipped back), and the two input gradients add.

Why this formulation and not one scan over the whole grid: every block solve is a scan the
single-layer front end already plans (factored Jacobians, adaptive depth, the compiled CPU
middle), so the stacked module adds no new pattern and no approximation; the critical path is
``L`` scans one after another, each of depth ``O(log T)`` at full up-sweep depth, i.e.
``O(L log T)`` instead of backprop's ``O(L T)`` (each scan's depth is its own planner's choice,
``plan.levels``; on a 2-core CPU the cost model picks the fused linear scan, ``K = 0``). A scan
over layers as well (``O(log L log T)``, Naumov's cyclic reduction) would need the products of
whole-sequence blocks across layers, dense in time, which costs ``O(T)`` times more work for
the small ``L`` of practical stacks.

The forward runs the same per-(layer, direction) recurrences in the order torch does (each one
the single-layer module's own forward, cuDNN on GPU, or Newton's with ``forward="newton"``), with
the stacked module's own parameter objects: every (layer, direction) gets a single-layer module
*view* whose ``weight_ih_l0`` etc. **are** the stacked module's ``weight_ih_l1_reverse`` etc. (the
same ``nn.Parameter`` objects, no copies). Dropout between layers (train mode, ``dropout > 0``)
draws its masks exactly as torch's CPU implementation does: after layer ``l < L-1``, a
``(T, B, D*H)`` tensor of the layer's output dtype is filled with ``bernoulli_(1 - p)`` from the
default generator and divided by ``1 - p``, and the output is multiplied by it. So from the same
RNG state the masks and the RNG state afterwards are the module's own on CPU, and so are the
outputs: bitwise for unidirectional stacks; a reverse direction runs the single-layer forward over
a time-flipped copy of its input, whose input-projection GEMM may round differently in the last
bit. On CUDA torch's fused dropout kernel draws differently: there the masks are this module's,
equal in distribution but not torch's draw.

Not supported, refused with a ``ValueError``: LSTM ``proj_size > 0`` (the single-layer chain has
no projection element) and ``PackedSequence`` inputs (pad with
``torch.nn.utils.rnn.pad_packed_sequence`` and mask the loss instead; note that ``h_n`` and the
reverse direction then also run over the padding).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from spscan.recurrent.backward import check_input
from spscan.recurrent.cells import (MODULE_TYPES, Cell, check_cell_form, module_layout, module_output, sequence_dims,
                                    time_major)
from spscan.runtime.autograd import holds_tensors
from spscan.runtime.graphed import GraphedStep
from spscan.planner.choose import Decision
from spscan.recurrent.plan import RecurrentFront, RecurrentPlan

__all__ = ["StackedRecurrentPlan", "plan_stacked", "is_stacked"]

_PARAM_KINDS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def is_stacked(module: nn.Module) -> bool:
    """True for an ``nn.RNN``/``GRU``/``LSTM`` with ``num_layers > 1`` or ``bidirectional``."""
    return type(module) in MODULE_TYPES and (module.num_layers > 1 or bool(module.bidirectional))


def _check_module(module: nn.Module) -> Cell:
    """The module's cell; refuses what the layer-by-layer scan cannot do exactly, naming the argument."""
    return check_cell_form(module)


def _param_names(module: nn.Module, layer: int, direction: int) -> list[tuple[str, str]]:
    """``(view name, stacked name)`` of one (layer, direction)'s parameters, in torch's order."""
    suffix = f"_l{layer}" + ("_reverse" if direction else "")
    kinds = _PARAM_KINDS if module.bias else _PARAM_KINDS[:2]
    return [(k + "_l0", k + suffix) for k in kinds]


def _layer_view(module: nn.Module, cell: Cell, layer: int, direction: int) -> nn.Module:
    """A single-layer unidirectional module of ``module``'s class whose parameters are the stacked
    module's own objects for ``(layer, direction)`` (``RNNBase.__setattr__`` keeps its
    ``_flat_weights`` pointing at them, so its forward uses them)."""
    H = module.hidden_size
    in_size = module.input_size if layer == 0 else H * (2 if module.bidirectional else 1)
    # built on the meta device: its own placeholder parameters are replaced at once and never allocated
    view = cell.new_module(in_size, H, num_layers=1, bias=module.bias, batch_first=False, dropout=0.0,
                           bidirectional=False, device="meta")
    _sync_view(view, module, layer, direction)
    return view


def _sync_view(view: nn.Module, module: nn.Module, layer: int, direction: int) -> None:
    """Point the view at the stacked module's current parameter objects (a user may have replaced one)."""
    for vname, sname in _param_names(module, layer, direction):
        p = getattr(module, sname)
        if getattr(view, vname) is not p:
            setattr(view, vname, p)


def _layers_state(per_layer: list, unbatched: bool) -> torch.Tensor:
    """``(L*D, B, H)`` (``(L*D, H)`` unbatched) from each (layer, direction)'s ``(1, B, H)``."""
    cat = torch.cat(per_layer, dim=0)
    return cat.squeeze(1) if unbatched else cat


@holds_tensors
class _StackedSaved:
    """What one forward keeps for the backward: each (layer, direction)'s saved state and the masks."""

    def __init__(self, subs: list, masks: list, T: int, B: int, unbatched: bool, batch_first: bool) -> None:
        self.subs, self.masks = subs, masks  # subs[l * D + d]; masks[l] scales layer l's output (None: no dropout)
        self.T, self.B, self.unbatched, self.batch_first = T, B, unbatched, batch_first


class StackedRecurrentPlan(RecurrentFront):
    """BPPSA plan of a stacked and/or bidirectional recurrent module: one
    :class:`spscan.recurrent.plan.RecurrentPlan` per (layer, direction), composed as the module docstring says.

    ``forward(x, hx)`` runs the module's forward (with torch's dropout masks in train mode) and
    returns ``(module outputs, saved)``; ``backward(saved, grad_output, grad_h_n, grad_c_n)``
    returns ``{"input", "h_0", "c_0", <every parameter name of the module>}``. ``plan_kwargs``
    (``layout``, ``forward``, ``newton``, ``levels``, ``backend``, ``max_memory``, ...) go to every
    per-layer plan; ``max_memory`` bounds each (layer, direction) scan, and the plan holds ``L*D``
    of them.
    """

    def __init__(self, module: nn.Module, example_input: Optional[torch.Tensor] = None, **plan_kwargs: Any) -> None:
        self.cell = _check_module(module)
        self.module = module
        self.kind = self.cell.family
        self.num_layers = module.num_layers
        self.num_directions = 2 if module.bidirectional else 1
        self.hidden_size = module.hidden_size
        ex = None
        if example_input is not None:
            x = example_input[0] if isinstance(example_input, (tuple, list)) else example_input
            check_input(self.module, x)
            T, B = sequence_dims(x, module.batch_first)
            if x.dim() == 3:
                plan_kwargs.setdefault("batch_size", int(B))
            ex = (T, B)
        self.plan_kwargs = dict(plan_kwargs)
        self._views: list[nn.Module] = []
        self.layer_plans: list[RecurrentPlan] = []  # [l * D + d]
        # on a GPU with backward="graph" the whole step replays from CUDA graphs (run_step)
        self.step_graphs = GraphedStep(self)
        for layer in range(self.num_layers):
            for d in range(self.num_directions):
                view = _layer_view(module, self.cell, layer, d)
                sub_ex = None
                if ex is not None:
                    p = view.weight_hh_l0
                    # only its shape is read: (T, B, input size of this layer), time-major
                    sub_ex = torch.zeros((), dtype=p.dtype, device=p.device).expand(ex[0], ex[1], view.input_size)
                self._views.append(view)
                self.layer_plans.append(RecurrentPlan(view, sub_ex, **self.plan_kwargs))

    # -- introspection

    @property
    def levels(self) -> list:
        """The up-sweep depth of each (layer, direction)'s scan, index ``l * D + d`` (most recent length)."""
        return [p.levels for p in self.layer_plans]

    def summary(self) -> str:
        lines = [f"StackedRecurrentPlan({self.kind}, layers={self.num_layers}, directions={self.num_directions}, "
                 f"hidden={self.hidden_size})"]
        for i, p in enumerate(self.layer_plans):
            l, d = divmod(i, self.num_directions)
            lines.append(f"  layer {l}{' reverse' if d else ''}: " + p.summary().replace("\n", "\n    "))
        return "\n".join(lines)

    def all_decisions(self) -> list[Decision]:
        """The choices of the first (layer, direction)'s plan (every one is planned alike)."""
        return self.layer_plans[0].all_decisions() if self.layer_plans else []

    def __repr__(self) -> str:
        return (f"StackedRecurrentPlan(kind={self.kind!r}, num_layers={self.num_layers}, "
                f"bidirectional={self.num_directions == 2}, hidden_size={self.hidden_size})")

    # -- forward

    def _split_hx(self, hx, unbatched: bool) -> list:
        """Per (layer, direction) initial state as the single-layer module takes it (``(1, B, H)``), or Nones."""
        n = self.num_layers * self.num_directions
        if hx is None:
            return [None] * n
        hs = self.cell.state_tensors(hx)
        for name, h in zip(("h_0", "c_0"), hs):
            want_dim = 2 if unbatched else 3
            if not isinstance(h, torch.Tensor) or h.dim() != want_dim or h.shape[0] != n:
                got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
                raise ValueError(f"hx: expected {name} of shape ({n}, {'' if unbatched else 'B, '}{self.hidden_size}) "
                                 f"(num_layers * num_directions first), got {got}")
        if unbatched:
            hs = tuple(h.unsqueeze(1) for h in hs)
        return [self.cell.join_hx(*(h[i:i + 1] for h in hs)) for i in range(n)]

    def forward(self, x: torch.Tensor, hx=None):
        """Run the forward (no autograd) and save what the backward needs.

        ``x``: ``(T, B, I)`` (``(B, T, I)`` if batch_first) or unbatched ``(T, I)``; ``hx``: ``h_0``
        (or ``(h_0, c_0)``) of shape ``(L*D, B, H)`` (``(L*D, H)`` unbatched) or None. Returns
        ``(outputs, saved)`` with ``outputs`` what the module returns: ``output`` ``(T, B, D*H)`` in the
        input's layout and ``h_n`` (``(h_n, c_n)``) shaped like ``hx``.
        """
        check_input(self.module, x)
        with torch.no_grad():
            return self.run_forward(x, hx, need_saved=True)

    def run_forward(self, x: torch.Tensor, hx=None, need_saved: bool = True):
        """The module's outputs layer by layer, and (``need_saved``) what the backward needs."""
        m = self.module
        _check_module(m)
        L, D = self.num_layers, self.num_directions
        unbatched = x.dim() == 2
        inp = time_major(x, m.batch_first, unbatched)
        T, B = inp.shape[:2]
        hx_per = self._split_hx(hx, unbatched)
        p_drop = float(m.dropout) if (m.training and L > 1) else 0.0
        subs: list = []
        masks: list = []
        h_n: list = []
        c_n: list = []
        for layer in range(L):
            outs = []
            for d in range(D):
                i = layer * D + d
                _sync_view(self._views[i], m, layer, d)
                xi = inp if d == 0 else inp.flip(0)
                (out, state), saved = self.layer_plans[i].run_forward(xi, hx_per[i], need_saved=need_saved)
                subs.append(saved)
                outs.append(out if d == 0 else out.flip(0))
                h, c = self.cell.split_hx(state)
                h_n.append(h)
                c_n.append(c)
            inp = outs[0] if D == 1 else torch.cat(outs, dim=-1)
            mask = None
            if p_drop > 0 and layer < L - 1:
                # as torch's CPU RNN does between layers (at::dropout): empty_like(out).bernoulli_(1 - p) / (1 - p)
                if p_drop == 1:
                    mask = torch.zeros((), dtype=inp.dtype, device=inp.device)
                else:
                    mask = torch.empty_like(inp).bernoulli_(1 - p_drop)
                    mask.div_(1 - p_drop)
                inp = inp * mask
            masks.append(mask)
        out = module_output(inp, m.batch_first, unbatched)
        hn = _layers_state(h_n, unbatched)
        outputs = (out, self.cell.join_hx(hn, None if c_n[0] is None else _layers_state(c_n, unbatched)))
        saved = _StackedSaved(subs, masks, T, B, unbatched, m.batch_first) if need_saved else None
        return outputs, saved

    # -- backward

    def backward(self, saved: _StackedSaved, grad_output: Optional[torch.Tensor], grad_h_n: Optional[torch.Tensor],
                 grad_c_n: Optional[torch.Tensor] = None,
                 wanted: Optional[frozenset] = None, graphs: bool = True) -> dict[str, Optional[torch.Tensor]]:
        """Gradients from the upstream gradients of the module's outputs (each may be None = zero).

        ``grad_output`` in the module's output layout (``(T, B, D*H)`` time-major, ``(B, T, D*H)`` if
        batch_first, ``(T, D*H)`` unbatched); ``grad_h_n`` / ``grad_c_n`` ``(L*D, B, H)`` (``(L*D, H)``
        unbatched). Returns ``{"input", "h_0", "c_0", <parameter names>}``: ``input`` in the input's
        layout, ``h_0``/``c_0`` ``(L*D, B, H)`` (``c_0`` None unless LSTM). ``wanted``: the names the
        caller reads (default: all); the input's and the parameters' others are ``None`` and their
        GEMMs are skipped (a layer above the first still passes its input's gradient down). ``graphs``:
        whether each layer's backward may replay from a CUDA graph of its own.
        """
        with torch.no_grad():
            return self._backward(saved, grad_output, grad_h_n, grad_c_n, wanted, graphs)

    def _backward(self, saved: _StackedSaved, grad_output, grad_h_n, grad_c_n, wanted=None, graphs=True):
        m = self.module
        L, D, H = self.num_layers, self.num_directions, self.hidden_size
        go = None if grad_output is None else time_major(grad_output, saved.batch_first, saved.unbatched)
        if saved.unbatched:
            grad_h_n = None if grad_h_n is None else grad_h_n.unsqueeze(1)
            grad_c_n = None if grad_c_n is None else grad_c_n.unsqueeze(1)
        res: dict[str, Optional[torch.Tensor]] = {}
        h0 = [None] * (L * D)
        c0 = [None] * (L * D)
        g_in = None
        for layer in reversed(range(L)):
            g_in = None
            for d in range(D):
                i = layer * D + d
                g = None if go is None else go[..., d * H:(d + 1) * H]
                if g is not None and d == 1:
                    g = g.flip(0)
                ghn = None if grad_h_n is None else grad_h_n[i:i + 1]
                gcn = None if grad_c_n is None else grad_c_n[i:i + 1]
                sub = None
                if wanted is not None:
                    sub = frozenset([v for v, sname in _param_names(m, layer, d) if sname in wanted]
                                    + (["input"] if layer > 0 or "input" in wanted else []))
                r = self.layer_plans[i].backward(saved.subs[i], g, ghn, gcn, sub, graphs)
                if r["input"] is not None:
                    gi = r["input"] if d == 0 else r["input"].flip(0)
                    g_in = gi if g_in is None else g_in + gi
                h0[i], c0[i] = r["h_0"], r["c_0"]
                for vname, sname in _param_names(m, layer, d):
                    res[sname] = r[vname]
            if layer > 0:
                # the output of layer - 1 fed layer `layer` through dropout: out * mask
                mask = saved.masks[layer - 1]
                go = g_in if mask is None else g_in * mask
        # g_in: None when the first layer was not asked for it
        res["input"] = None if g_in is None else module_layout(g_in, saved.batch_first, saved.unbatched)
        res["h_0"] = _layers_state(h0, saved.unbatched)
        res["c_0"] = None if c0[0] is None else _layers_state(c0, saved.unbatched)  # None but for the LSTM
        return res

    def bound_engines(self) -> list:
        """Every (layer, direction) plan's bindings made so far (:meth:`RecurrentPlan.bound_engines`)."""
        return [b for p in self.layer_plans for b in p.bound_engines()]

    def sequential_forward(self) -> bool:
        """Whether every forward of this plan is the module's own (``forward="sequential"``)."""
        return all(p.sequential_forward() for p in self.layer_plans)

    def release_buffers(self) -> None:
        """Free what every (layer, direction) plan keeps between steps (:meth:`RecurrentPlan.release_buffers`)
        and the whole steps recorded as CUDA graphs."""
        self.step_graphs.release()
        for p in self.layer_plans:
            p.release_buffers()

    # -- what a wrapper's step asks (spscan.recurrent.wrapper.RecurrentWrapper)

    def describe(self) -> str:
        """The plan's form, as a wrapper's decision and repr name it."""
        return f"{self.num_layers} layers x {self.num_directions} directions"

    def check_unchanged(self) -> None:
        """Refuse a module whose configuration was changed after planning."""
        m = self.module
        _check_module(m)
        if (m.num_layers, 2 if m.bidirectional else 1) != (self.num_layers, self.num_directions):
            raise ValueError(f"num_layers / bidirectional changed after wrapping: planned {self.num_layers} "
                             f"layers x {self.num_directions} directions; wrap the module again")

    def split_state(self, hx: Any) -> tuple[Any, Any]:
        """``(h_0, c_0)`` of a call's ``hx`` (Nones where not given)."""
        return (None, None) if hx is None else self.cell.split_hx(hx)

    def step_params(self) -> list[torch.Tensor]:
        """The module's parameters in :meth:`param_names` order (its own objects)."""
        return [getattr(self.module, n) for n in self.param_names()]

    def param_names(self) -> list[str]:
        """The module's parameter names in its registration (``parameters()``) order."""
        return [s for layer in range(self.num_layers) for d in range(self.num_directions)
                for _, s in _param_names(self.module, layer, d)]


def plan_stacked(rnn: nn.Module, example_input: Optional[torch.Tensor] = None, **plan_kwargs: Any) -> StackedRecurrentPlan:
    """Plan BPPSA for a stacked and/or bidirectional ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``.

    ``example_input``: ``(T, B, I)`` (``(B, T, I)`` if batch_first) or ``(T, I)``; its ``T`` is
    planned now for every (layer, direction), other lengths on first use. ``plan_kwargs`` as for
    :func:`spscan.recurrent.plan.plan_recurrent`, applied to each (layer, direction).
    Raises :class:`~spscan.errors.NotPlannable` for ``proj_size > 0`` or parameters in a dtype other than
    float32/float64.
    """
    return StackedRecurrentPlan(rnn, example_input, **plan_kwargs)
