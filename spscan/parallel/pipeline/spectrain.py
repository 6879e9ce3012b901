"""SpecTrain weight prediction and an asynchronous-pipeline training emulation.

SpecTrain (``papers/model-parallel-weight-prediction.txt`` §3.3) predicts the weights a stage
will have ``s`` updates later from the smoothed gradient of momentum SGD: with torch's
``SGD(momentum=μ)`` a step is ``W <- W - lr v``, ``v <- μ v + g``, so the paper's eq. 4 reads

    W_pred = W - s * lr * v

:func:`train_pipelined` trains a chain of stages on one stream of micro-batches, one optimizer
step per micro-batch (as PipeDream and DualPipe do), three ways:

* ``"exact"``: every stage computes with the current weights (synchronous SGD; what GPipe, 1F1B
  and spscan's scan compute).
* ``"stale"``: stage ``k`` computes the forward *and* backward of micro-batch ``b`` with the weights
  it had ``s_k`` updates earlier (PipeDream with weight stashing: ``s_k = p - 1 - k``, or any
  staleness a simulated :class:`~spscan.parallel.pipeline.simulator.Timeline` reports); the gradient is
  applied to the current weights.
* ``"spectrain"``: as ``"stale"``, but with the weights predicted from that old version by
  ``W - s_k lr v`` (``v`` the momentum buffer of that version).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["predict_weights", "TrainLog", "train_pipelined", "pipedream_staleness"]


def predict_weights(weights: Sequence[torch.Tensor], momentum: Sequence[Optional[torch.Tensor]], lr: float,
                    s: int) -> list[torch.Tensor]:
    """SpecTrain's prediction ``W - s * lr * v`` of the weights ``s`` momentum-SGD updates ahead.

    Args:
        weights: the current tensors ``W`` (any shapes).
        momentum: the matching momentum buffers ``v`` (``None``: no step taken yet, predicts ``W``).
        lr: the optimizer's learning rate; ``s``: version difference, ``>= 0``.

    Returns:
        new tensors, same shapes as ``weights`` (the inputs are not modified).
    """
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        raise ValueError(f"s: expected a non-negative int (version difference), got {s!r}")
    if len(weights) != len(momentum):
        raise ValueError(f"momentum: expected {len(weights)} buffers (one per weight), got {len(momentum)}")
    out = []
    for i, (w, v) in enumerate(zip(weights, momentum)):
        if v is not None and v.shape != w.shape:
            raise ValueError(f"momentum[{i}]: expected shape {tuple(w.shape)}, got {tuple(v.shape)}")
        out.append(w.detach().clone() if v is None or s == 0 else w.detach() - (s * lr) * v)
    return out


def pipedream_staleness(p: int) -> list[int]:
    """PipeDream-1F1B with weight stashing: stage ``k`` of ``p`` computes with weights ``p - 1 - k`` updates old."""
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p: expected a positive int, got {p!r}")
    return [p - 1 - k for k in range(p)]


@dataclass
class TrainLog:
    """Per step: ``loss`` (training loss of the micro-batch), and every ``eval_every`` steps
    ``eval_steps``/``eval_loss``/``eval_accuracy`` on the held-out set."""

    mode: str
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)


class _MomentumSGD:
    """torch's ``SGD(momentum=μ)`` without dampening or weight decay: ``v <- μ v + g`` (``v = g`` on the
    first step), ``W <- W - lr v``; the buffers are kept per parameter name."""

    def __init__(self, module: nn.Module, lr: float, momentum: float) -> None:
        self.module, self.lr, self.momentum = module, lr, momentum
        self.buf: dict[str, Optional[torch.Tensor]] = {n: None for n, _ in module.named_parameters()}

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for n, prm in self.module.named_parameters():
            g = grads[n]
            if g is None:
                raise ValueError(f"parameter {n!r}: no gradient reached it")
            v = self.buf[n]
            v = g.clone() if v is None else v.mul_(self.momentum).add_(g)
            self.buf[n] = v
            prm.sub_(self.lr * v)


def _snapshot(stage: nn.Module, opt: _MomentumSGD) -> tuple[dict[str, torch.Tensor], dict[str, Optional[torch.Tensor]]]:
    w = {n: prm.detach().clone() for n, prm in stage.named_parameters()}
    v = {n: None if b is None else b.clone() for n, b in opt.buf.items()}
    return w, v


def train_pipelined(stages: Sequence[nn.Module], batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                    steps: int, mode: str, staleness: Sequence[int], lr: float, momentum: float = 0.9,
                    loss_fn: Callable = nn.functional.cross_entropy,
                    eval_data: Optional[tuple[torch.Tensor, torch.Tensor]] = None, eval_every: int = 10) -> TrainLog:
    """Train ``stages`` (a chain, modified in place) for ``steps`` micro-batches; see the module doc.

    Args:
        stages: ``p`` modules; stage ``k`` maps the output of stage ``k-1`` to its own output.
        batches: ``b -> (x, y)``, micro-batch ``b`` (the same stream for every mode).
        mode: ``"exact"``, ``"stale"`` or ``"spectrain"``.
        staleness: ``p`` ints, the updates stage ``k``'s weights lag behind (``"exact"`` ignores it).
        lr, momentum: of the momentum SGD every stage uses (torch's ``SGD(lr, momentum)`` update rule).
        eval_data: ``(x, y)`` evaluated with the current weights every ``eval_every`` steps.

    Returns:
        a :class:`TrainLog`.
    """
    if mode not in ("exact", "stale", "spectrain"):
        raise ValueError(f"mode: expected 'exact', 'stale' or 'spectrain', got {mode!r}")
    p = len(stages)
    staleness = [int(s) for s in staleness]
    if len(staleness) != p or any(s < 0 for s in staleness):
        raise ValueError(f"staleness: expected {p} non-negative ints (one per stage), got {list(staleness)}")
    if not momentum > 0 and mode == "spectrain":
        raise ValueError("momentum: SpecTrain predicts from the momentum buffer; expected momentum > 0")
    opts = [_MomentumSGD(st, lr, momentum) for st in stages]
    depth = max(staleness) + 1
    history = [deque([_snapshot(st, o)], maxlen=depth) for st, o in zip(stages, opts)]
    log = TrainLog(mode)

    def evaluate(step: int) -> None:
        x, y = eval_data
        with torch.no_grad():
            out = x
            for st in stages:
                out = st(out)
            log.eval_steps.append(step)
            log.eval_loss.append(float(loss_fn(out, y)))
            log.eval_accuracy.append(float((out.argmax(-1) == y).float().mean()))

    for b in range(steps):
        if eval_data is not None and b % eval_every == 0:
            evaluate(b)
        x, y = batches(b)
        used: list[dict[str, torch.Tensor]] = []
        for k, st in enumerate(stages):
            if mode == "exact" or staleness[k] == 0:
                w = {n: prm.detach().clone() for n, prm in st.named_parameters()}
            else:
                hist = history[k]
                s = min(staleness[k], len(hist) - 1)  # the first steps have fewer old versions
                old_w, old_v = hist[-1 - s]
                if mode == "stale":
                    w = {n: t.clone() for n, t in old_w.items()}
                else:
                    names = list(old_w)
                    pred = predict_weights([old_w[n] for n in names], [old_v[n] for n in names], lr, s)
                    w = dict(zip(names, pred))
            used.append({n: t.requires_grad_(True) for n, t in w.items()})
        out = x
        for st, w in zip(stages, used):
            out = functional_call(st, w, (out,))
        loss = loss_fn(out, y)
        loss.backward()
        log.loss.append(float(loss.detach()))
        for k, (w, o) in enumerate(zip(used, opts)):
            o.step({n: t.grad for n, t in w.items()})
            history[k].append(_snapshot(stages[k], o))
    if eval_data is not None:
        evaluate(steps)
    return log
