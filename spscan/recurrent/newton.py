"""A parallel forward pass for recurrences: Newton iterations whose linear solve is the planned scan.

The recurrence ``s_t = F(s_{t-1}, x_t)`` (``s_t = h_t``; for the LSTM the joint ``(h_t, c_t)``) is
solved for all ``t`` at once (DEER, Lim et al. ICLR 2024; quasi-DEER/ELK, Gonzalez et al. 2024).
Iteration ``k`` evaluates the cell on every step at the current guess (one batched GEMM), forms
the Jacobians ``J_t = dF/ds (s_{t-1}^{(k)}, x_t)`` and solves the affine recurrence of the
update

    δ_t = J_t δ_{t-1} + r_t,    δ_0 = 0,    r_t = F(s_{t-1}^{(k)}, x_t) - s_t^{(k)},

then ``s^{(k+1)} = s^{(k)} + δ``. This is the affine scan of the backward pass run in the other
direction: the backward chain computes ``g_{i-1} = P_i g_i + e_{i-1}``; with ``g_i = δ_{T-i}``,
``P_i = J_{T-i+1}``, ``e_{i-1} = r_{T-i+1}`` and ``g_T = δ_0 = 0`` one planned scan gives every
``δ_t``. The planner plans it from the cell's backward patterns transposed symbolically once
(:func:`transpose_pattern`; a factored step ``J_t^T = A_1 A_2 .. A_m`` becomes
``J_t = A_m^T .. A_1^T``, so the RNN's step is a per-sample diagonal times the shared ``W_hh``),
with the same depth choice and memory planning as the backward (:func:`spscan.runtime.plan.build_plan`).

Methods (:class:`NewtonOptions`):

* ``"newton"`` (DEER): the full ``J_t``. After ``k`` iterations the first ``k`` steps are exact
  (for any ``J``: the residual of step ``k+1`` then involves only exact states), so it ends in at
  most ``T`` iterations in exact arithmetic; near the solution convergence is quadratic, which is
  what makes it fast: contractive recurrences (``||J_t|| < 1`` on average, e.g. trained or
  moderately scaled tanh RNNs, GRUs, LSTMs) converge in a handful of iterations for any ``T``.
  It can fail where the Jacobian products grow (chaotic or strongly expanding recurrences):
  the linearization is then only trustworthy on a short prefix, the update overshoots and can
  overflow; that is detected (non-finite update) and handled by the fallback.
* ``"quasi"`` (quasi-DEER): only the diagonal part of ``J_t`` (for the LSTM the per-unit 2x2
  block of ``(h, c)``), so each scan is a chain of diagonals that never fills in. Convergence is
  linear, with a rate given by how much of ``J_t`` the diagonal leaves out: quick when the
  recurrence is dominated by its diagonal (small off-diagonal ``W_hh``, gated units near
  saturation), slow otherwise; it keeps the ``k`` exact steps after ``k`` iterations.
* ``damping = λ >= 0`` (both): uses ``J_t / (1 + λ)``. The fixed point is the same (the
  update is zero exactly when every residual is); ``λ -> ∞`` is the Picard/Jacobi sweep
  ``s_t <- F(s_{t-1})``, whose iterates stay bounded for tanh/sigmoid cells (no overflow) but
  advance only about one exact step per iteration. Damping trades speed for stability on
  stiff or chaotic recurrences; it removes quadratic convergence.

Stopping rule (``rtol``, default ``16 * eps`` of the dtype): with ``d_k = max|δ^{(k)}|``, the
scale ``S = max|F(s^{(k)})|`` (the cell's outputs at the guess: bounded and meaningful even when a
poor guess has blown up) and the contraction estimate ``q = d_k / d_{k-1}``, the iteration has
converged after ``T`` iterations (every step exact), when ``d_k <= rtol*S``, or when ``q < 1`` and the predicted remaining error
``d_k q / (1 - q)`` is ``<= rtol*S`` (superlinear convergence: ``q -> 0``), or when it has
stalled at rounding level (``d_k <= eps^(3/4)*S`` and ``q >= 1``: further iterations only
reshuffle rounding errors). A final batched evaluation of the cell at the converged states
confirms it (its residual ``max|F(s) - s|`` must be ``<= sqrt(eps)*S``, else the iteration goes
on) and gives the returned states ``F(s_{t-1}, x_t)`` and the Jacobian values the backward
reuses. Where the iteration showed signs of expanding Jacobian products (more than 16
iterations, or an update above ``10 S``), one more scan measures how far rounding-sized errors
``eps S`` travel; if they would grow beyond ``sqrt(eps) S`` the recurrence is chaotic at this
length (any two implementations, the sequential loop included, disagree there) and the result is
not used. If the iteration budget ``max_iter`` runs out, an update is not finite or the result is
ill-conditioned, the sequential forward runs instead and a :class:`NewtonNotConverged` warning
says so, with the iteration count.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from spscan.kernels.backend import fixed_point_ops
from spscan.recurrent.cells import cell_named, recurrent_patterns
from spscan.runtime import PeriodicValues, StackedExtra
from spscan.runtime.plan import build_plan, plan_profile

__all__ = [
    "NewtonNotConverged",
    "NewtonOptions",
    "NewtonInfo",
    "NewtonSolver",
    "transpose_pattern",
    "quasi_pattern",
    "FORWARD_MODES",
]

FORWARD_MODES = ("sequential", "newton", "auto")
_METHODS = ("newton", "quasi")


class NewtonNotConverged(RuntimeWarning):
    """The Newton forward did not converge within its budget (or diverged); the sequential forward ran."""


@dataclass(frozen=True)
class NewtonOptions:
    """Options of the Newton forward.

    Attributes:
        method: ``"newton"`` (full ``J_t``, DEER) or ``"quasi"`` (diagonal part, quasi-DEER).
        damping: ``λ >= 0``; the scan uses ``J_t / (1 + λ)`` (0: undamped).
        max_iter: iteration budget (scans); ``T`` iterations always suffice in exact arithmetic.
        rtol: stopping tolerance relative to the state's max-norm; ``None``: ``16 * eps`` of the dtype.
        expected_iterations: the iteration count ``forward="auto"`` assumes before any Newton
            forward has run on the plan (afterwards: the last observed count).
    """

    method: str = "newton"
    damping: float = 0.0
    max_iter: int = 64
    rtol: Optional[float] = None
    expected_iterations: int = 8

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"newton method: expected 'newton' or 'quasi', got {self.method!r}")
        if isinstance(self.damping, bool) or not isinstance(self.damping, (int, float)) or not (
                math.isfinite(self.damping) and self.damping >= 0):
            raise ValueError(f"newton damping: expected a finite number >= 0, got {self.damping!r}")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int) or self.max_iter < 1:
            raise ValueError(f"newton max_iter: expected an int >= 1, got {self.max_iter!r}")
        if self.rtol is not None and (isinstance(self.rtol, bool) or not isinstance(self.rtol, (int, float))
                                      or not (math.isfinite(self.rtol) and self.rtol > 0)):
            raise ValueError(f"newton rtol: expected None or a finite number > 0, got {self.rtol!r}")
        if isinstance(self.expected_iterations, bool) or not isinstance(self.expected_iterations, int) \
                or self.expected_iterations < 1:
            raise ValueError(f"newton expected_iterations: expected an int >= 1, got {self.expected_iterations!r}")

    @classmethod
    def coerce(cls, value: Any) -> "NewtonOptions":
        """``None`` (defaults), a :class:`NewtonOptions` or a dict of its fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"newton: unknown options {unknown}; expected some of "
                                 f"{sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"newton: expected None, a dict or spscan.recurrent.newton.NewtonOptions, got {type(value).__name__}")


