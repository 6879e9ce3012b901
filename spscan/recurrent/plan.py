"""Recurrent networks through time: single-layer ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` via BPPSA.

The chain is the recurrence over time. With state ``s_t`` (``h_t``; for the LSTM the joint
``(h_t, c_t)`` of size ``2H``) and ``s_t = F(s_{t-1}, x_t)``, back-propagation through time is

    g_T = dl/ds_T(direct)          g_{t-1} = J_t^T g_t + dl/ds_{t-1}(direct)

with ``J_t = ds_t/ds_{t-1}``: an *affine* scan (a loss on every time step enters through
``extra``). The transposed Jacobians are built analytically for all ``t`` at once from the
gates, which are recomputed in one batched GEMM from ``x`` and ``h_{t-1}`` after the module's
own (cuDNN on GPU) forward has produced ``h_1..h_T`` (paper Appendix E, eq. 11) — except for the
factored RNN, GRU and LSTM on CPU, whose forwards run in one compiled pass (:data:`spscan.kernels.backend.cpu_ops`)
that evaluates the gates once and writes ``h_t`` (LSTM: ``c_T``) and the step's Jacobian values as
it goes (``c_t`` comes from the recurrence itself, not from a recomputation). A Newton forward that
falls back runs the module's own forward. Parameter gradients have
no dependency along time and come out of one GEMM over all ``T*B`` steps.

Chain layouts (``layout=``):

* ``"factored"`` (default): each time step is a few elements, shared by the batch (``W_hh^T``
  and friends, values ``(nnz,)``) or per sample (values ``(B, nnz)``); nothing ``H x H`` per
  sample is materialized. RNN: ``W_hh^T``, ``diag(1 - h_t^2)`` (2 per step). GRU: ``[W_hh^T | I]``,
  ``diag(dr, dz, dm, z)``, a 4-block sum (3 per step; eq. 11 as a product; the sum is sparse, ``4H``
  entries, one per row). LSTM (2 per step, the
  work the math needs: one shared product with ``W_hh`` plus ``9H`` multiply-adds per sample):
  ``[[W_hh^T, 0], [0, I]]`` (``(2H, 5H)``, sparse, shared, ``4H^2 + H`` entries), and the gate
  element (``(5H, 2H)``, sparse, per sample, ``9H`` entries) that maps ``(g_h, g_c)`` of ``s_t`` to
  ``(da_i, da_f, da_g, da_o, f*dc)`` with ``dc = k g_h + g_c``: ``da_q = c_q dc`` (``q = i, f, g``),
  ``da_o = c_o g_h``. The gradients at each step's first element are the gate pre-activation
  gradients the weight GEMMs need. The compiled CPU forward hands the gate element over as its
  ``6H`` compact numbers per sample (:func:`spscan.recurrent.cells.lstm_gate_encoding`), which the compiled
  linear scan applies directly (``dc`` once, then five products per unit) and every other path
  expands to the ``9H`` CSR values.
* ``"materialized"``: ``T`` elements, each the per-sample ``J_t^T`` (``H x H`` dense for RNN and
  GRU; for the LSTM the ``2H x 2H`` pattern whose ``c_{t-1}`` rows hold two entries,
  ``nnz = 2H^2 + 2H``), values stacked ``(T, B, nnz)``.
* ``"auto"``: factored on every device. On a CUDA device the factored chain is a structured
  recurrence (a shared block and per-step diagonals, repeated), which the fused kernels of
  :mod:`spscan.kernels.triton.recurrence` run without forming any per-step matrix; the materialized chain's
  per-sample ``H x H`` blocks move more bytes for the same gradients. On the CPU the factored chain
  costs less too (forward and values, backward; measured in ``bench/results/cpu-2core``): materializing
  writes ``T*B*nnz`` values per forward, which costs more than having fewer elements per step saves.
  Against autograd (``bench/test_recurrent_step.py``: ``nn.LSTM(1, 20)``, B=16, loss on the last
  output, one thread, ``process_time``, medians of 11 interleaved pairs, quiet machine), autograd
  time / spscan time for forward, backward, step: T=1000 0.98, 0.75, 0.85; T=3000 1.62, 1.52, 1.58;
  T=10000 0.70, 1.39, 0.95 (the step 0.77-0.85 / 0.99-1.58 / 0.88-1.10 over four runs).
  Autograd's CPU LSTM is oneDNN's fused forward and backward; here the forward and the linear
  scan run in tiles of 16 samples held in vector registers, and the per-sample gate values are
  stored entry-major so the scan reads them in place.

The forward (``forward=``): ``"sequential"`` runs the module's own forward (cuDNN on GPU);
``"newton"`` solves the recurrence for all steps at once by Newton iterations whose linear solve
is the same planned scan in the forward direction (:mod:`spscan.recurrent.newton`; the plan is built from
this module's patterns transposed symbolically, with the same depth choice and memory
planning), and the backward reuses the Jacobian values of the converged iteration; a Newton
forward that does not converge warns (``spscan.recurrent.newton.NewtonNotConverged``) and runs the
sequential one. ``"auto"`` picks by the device's cost model.

Every backward runs through the core engine: one plan per sequence length
(:func:`spscan.runtime.plan.build_plan`), bound once for the step's value signature, run with the values
built here (so the per-layer input checks are skipped) and read back as strided views of the
result (:class:`spscan.runtime.ScanResult`). The factored values go in as one
:class:`spscan.runtime.PeriodicValues` (the step's few element tensors, not ``m*T`` views) and the
per-step losses as one :class:`spscan.runtime.StackedExtra`, so no part of the backward's Python
work grows with ``T``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from spscan.recurrent.cells import (cell_for, module_layout, module_output, module_params, recurrent_patterns,
                                    resolve_layout, sequence_dims, time_major)
from spscan.runtime import Collect, RecycledBuffers, ScanResult, StackedExtra, fmt_bytes
from spscan.runtime.graphed import GraphedStep
from spscan.planner.choose import Candidate, Decision, choose
from spscan.runtime.plan import build_plan
from spscan.recurrent.backward import (GraphedBackward, any_nonzero, check_input, has_operands, operand_weight_grads,
                                       weight_grad)
from spscan.recurrent.forward import CompiledForwards, Saved

__all__ = [
    "RecurrentPlan",
    "plan_recurrent",
    "recurrent_patterns",
]

# --------------------------------------------------------------------------- the plan


class RecurrentFront:
    """The autograd front end (:class:`spscan.runtime.autograd.FrontEnd`) of a recurrent plan, single-layer or
    stacked: inputs ``(x, h_0, c_0, *parameters in param_names() order)``, outputs ``(output, h_n)`` or
    ``(output, h_n, c_n)``. Forward: the plan's ``run_forward`` (the module's own forward, or Newton's);
    backward: the plan's ``backward`` (the scans, then batched parameter GEMMs)."""

    materialize_grads = False
    stash_state = True  # the forward's saved tensors are freed with the graph

    def scan_forward(self, inputs: tuple):
        x, h0, c0, *params = inputs
        hx = None if h0 is None else self.cell.join_hx(h0, c0)
        (out, state), saved = self.run_forward(x, hx, need_saved=True)
        return self.cell.flat_outputs(out, state), (saved, h0 is not None)

    def scan_backward(self, state, grad_outputs: tuple, needs: tuple, graphs: bool = True):
        saved, has_h0 = state
        names = self.param_names()
        if saved is None:
            return (None,) * (3 + len(names))
        grad_out, grad_hn, grad_cn = (tuple(grad_outputs) + (None,))[:3]
        wanted = frozenset([n for i, n in enumerate(names) if needs[3 + i]] + (["input"] if needs[0] else []))
        r = self.backward(saved, grad_out, grad_hn, grad_cn, wanted, graphs)
        gx = r["input"] if needs[0] else None
        gh0 = r["h_0"] if (has_h0 and needs[1]) else None
        gc0 = r["c_0"] if (has_h0 and needs[2]) else None  # None but for the LSTM
        return (gx, gh0, gc0, *[r[n] if needs[3 + i] else None for i, n in enumerate(names)])

    # -- the whole step from CUDA graphs (spscan.runtime.graphed.GraphedStep's front, with scan_forward)
    def step_backward(self, state, grad_outputs: tuple, needs: tuple):
        """:meth:`scan_backward` never through the backward's own graphs (:class:`GraphedBackward`): the
        step's graph records these launches, and a signature's first step runs them eagerly as they will
        be recorded."""
        return self.scan_backward(state, grad_outputs, needs, graphs=False)

    def step_buffers(self) -> list[torch.Tensor]:
        return [t for b in self.bound_engines() for t in b.held_buffers()]

    def run_step(self, x: torch.Tensor, h0, c0, params: Sequence[torch.Tensor]) -> Optional[tuple]:
        """The outputs ``(output, h_n[, c_n])`` of one step from CUDA graphs (:attr:`step_graphs`), recorded
        for autograd; ``None`` where the caller runs the eager path instead (see
        :class:`~spscan.runtime.graphed.GraphedStep`), and always with a forward other than the module's own (a
        Newton forward's iteration count is decided on the host as it runs)."""
        if not self.sequential_forward():
            return None
        m = self.module
        # what the recorded forward follows besides the inputs: dropout between stacked layers, the layout
        return self.step_graphs((x, h0, c0, *params), 3, (m.training, float(m.dropout), m.batch_first))


class RecurrentWorkspace:
    """What a recurrent plan's steps write and keep between calls, apart from what never changes once a length is
    planned (its core plans and their bindings): the compiled forwards' chain values and the backward's gradient
    copies, recycled step to step (:attr:`buffers`), and the backward's CUDA graphs with their buffers
    (:attr:`graphed`). :meth:`release` frees both; the next step makes them again."""

    def __init__(self) -> None:
        self.buffers = RecycledBuffers()
        self.graphed = GraphedBackward()

    def release(self) -> None:
        self.buffers.clear()
        self.graphed = GraphedBackward()


class RecurrentPlan(CompiledForwards, RecurrentFront):
    """BPPSA plan of one single-layer recurrent module; the scan plans are cached per length ``T``.

    ``forward(x, hx)`` runs the module and returns ``(module outputs, saved)``;
    ``backward(saved, grad_output, grad_h_n, grad_c_n)`` returns the input, initial-state and
    parameter gradients. ``plan_kwargs`` go to ``spscan.plan`` for every ``T``.

    Its state by lifetime: the module, the layout and the options (fixed); per sequence length, the core
    plan and its bindings (made once, never changed: :meth:`scan_plan`); the :class:`RecurrentWorkspace`
    (:attr:`workspace`: one step's chain values and gradient copies, recycled so the next step does not
    page-fault fresh memory, and the backward's CUDA graphs), freed with the core plans' working buffers
    by :meth:`release_buffers`; and what the last call did (:attr:`last_forward`, :attr:`forward_decision`,
    :attr:`last_seq_len`).
    """

    def __init__(
        self,
        module: nn.Module,
        example_input: Optional[torch.Tensor] = None,
        *,
        layout: str = "auto",
        forward: str = "sequential",
        newton: Any = None,
        **plan_kwargs: Any,
    ) -> None:
        from spscan.recurrent.newton import FORWARD_MODES, NewtonOptions, NewtonSolver

        self.cell = cell_for(module)
        self.kind = self.cell.name
        self.module = module
        self.layout = resolve_layout(layout)
        if forward not in FORWARD_MODES:
            raise ValueError(f"forward: expected 'sequential', 'newton' or 'auto', got {forward!r}")
        self.forward_mode = forward
        self.newton_options = NewtonOptions.coerce(newton)
        self.newton = NewtonSolver(self)
        self.last_forward = None  # NewtonInfo of the most recent Newton forward (None: none ran yet)
        self.forward_decision: Optional[Decision] = None  # the last forward="auto" choice
        self.plan_kwargs = dict(plan_kwargs)
        self.hidden_size = module.hidden_size
        self.state_size = self.cell.state_size(module.hidden_size)
        # chain elements per time step
        self.per_step = len(self.cell.factored_layout(module.hidden_size)) if self.layout == "factored" else 1
        self._plans: dict[tuple, Any] = {}
        self._bindings: dict[tuple, Any] = {}  # (T, device, dtype, with_extra) -> bound engine
        self._keep_first: dict[int, np.ndarray] = {}  # chain length -> keep flags of dl/ds_0 alone
        self.workspace = RecurrentWorkspace()
        # on a GPU the whole backward replays from CUDA graphs (set False to run it eagerly)
        self.graph_backward = True
        # on a GPU with backward="graph" the whole step replays from CUDA graphs (run_step)
        self.step_graphs = GraphedStep(self)
        self.last_seq_len: Optional[int] = None
        if example_input is not None:
            x = example_input[0] if isinstance(example_input, (tuple, list)) else example_input
            check_input(self.module, x)
            T, B = sequence_dims(x, module.batch_first)
            if x.dim() == 3:
                # the core's cost model assumes a batch size: the example's, unless given
                self.plan_kwargs.setdefault("batch_size", int(B))
            p = module.weight_hh_l0
            self.scan_plan(T, p.device, p.dtype)
            if forward != "sequential" and T > 0:
                # the forward-direction scan is planned and bound now too, not in the first forward
                self.newton.prepare(T, p.device, p.dtype, self.newton_options.method)

    @property
    def buffers(self) -> RecycledBuffers:
        """The workspace's recycled chain values and gradient copies."""
        return self.workspace.buffers

    def cached_lengths(self) -> list[int]:
        """The sequence lengths planned so far."""
        return sorted({k[0] for k in self._plans})

    # -- plans

    def scan_plan(self, seq_len: int, device: torch.device, dtype: torch.dtype):
        """The core plan for ``seq_len`` steps, built once per ``(T, device, dtype)`` and bound for
        the signature every step uses (shared weights, per-sample diagonals; with and without
        per-step losses)."""
        self.last_seq_len = seq_len
        key = (seq_len, str(device), dtype)
        if key not in self._plans:
            kw = {k: v for k, v in self.plan_kwargs.items() if v is not None}
            kw.setdefault("device", device)
            kw.setdefault("dtype", dtype)
            self._plans[key] = build_plan(recurrent_patterns(self.module, seq_len, self.layout), bind=None, **kw)
            for with_extra in (False, True):
                self._bound(seq_len, device, dtype, with_extra)
        return self._plans[key]

    def _bound(self, seq_len: int, device: torch.device, dtype: torch.dtype, with_extra: bool):
        """The run-time engine of the core plan for this length and whether per-step losses enter."""
        key = (seq_len, str(device), dtype, with_extra)
        hit = self._bindings.get(key)
        if hit is None:
            hit = self._bindings[key] = self._bind(seq_len, device, dtype, with_extra)
        return hit

    def bound_engines(self) -> list:
        """Every core plan's bindings made so far (all lengths, devices and dtypes)."""
        return list(self._bindings.values())

    def bindings_for(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> list:
        """The core plan's bindings made so far for this length, device and dtype (with and without
        per-step losses)."""
        return [b for k, b in self._bindings.items() if k[:3] == (seq_len, str(device), dtype)]

    def _bind(self, seq_len: int, device: torch.device, dtype: torch.dtype, with_extra: bool):
        plan = self.scan_plan(seq_len, device, dtype)
        per = self.per_step
        n = per * seq_len
        has_extra = [False] * (n + 1)
        if with_extra:
            for t in range(seq_len - 1):  # extra[t] (the loss on s_{t+1}) enters at chain index per*(t+1)
                has_extra[per * (t + 1)] = True
        if self.layout == "factored":
            shared = self.cell.shared_flags(self.hidden_size) * seq_len
        else:
            shared = [False] * n
        # the factored values come as PeriodicValues: each shared element held once (period = elements per step)
        return plan.bind(shared, has_extra, torch.device(device), period=per if self.layout == "factored" else 0)

    def release_buffers(self) -> None:
        """Free the memory kept between steps: the recycled forward values and gradient copies
        (:attr:`buffers`), the backward's CUDA graphs with their buffers, and every core plan's arenas and
        working buffers."""
        self.workspace.release()
        self.step_graphs.release()
        for plan in self._plans.values():
            plan.release_buffers()

    @property
    def patterns(self) -> list[sp.csr_array]:
        """The chain's patterns for the most recently planned length."""
        return recurrent_patterns(self.module, self.last_seq_len or 1, self.layout)

    @property
    def levels(self):
        """The up-sweep depth of the core plan for the most recently planned length."""
        p = self.module.weight_hh_l0
        return self.scan_plan(self.last_seq_len or 1, p.device, p.dtype).levels

    def summary(self) -> str:
        lines = [
            f"RecurrentPlan({self.kind}, hidden={self.hidden_size}, state={self.state_size}, layout={self.layout})",
            f"  cached lengths: {self.cached_lengths() or '(none yet)'}",
        ]
        for key, plan in self._plans.items():
            s = plan.summary() if hasattr(plan, "summary") else repr(plan)
            lines.append(f"  T={key[0]} {key[1]} {key[2]}: " + str(s).replace("\n", "\n    "))
        lines.append(f"  forward: {self.forward_mode} ({self.newton_options})")
        for key, plan in self.newton.plans().items():
            lines.append(f"  forward scan ({key[3]}) T={key[0]} {key[1]} {key[2]}: " + plan.summary().replace("\n", "\n    "))
        if self.last_forward is not None:
            lines.append(f"  last Newton forward: {self.last_forward}")
        if self.buffers.nbytes:
            lines.append(f"  kept between steps: {fmt_bytes(self.buffers.nbytes)} of chain values and gradient copies "
                         "(release_buffers() frees them)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RecurrentPlan(kind={self.kind!r}, hidden_size={self.hidden_size}, layout={self.layout!r})"

    # -- forward

    def param_names(self) -> list[str]:
        """The module's parameter names in the order the autograd bridge takes them (:func:`module_params`)."""
        return ["weight_ih_l0", "weight_hh_l0"] + (["bias_ih_l0", "bias_hh_l0"] if self.module.bias else [])

    # -- what a wrapper's step asks (spscan.recurrent.wrapper.RecurrentWrapper)

    def describe(self) -> str:
        """The plan's form, as a wrapper's decision and repr name it."""
        return f"layout {self.layout}"

    def check_unchanged(self) -> None:
        """Refuse a module whose configuration was changed after planning."""
        m = self.module
        if m.num_layers != 1 or m.bidirectional:
            raise ValueError(f"{type(m).__name__}: num_layers / bidirectional changed after wrapping (planned 1 layer, "
                             f"1 direction; now {m.num_layers} x {2 if m.bidirectional else 1}): wrap the module again "
                             "(spscan.wrap plans stacked and bidirectional modules too)")
        cell_for(m)

    def split_state(self, hx: Any) -> tuple[Any, Any]:
        """``(h_0, c_0)`` of a call's ``hx`` (Nones where not given)."""
        return (None, None) if hx is None else self.cell.split_hx(hx)

    def step_params(self) -> list[torch.Tensor]:
        """The module's parameters in :meth:`param_names` order (its own objects)."""
        return module_params(self.module)

    def forward(self, x: torch.Tensor, hx=None):
        """Run the forward (no autograd; the module's own or Newton's, per ``forward=``) and save what the scan needs.

        ``x``: ``(T, B, I)`` (``(B, T, I)`` if batch_first) or unbatched ``(T, I)``; ``hx`` as the
        module takes it. Returns ``(outputs, saved)`` with ``outputs`` exactly what the module returns.
        """
        check_input(self.module, x)
        with torch.no_grad():
            return self.run_forward(x, hx, need_saved=True)

    def sequential_forward(self) -> bool:
        """Whether every forward of this plan is the module's own (``forward="sequential"``)."""
        return self.forward_mode == "sequential"

    def forward_method(self, seq_len: int, batch: int, device, dtype: torch.dtype) -> str:
        """``"sequential"`` or ``"newton"``: the forward this plan runs for a ``(T, B)`` input.

        ``forward="auto"`` compares the cost model's estimates (:meth:`NewtonSolver.estimate`), with
        the iteration count of the last Newton forward on this plan once one has run.
        """
        if self.forward_mode != "auto":
            return self.forward_mode
        if seq_len < 2 or batch < 1:
            return "sequential"
        last = self.last_forward
        measured = last is not None and last.converged
        est = self.newton.estimate(seq_len, batch, device, dtype, self.newton_options,
                                   iterations=last.iterations if measured else None)
        source = (f"as the last Newton forward took (T {last.seq_len}, batch {last.batch})" if measured else
                  "assumed: NewtonOptions.expected_iterations, until a Newton forward has run")
        self.forward_decision = choose(
            f"recurrent forward (T {seq_len}, batch {batch})",
            [Candidate("sequential", est["sequential"], "the module's own forward"),
             Candidate("newton", est["newton"],
                       f"{int(est.get('iterations', 0))} Newton iterations over the scan ({source})")],
            basis=f"{torch.device(device).type} cost model")
        return self.forward_decision.chosen.name

    def all_decisions(self) -> list[Decision]:
        """The planner's choices so far: the depth of the last scan planned and the last forward chosen."""
        out = []
        if self._plans:
            out.append(list(self._plans.values())[-1].decision)
        if self.forward_decision is not None:
            out.append(self.forward_decision)
        return out

    def run_forward(self, x: torch.Tensor, hx=None, need_saved: bool = True):
        """The module's outputs by the plan's forward (sequential or Newton), and what the backward needs.

        ``x`` / ``hx`` as the module takes them. Returns ``(outputs, saved)`` (``saved`` is ``None``
        when ``need_saved`` is false). A Newton forward that does not converge warns
        (:class:`spscan.recurrent.newton.NewtonNotConverged`) and runs the sequential forward;
        :attr:`last_forward` records the iterations either way.
        """
        m = self.module
        T, B = sequence_dims(x, m.batch_first)
        p = m.weight_hh_l0
        fell_back = False
        if T > 0 and B > 0 and self.forward_method(T, B, x.device, x.dtype) == "newton":
            if x.dtype != p.dtype or x.device != p.device:
                raise TypeError(f"input: expected dtype {p.dtype} on {p.device} (the module's parameters), "
                                f"got {x.dtype} on {x.device}")
            hit = self._newton_forward(x, hx)
            if hit is not None:
                return hit if need_saved else (hit[0], None)
            fell_back = True  # the module's own forward, as the warning says (not the compiled pass)
        if need_saved and not fell_back and self._compiled_forward_applies(x, hx):
            return self._compiled_forward(x, hx)
        outputs = m(x, hx)
        return outputs, (self._save(x, hx, outputs, need_values=True) if need_saved else None)

    def _newton_forward(self, x: torch.Tensor, hx):
        """Newton forward; ``(outputs, saved)`` with the converged iteration's Jacobians, or ``None`` (warned)."""
        from spscan.recurrent.newton import warn_fallback

        m, H, cell = self.module, self.hidden_size, self.cell
        unbatched = x.dim() == 2
        xt = time_major(x.detach(), m.batch_first, unbatched).contiguous()
        T, B, _ = xt.shape
        params = [q.detach() for q in module_params(m)]
        h0, c0 = cell.initial_state(hx, B, H, xt)
        s0 = cell.joint(h0, c0)
        states, coefs, step_values, info = self.newton.solve(xt, s0, params, self.newton_options)
        self.last_forward = info
        if states is None:
            warn_fallback(info, stacklevel=5)
            return None
        hs = states[..., :H]
        if self.layout == "factored":
            values = step_values
        else:
            values = cell.jacobian_values(self.layout, coefs, params[1], H)
        h_prev = torch.cat([h0.unsqueeze(0), hs[:-1]], dim=0)
        saved = Saved(x=xt, h_prev=h_prev, coefs=coefs, values=values, T=T, B=B, unbatched=unbatched,
                       params=params, dtype=hs.dtype, device=hs.device)
        out = module_output(hs, m.batch_first, unbatched)  # h of the joint states (the LSTM's interleave c)
        shape = (1, H) if unbatched else (1, B, H)
        h_n, c_n = (None if s is None else s.reshape(shape).clone() for s in cell.split_joint(states[-1], H))
        return cell.module_outputs((out, h_n, c_n)), saved

    def _save(self, x: torch.Tensor, hx, outputs, need_values: bool) -> Saved:
        m, cell = self.module, self.cell
        unbatched = x.dim() == 2
        H = self.hidden_size
        x = time_major(x.detach(), m.batch_first, unbatched)
        hs = time_major(outputs[0].detach(), m.batch_first, unbatched)
        T, B, _ = x.shape
        params = [p.detach() for p in module_params(m)]
        h0, c0 = cell.initial_state(hx, B, H, x)
        h_prev = torch.cat([h0.unsqueeze(0), hs[:-1]], dim=0) if T > 0 else hs
        coefs = cell.coefficients(x, h_prev, c0, hs, params) if T > 0 else {}
        values = cell.jacobian_values(self.layout, coefs, params[1], H) if (need_values and T > 0) else None
        return Saved(
            x=x.detach(), h_prev=h_prev, coefs=coefs, values=values, T=T, B=B, unbatched=unbatched,
            params=params, dtype=hs.dtype, device=hs.device,
        )

    # -- backward

    def _scan(self, saved: Saved, top: torch.Tensor, extra: Optional[torch.Tensor],
              collect: Sequence[Collect] = ()) -> ScanResult:
        """One scan: every chain gradient (``m*T+1`` factored, ``T+1`` materialized), or with ``collect``
        only ``dl/ds_0`` and the gradients it asks for, stacked into the caller's buffers. The result
        views the engine's working buffer (valid until the next scan): callers copy what they keep.

        The values are built here, so they are valid by construction: the engine runs without its
        per-layer input checks.
        """
        T = saved.T
        bound = self._bound(T, saved.device, saved.dtype, extra is not None)
        per = self.per_step
        n = per * T
        ext: Optional[StackedExtra] = None
        if extra is not None:
            # extra[t] (the loss on s_{t+1}, or on its first H entries h_{t+1}) enters at chain position
            # per*(t+1), t < T-1: one stacked tensor, read where it lies
            r = extra.shape[2]
            ext = StackedExtra(extra[: T - 1], range(per, n, per), n + 1, row0=0, size=self.state_size)
            top = top.clone()
            top[:, :r] += extra[T - 1]
        keep = None
        if collect:  # what the caller reads: dl/ds_0 and the collected gradients
            keep = self._keep_first.get(n)
            if keep is None:
                keep = self._keep_first[n] = np.zeros(n + 1, dtype=bool)
                keep[0] = True
        # factored: PeriodicValues (m elements, T periods); materialized: one stacked (T, B, nnz) tensor
        return bound.run(saved.values, top, ext, check=False, scratch=True, graph=True, keep=keep, collect=collect)

    def backward(
        self,
        saved: Saved,
        grad_output: Optional[torch.Tensor],
        grad_h_n: Optional[torch.Tensor],
        grad_c_n: Optional[torch.Tensor] = None,
        wanted: Optional[frozenset] = None,
        graphs: bool = True,
    ) -> dict[str, Optional[torch.Tensor]]:
        """Gradients from the upstream gradients of the module's outputs (each may be None = zero).

        ``grad_output`` in the module's output layout; ``grad_h_n`` / ``grad_c_n`` ``(1, B, H)`` (or
        ``(1, H)`` unbatched). Returns ``{"input", "h_0", "c_0", <parameter names>}``; ``input`` in
        the input's layout, ``h_0``/``c_0`` shaped like the module's ``hx``. ``wanted``: the names
        the caller reads (default: all); the input's and the parameters' others are ``None`` and
        not computed (their GEMMs are skipped, as autograd skips what needs no gradient). ``graphs``:
        whether it may replay from a CUDA graph of its own (:meth:`_graphs_apply`).
        """
        with torch.no_grad():
            if graphs and self._graphs_apply(saved, grad_output):
                return self.workspace.graphed(self, saved, (grad_output, grad_h_n, grad_c_n), wanted)
            return self._backward(saved, grad_output, grad_h_n, grad_c_n, wanted)

    def _graphs_apply(self, saved: Saved, grad_output: Optional[torch.Tensor]) -> bool:
        """Whether this backward replays from a CUDA graph (:class:`GraphedBackward`): on a GPU, with a
        backend whose scan can be recorded, outside a graph the caller is recording."""
        if not self.graph_backward or saved.device.type != "cuda" or saved.T == 0:
            return False
        if torch.cuda.is_current_stream_capturing():
            return False
        return self._bound(saved.T, saved.device, saved.dtype, grad_output is not None).graph_capturable

    def _backward(self, saved, grad_output, grad_h_n, grad_c_n, wanted=None):
        m, H, T, B = self.module, self.hidden_size, saved.T, saved.B
        D = self.state_size
        dt, dev = saved.dtype, saved.device
        go = None if grad_output is None else time_major(grad_output, m.batch_first, saved.unbatched)
        top = torch.zeros(B, D, dtype=dt, device=dev)
        if grad_h_n is not None:
            top[:, :H] += grad_h_n.reshape(B, H)
        if grad_c_n is not None:
            top[:, H:] += grad_c_n.reshape(B, H)
        extra = None
        if go is not None and T > 0:
            if dev.type == "cpu" and T > 1 and not any_nonzero(go[:-1]):
                # only the last output has a gradient (a loss on the last step): it joins the top, and
                # the scan runs without affine terms (NaN and inf are not zero: they keep them)
                top[:, :H] += go[-1]
            else:
                # (T, B, H), read where it lies (the compiled scan reads each sample's row of a step:
                # a feature-major copy first measured slower); the LSTM's cell has no output, so its
                # part of each step's term is zero and not stored
                extra = go
        if T == 0:
            return self._pack(saved, top, None, None, wanted)
        # the scan keeps only dl/ds_0 and hands over the per-step gradients the GEMMs read, feature-major
        # ((rows, T, B): each row one GEMM row over all steps and samples) into recycled buffers; the
        # compiled CPU scan writes them so as it goes, as its tiles hold them, instead of transposing
        # them into its sample-major buffer and a copy out of it afterwards
        take = self.buffers.take
        if self.layout == "factored":
            per = self.per_step
            rows = self.cell.gates * H
            # element 1's output of step t (the gate pre-activation gradients) is chain position per*t + 1
            index = range(1, per * (T - 1) + 2, per)
            pre = take("pre", (rows, T, B), dt, dev)
            collect = [Collect(index, slice(0, rows), pre)]
            split = self.cell.input_grads_from_state
            if split:
                # the input side differs by a term of dl/dh_t (the GRU's n gate), at chain position per*(t+1)
                dh = take("dh", (H, T, B), dt, dev)
                collect.append(Collect(range(per, per * T + 1, per), slice(0, H), dh))
            G = self._scan(saved, top, extra, collect)
            g0 = G[0].clone()
            a_hh = pre.view(rows, T * B)
            if not split:
                return self._pack(saved, g0, a_hh, a_hh, wanted)
            a_ih = self.cell.input_side_grads(pre, dh, saved.coefs, take("pre_ih", (rows, T, B), dt, dev))
            return self._pack(saved, g0, a_ih, a_hh, wanted)
        grads = take("grads", (D, T, B), dt, dev)
        G = self._scan(saved, top, extra, [Collect(range(1, T + 1), slice(None), grads)])
        pre_ih, pre_hh = self.cell.pre_activation_grads(grads.permute(1, 2, 0), saved.coefs, H)
        a_ih = pre_ih.reshape(T * B, -1).t()
        a_hh = a_ih if pre_hh is pre_ih else pre_hh.reshape(T * B, -1).t()
        return self._pack(saved, G[0].clone(), a_ih, a_hh, wanted)

    def _pack(self, saved: Saved, g0: torch.Tensor, a_ih, a_hh,
              wanted: Optional[frozenset] = None) -> dict[str, Optional[torch.Tensor]]:
        """The gradients from ``dl/ds_0`` (``g0``) and the pre-activation gradients of the input and hidden
        GEMMs as ``(G, T*B)`` matrices (column ``t*B + b``: step ``t``, sample ``b``; any strides); of the
        input and the parameters only those in ``wanted`` (default: all), the others ``None``."""
        m, H, T, B = self.module, self.hidden_size, saved.T, saved.B
        params = saved.params
        want = (lambda name: True) if wanted is None else wanted.__contains__
        out: dict[str, Optional[torch.Tensor]] = {}
        x_grad = gw_ih = gw_hh = gb_ih = gb_hh = None
        if a_ih is None:
            x_grad = torch.zeros_like(saved.x) if want("input") else None
            gw_ih = torch.zeros_like(params[0]) if want("weight_ih_l0") else None
            gw_hh = torch.zeros_like(params[1]) if want("weight_hh_l0") else None
            gb_ih = gb_hh = torch.zeros_like(params[0][:, 0])
        else:
            # one GEMM over all T*B steps and samples per parameter: no loop over time
            if want("input"):
                x_grad = a_ih.t().mm(params[0]).view(T, B, -1)
            if want("weight_hh_l0") and has_operands(saved):
                gw_ih, gw_hh, gb_ih, gb_hh = operand_weight_grads(
                    saved, a_ih, a_hh, m.bias and (want("bias_ih_l0") or want("bias_hh_l0")))
                gw_ih = gw_ih if want("weight_ih_l0") else None
            else:
                if want("weight_ih_l0"):
                    gw_ih = weight_grad(a_ih.t(), saved.x.reshape(T * B, -1))
                if want("weight_hh_l0"):
                    gw_hh = weight_grad(a_hh.t(), saved.h_prev.reshape(T * B, -1))
                if m.bias and (want("bias_ih_l0") or want("bias_hh_l0")):
                    gb_ih = a_ih.sum(1)
                    gb_hh = gb_ih.clone() if a_hh is a_ih else a_hh.sum(1)  # one sum where both sides share it
        out["input"] = None if x_grad is None else module_layout(x_grad, m.batch_first, saved.unbatched)
        shape = (1, H) if saved.unbatched else (1, B, H)
        g_h0, g_c0 = self.cell.split_joint(g0, H)
        out["h_0"] = g_h0.reshape(shape)
        out["c_0"] = None if g_c0 is None else g_c0.reshape(shape)
        out["weight_ih_l0"], out["weight_hh_l0"] = gw_ih, gw_hh
        if m.bias:
            out["bias_ih_l0"], out["bias_hh_l0"] = gb_ih, gb_hh
        return out


def plan_recurrent(rnn: nn.Module, example_input: Optional[torch.Tensor] = None, **plan_kwargs: Any) -> RecurrentPlan:
    """Plan BPPSA for a single-layer ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``.

    ``example_input``: ``(T, B, I)`` (``(B, T, I)`` if batch_first) or ``(T, I)``; its ``T`` is
    planned now, other lengths on first use. ``plan_kwargs``: ``layout`` ("auto" | "factored" |
    "materialized"), ``forward`` ("sequential" | "newton" | "auto": the module's own forward, or
    Newton iterations over the forward-direction scan, :mod:`spscan.recurrent.newton`), ``newton`` (a
    :class:`spscan.recurrent.newton.NewtonOptions` or a dict of its fields) and whatever ``spscan.plan``
    takes (``levels``, ``backend``, ...).
    Raises ``ValueError`` for num_layers > 1 or bidirectional, :class:`~spscan.errors.NotPlannable` for
    proj_size > 0 or parameters in a dtype other than float32/float64.
    """
    return RecurrentPlan(rnn, example_input, **plan_kwargs)