@dataclass
class NewtonInfo:
    """What one Newton forward did.

    Attributes:
        method, damping: as run.
        iterations: scans run (``0`` if the sequence had no steps to solve).
        converged: ``True`` if the stopping rule was met; ``False`` if the sequential forward ran.
        reason: ``"tolerance"``, ``"predicted"``, ``"stalled"`` (rounding level), ``"exact"`` (``T``
            iterations: every step exact), ``"budget"``, ``"non-finite"`` or ``"ill-conditioned"``.
        deltas: ``max|δ|`` of each iteration.
        amplification: where measured, how much the recurrence amplifies rounding-sized errors
            (``max|δ| / (eps S)`` of one scan with ``r_t = eps S``); above ``1/sqrt(eps)`` the result
            counts as ``"ill-conditioned"``.
        seq_len, batch: the problem's size.
    """

    method: str
    damping: float
    iterations: int = 0
    converged: bool = False
    reason: str = ""
    deltas: list = field(default_factory=list)
    amplification: Optional[float] = None
    seq_len: int = 0
    batch: int = 0


# --------------------------------------------------------------------------- symbolic transpose


def transpose_pattern(p: sp.csr_array) -> tuple[sp.csr_array, np.ndarray]:
    """The canonical CSR pattern of ``p^T`` and the gather ``perm`` with ``vals(p^T) = vals(p)[perm]``.

    Symbolic, once per pattern: ``perm`` has ``nnz`` entries.
    """
    n = int(p.nnz)
    tagged = sp.csr_array((np.arange(1, n + 1, dtype=np.int64), p.indices, p.indptr), shape=p.shape)
    t = sp.csr_array(tagged.T.tocsr())
    t.sort_indices()
    perm = t.data.astype(np.int64) - 1
    pt = sp.csr_array((np.ones(n), t.indices.copy(), t.indptr.copy()), shape=t.shape)
    return pt, perm


def quasi_pattern(kind: str, hidden: int) -> sp.csr_array:
    """Pattern of the quasi-Newton ``J_t`` of a ``kind`` cell (:meth:`spscan.recurrent.cells.Cell.quasi_pattern`):
    diagonal ``(H, H)``; LSTM: per-unit 2x2 blocks of ``(h, c)``."""
    return cell_named(kind).quasi_pattern(hidden)


# --------------------------------------------------------------------------- cost model for "auto"

# Seconds per step of the library's sequential recurrent forward (one GEMM + pointwise ops per step,
# dispatch-bound for small H), and the rest of a Newton iteration on a GPU (batched cell evaluation,
# residual and norm, the scan's values) per step, sample and gate unit; fitted to the measurements
# in bench/results/calibration.md. Those iterations evaluated the cell with torch ops; the fused passes
# (kernels/triton/fixed_point.py) move ~10 entries of 4-8 bytes per unit instead of a few dozen, so until
# they are timed on a device this constant overstates a factored iteration: "auto" stays on the
# side of the sequential forward.
_SEQUENTIAL_STEP_S = {"cpu": 1.0e-5, "cuda": 5.5e-7}
_ITERATION_S_PER_UNIT = {"cuda": 1.9e-10}


# --------------------------------------------------------------------------- the solver


class NewtonSolver:
    """The forward-direction scans of one recurrent plan (one per ``(T, device, dtype, method)``) and the iteration.

    ``owner`` is a :class:`spscan.recurrent.plan.RecurrentPlan`: its cell, layout, hidden size and
    planning options. The forward plans use the same options (depth choice, backend, memory limit).
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self._plans: dict[tuple, Any] = {}
        self._bound: dict[tuple, Any] = {}
        self._step: Optional[tuple] = None  # (forward step patterns, perms, shared flags), made once

    # -- planning

    def _forward_step(self):
        """One step of the forward chain: the backward step's factors transposed and reversed."""
        if self._step is None:
            own = self.owner
            step = recurrent_patterns(own.module, 1, own.layout)
            if own.layout == "factored":
                shared = own.cell.shared_flags(own.hidden_size)
            else:
                shared = [False]
            tp = [transpose_pattern(p) for p in step]
            self._step = ([p for p, _ in reversed(tp)], [q for _, q in reversed(tp)], list(reversed(shared)))
        return self._step

    def forward_plan(self, seq_len: int, device, dtype: torch.dtype, method: str = "newton"):
        """The planned forward scan for ``seq_len`` steps (made once per ``(T, device, dtype, method)``)."""
        key = (seq_len, str(device), dtype, method)
        hit = self._plans.get(key)
        if hit is None:
            own = self.owner
            kw = {k: v for k, v in own.plan_kwargs.items() if v is not None}
            kw["device"], kw["dtype"] = device, dtype
            if method == "quasi":
                pats = [own.cell.quasi_pattern(own.hidden_size)] * seq_len
            else:
                pats = self._forward_step()[0] * seq_len
            hit = self._plans[key] = build_plan(pats, bind=None, **kw)
        return hit

    def _bind(self, seq_len: int, device, dtype: torch.dtype, method: str):
        key = (seq_len, str(device), dtype, method)
        hit = self._bound.get(key)
        if hit is None:
            plan = self.forward_plan(seq_len, device, dtype, method)
            m = 1 if method == "quasi" else len(self._forward_step()[0])
            shared = [False] * seq_len if method == "quasi" else self._forward_step()[2] * seq_len
            has_extra = [False] * (m * seq_len + 1)
            for j in range(seq_len):
                has_extra[m * j] = True  # r_{T-j} enters at chain index m*j
            # the factored forward values come as PeriodicValues (one copy of each shared element)
            periodic = method != "quasi" and any(shared)
            hit = self._bound[key] = plan.bind(shared, has_extra, torch.device(device), period=m if periodic else 0)
        return hit

    def prepare(self, seq_len: int, device, dtype: torch.dtype, method: str = "newton") -> None:
        """Plan and bind the forward scan for ``seq_len`` ahead of the first forward."""
        self._bind(seq_len, device, dtype, method)

    def plans(self) -> dict[tuple, Any]:
        """Every forward plan made so far, keyed by ``(T, device, dtype, method)``."""
        return dict(self._plans)

    # -- cost model

    def estimate(self, seq_len: int, batch: int, device, dtype: torch.dtype, options: NewtonOptions,
                 iterations: Optional[int] = None) -> dict[str, float]:
        """Estimated seconds of the sequential and the Newton forward (``forward="auto"`` picks the smaller).

        Newton: ``iterations * (scan + batched cell evaluation)``; the scan's estimate is the
        forward plan's cost model (critical path at its batch hint, scaled to ``batch``).
        """
        own = self.owner
        dev = torch.device(device)
        prof = plan_profile(dev)
        H, G = own.hidden_size, own.cell.gates
        it = iterations or options.expected_iterations
        plan = self.forward_plan(seq_len, device, dtype, options.method)
        hint = max(1, getattr(own, "plan_kwargs", {}).get("batch_size") or 16)
        scan_s = sum(c.time_s for c in plan.step_costs()) * max(1.0, batch / hint)
        gemm = seq_len * batch * G * H * H
        eval_s = prof.gemm_time(gemm, 12) + 10 * seq_len * batch * G * H / prof.gemv_rate
        eval_s = max(eval_s, seq_len * batch * G * H * _ITERATION_S_PER_UNIT.get(dev.type, 0.0))
        seq_s = seq_len * (_SEQUENTIAL_STEP_S.get(dev.type, 1e-5) + batch * G * H * (H + own.module.input_size)
                           / prof.gemm_rate)
        return {"sequential": seq_s, "newton": it * (scan_s + eval_s), "iterations": float(it)}

    # -- the iteration

    def solve(self, x: torch.Tensor, s0: torch.Tensor, params: Sequence[torch.Tensor], options: NewtonOptions):
        """Newton iterations for ``x`` (T, B, I) from ``s0`` (B, D).

        Returns ``(states (T, B, D), coefs, step_values, info)`` where ``coefs`` are the cell's derivative
        coefficients at the returned states and ``step_values`` the factored chain's values there, a
        :class:`~spscan.runtime.PeriodicValues` (``None`` for the materialized layout), for the backward to
        reuse; or ``(None, None, None, info)`` when it did not converge.
        """

        own = self.owner
        cell, H, layout = own.cell, own.hidden_size, own.layout
        T, B, _ = x.shape
        D = s0.shape[1]
        dt, dev = x.dtype, x.device
        info = NewtonInfo(options.method, float(options.damping), seq_len=T, batch=B)
        eps = torch.finfo(dt).eps
        tiny = torch.finfo(dt).tiny
        rtol = options.rtol if options.rtol is not None else 16.0 * eps
        stall = eps ** 0.75  # "stalled" only this close to rounding level (a slow linear phase is not a stall)
        confirm = math.sqrt(eps)
        quasi = options.method == "quasi"
        scale_j = 1.0 / (1.0 + float(options.damping))
        w_hh = params[1]
        bound = self._bind(T, dev, dt, options.method)
        w_ih = params[0]
        gi = torch.matmul(x, w_ih.t()) if len(params) <= 2 else \
            torch.addmm(params[2], x.reshape(T * B, -1), w_ih.t()).view(T, B, -1)  # fixed across iterations
        _, fperms, _ = self._forward_step()
        m = 1 if quasi else len(fperms)
        # a per-sample factor's transpose gathers its values, unless it is its own transpose (diagonal)
        sample_perms = [None if np.array_equal(q, np.arange(q.shape[0])) else torch.as_tensor(q, device=dev)
                        for q in fperms]
        zero = torch.zeros(B, D, dtype=dt, device=dev)

        shared_elements: list = []

        def forward_shared(step: list) -> list:
            """The forward step's elements that are shared (backward factor ``m-1-j`` of ``step``, the factored
            values, transposed; gathered once: the weights do not change between iterations), ``None`` at the
            per-sample ones."""
            if not shared_elements:
                for j, v in enumerate(reversed(step)):
                    shared_elements.append(None if v.dim() != 1 else
                                           v[torch.as_tensor(fperms[j], device=dev)].contiguous())
            return shared_elements

        def full_values(coefs: dict, scale: float):
            """Values of the forward chain of the full ``J_t`` (times ``scale``), in chain order."""
            if layout == "factored":
                step = cell.factored_values(coefs, w_hh, H)
                fstep = step[::-1]
                first_sample = next(j for j, v in enumerate(fstep) if v.dim() == 3)
                elements = []
                for j, hit in enumerate(forward_shared(step)):
                    if hit is not None:
                        elements.append(hit)
                    else:  # scale one per-sample factor (the product scales with it); permute a non-diagonal one
                        elements.append(reversed_stack(f"sample{j}", fstep[j], scale if j == first_sample else 1.0,
                                                       sample_perms[j]))
                return PeriodicValues(elements, T)  # element j of period t: step T-t's factor j

            bv = cell.materialized_values(coefs, w_hh, H)  # (T, B, nnz) of J_t^T
            vals = bv.flip(0).index_select(-1, torch.as_tensor(fperms[0], device=dev))
            return vals * scale if scale != 1.0 else vals

        def quasi_values(coefs: dict) -> torch.Tensor:
            vals = cell.quasi_values(coefs, w_hh, H)
            return (vals * scale_j if scale_j != 1.0 else vals).flip(0)

        stacks: dict[str, torch.Tensor] = {}
        last_first = torch.arange(T - 1, -1, -1, device=dev)

        def reversed_stack(name: str, src: torch.Tensor, scale: float = 1.0,
                           perm: Optional[torch.Tensor] = None) -> torch.Tensor:
            """``src`` (T, B, d) last step first (its last axis gathered by ``perm`` if given) times
            ``scale``, in a buffer kept across iterations: a few device ops, no work per time step."""
            if perm is not None:
                src = src.index_select(-1, perm)
            buf = stacks.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = stacks[name] = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            torch.index_select(src, 0, last_first, out=buf)
            if scale != 1.0:
                buf.mul_(scale)
            return buf

        def solve_affine(bnd, per: int, values, r: torch.Tensor) -> torch.Tensor:
            """``δ_t = J_t δ_{t-1} + r_t``, ``δ_0 = 0``: one planned scan; ``(T, B, D)``."""
            # r_{T-j} enters at chain index per*j: one stacked term, loaded by one strided copy
            ext = StackedExtra(reversed_stack("residual", r), range(0, per * T, per), per * T + 1)
            res = bnd.run(values, zero, ext, check=False, scratch=True, graph=True)
            return res.stacked(range(0, per * T, per)).flip(0)  # δ_1 .. δ_T (flip copies)

        def finish(f: torch.Tensor, coefs: dict, step: Optional[list], S: float):
            """The converged result, unless the recurrence turns out ill-conditioned at this length."""
            if info.iterations > 16 or max(info.deltas) > 10 * S:
                # signs of expanding Jacobian products: how far do rounding-sized errors travel?
                amp = solve_affine(self._bind(T, dev, dt, "newton"), len(fperms), full_values(coefs, 1.0),
                                   torch.full_like(f, eps * S))
                info.amplification = float(amp.abs().max()) / (eps * S)
                if not info.amplification * eps <= confirm:
                    info.converged, info.reason = False, "ill-conditioned"
                    return None, None, None, info
            if step is None and layout == "factored":
                step = cell.jacobian_values(layout, coefs, w_hh, H)
            return f, coefs, step, info

        def stop(d: float, S: float, prev_d: Optional[float]) -> str:
            """The stopping rule after an update of max-norm ``d`` (see the module docstring); ``""``: go on."""
            q = d / prev_d if prev_d else (0.0 if d == 0 else math.inf)
            if info.iterations >= T:
                return "exact"  # k iterations make the first k steps exact: all T are
            if d <= rtol * S:
                return "tolerance"
            if q < 1 and d * q / (1 - q) <= rtol * S:
                return "predicted"
            if d <= stall * S and q >= 1:
                return "stalled"
            return ""

        # the evaluation at the guess, and the update from it followed by the next evaluation: the cell's fused
        # kernels where the scan runs on Triton (per iteration one GEMM, one evaluation pass writing
        # the scan's inputs in place, the scan and one update pass; the host reads the update's maxima while the
        # device already evaluates at the new guess, so it never waits on the host between iterations); torch ops
        # otherwise. The same iterates and stopping rule either way.
        if not quasi and layout == "factored" and self.forward_plan(T, dev, dt, options.method).backend == "triton":
            states = torch.zeros(T + 1, B, D, dtype=dt, device=dev)  # s_0, then the guess s_1..s_T (initially 0)
            states[0] = s0
            # row k: max|f|, max|f - s| of evaluation k and max|δ| of the update from it (merged on the device)
            hist = torch.zeros(options.max_iter + 2, 3, dtype=dt, device=dev)
            row = [0]
            scale = torch.full((1,), scale_j, dtype=dt, device=dev)
            taps = range(0, m * T, m)
            # the evaluation writes the scan's per-sample values and residual where the scan reads them
            scan_values = bound.periodic_buffer(B, dt)
            sample = next(k for k, e in enumerate(scan_values.elements) if e.dim() == 3)
            scan_extra = bound.extra_buffer(B, dt)
            buffers: dict = {"rv": scan_values.elements[sample], "rr": scan_extra.terms}
            pinned = torch.empty(3, dtype=dt, pin_memory=True) if dev.type == "cuda" else None

            def evaluate():
                ev = cell.fused_step(gi, states, params, H, buffers, hist[row[0]], scale)
                return ev.f, ev.coefs, PeriodicValues(ev.values, T, ev.encodings), ev

            def measure(ev) -> tuple[float, float]:
                S, R = hist[row[0], :2].tolist()
                return max(S, tiny), R

            def advance(ev):
                k = row[0]
                for dst, hit in zip(scan_values.elements, forward_shared(ev.values)):
                    if hit is not None:  # a run may reuse the arenas: the shared elements go in before each
                        dst.copy_(hit)
                res = bound.run(scan_values, zero, scan_extra, check=False, scratch=True, graph=True)
                fixed_point_ops.update(res.stacked(taps), states[1:], hist[k])
                done_k = None
                if pinned is not None:  # the row to the host behind the update, without waiting for what follows
                    pinned.copy_(hist[k], non_blocking=True)
                    done_k = torch.cuda.Event()
                    done_k.record()
                row[0] = k + 1
                nxt = evaluate()
                if done_k is not None:
                    done_k.synchronize()
                    S, _, d = pinned.tolist()
                else:
                    S, _, d = hist[k].tolist()
                return max(S, tiny), d, nxt
        else:
            guess = [torch.zeros(T, B, D, dtype=dt, device=dev)]  # the initial guess

            def evaluate():
                f, coefs = cell.step(gi, torch.cat([s0.unsqueeze(0), guess[0][:-1]], dim=0), params, H)
                return f, coefs, None, (f, coefs, f - guess[0])

            def measure(ev) -> tuple[float, float]:
                # the scale: the cell's own outputs (bounded), not the guess
                return max(float(ev[0].abs().max()), tiny), float(ev[2].abs().max())

            def advance(ev):
                f, coefs, r = ev
                S = max(float(f.abs().max()), tiny)
                delta = solve_affine(bound, m, quasi_values(coefs) if quasi else full_values(coefs, scale_j), r)
                guess[0] = guess[0] + delta
                return S, float(delta.abs().max()), evaluate()

        prev_d: Optional[float] = None
        done = False
        f, coefs, step, ev = evaluate()
        while True:
            if done:
                # the evaluation at the converged guess gives its states and Jacobians, once its residual confirms it
                S, R = measure(ev)
                if R <= confirm * S:
                    return finish(f, coefs, step, S)
                info.converged, done, info.reason = False, False, ""
            if info.iterations >= options.max_iter:
                info.reason = "budget"
                return None, None, None, info
            S, d, (f, coefs, step, ev) = advance(ev)  # the update, and the evaluation at the new guess
            info.iterations += 1
            info.deltas.append(d)
            if not math.isfinite(d):
                info.reason = "non-finite"
                return None, None, None, info
            info.reason = stop(d, S, prev_d)
            done = info.converged = bool(info.reason)
            prev_d = d


def warn_fallback(info: NewtonInfo, stacklevel: int = 3) -> None:
    """The :class:`NewtonNotConverged` warning for a forward that fell back to the sequential one."""
    last = f"{info.deltas[-1]:.3g}" if info.deltas else "n/a"
    warnings.warn(
        f"Newton forward ({info.method}, damping={info.damping}) did not converge for T={info.seq_len}, "
        f"B={info.batch}: {info.reason} after {info.iterations} iteration(s) (last max|update| {last}); "
        f"ran the sequential forward instead",
        NewtonNotConverged,
        stacklevel=stacklevel,
    )
