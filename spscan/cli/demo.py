"""``python -m spscan demo``: train the paper's bitstream RNN with BPPSA and with autograd side by side.

The model of §4.1: ``nn.RNN(1, 20)`` (tanh) over a bitstream of length ``T``, a Linear head
on the last hidden state, cross-entropy, Adam, and gradient-norm clipping (standard practice for
RNNs over long sequences: without it both runs spike on exploding gradients and float32 rounding
sends them down different paths) and a cosine learning-rate decay to zero. Both copies start from the same seed and see the same batches
in the same order; steps alternate between them so both see the same machine load.

Per epoch it prints loss and accuracy of both runs and how far BPPSA's gradients are from
autograd's *on the same weights and batch* (a third, wrapped copy takes the autograd run's
weights at the first step of every epoch, outside the timed steps): that is the exactness the
curves cannot show, since two float32 training runs drift apart by rounding alone. At the end:
held-out accuracy of both, the same gradient check in float64, the measured backward and overall
speedups; it writes the loss-vs-wall-clock curves (the paper's Figure 7) as a PNG and
``summary.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from spscan.cli.datasets import bitstream_dataset

__all__ = ["main", "BitstreamClassifier", "train_side_by_side"]

_PRESETS = {
    # seq_len, samples, epochs, batch, Adam learning rate
    "default": (1000, 2560, 10, 16, 1e-3),
    "quick": (1000, 256, 5, 16, 3e-3),
    "tiny": (40, 48, 2, 16, 3e-3),
}
CLIP = 1.0  # gradient-norm clipping threshold (both runs)
HELD_OUT = 512  # held-out samples for the final accuracy (another seed of the same distribution)


class BitstreamClassifier(nn.Module):
    """``nn.RNN(1, hidden)`` + ``Linear(hidden, classes)`` on ``h_T``: input ``(B, T, 1)`` → logits ``(B, classes)``."""

    def __init__(self, hidden: int = 20, classes: int = 10) -> None:
        super().__init__()
        self.rnn: nn.Module = nn.RNN(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h_n = self.rnn(x)
        return self.head(h_n[0])


@dataclass
class RunLog:
    """Per-step measurements of one training run (seconds)."""

    name: str
    losses: list[float] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)

    def wall_clock(self, skip: int = 0) -> list[float]:
        """Cumulative training time after each step, leaving out the first ``skip`` (warm-up) steps."""
        out, t = [], 0.0
        for s in self.step_s[skip:]:
            t += s
            out.append(t)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_bppsa(model: BitstreamClassifier, example: torch.Tensor, **plan_kwargs) -> None:
    """Swap ``model.rnn`` for its BPPSA wrapper (same parameter objects), which always runs the scan: the
    demo compares it with autograd (``backward="auto"`` could choose autograd's own backward)."""
    import spscan

    model.rnn = spscan.wrap(model.rnn, example, **{"backward": "scan", **plan_kwargs})


def gradient_difference(reference: nn.Module, probe: nn.Module) -> float:
    """Largest relative difference of any parameter's gradient: ``max_p max|g_probe - g_ref| / max|g_ref|``
    over the parameters of two models with the same parameter order."""
    worst = 0.0
    for a, b in zip(reference.parameters(), probe.parameters()):
        scale = float(a.grad.abs().max())
        diff = float((b.grad - a.grad).abs().max())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _probe_gradients(source: nn.Module, probe: nn.Module, xb: torch.Tensor, yb: torch.Tensor, loss_fn) -> float:
    """Gradients of the wrapped ``probe`` on ``source``'s current weights and the same batch, compared
    with the gradients ``source`` holds (from autograd, before clipping)."""
    with torch.no_grad():
        for d, s in zip(probe.parameters(), source.parameters()):
            d.copy_(s)
    probe.zero_grad(set_to_none=True)
    loss_fn(probe(xb.to(next(probe.parameters()).dtype)), yb).backward()
    return gradient_difference(source, probe)


def float64_check(model: BitstreamClassifier, xb: torch.Tensor, yb: torch.Tensor, **plan_kwargs) -> float:
    """The gradient comparison in float64 on ``model``'s weights: autograd vs a wrapped copy."""
    ref = copy.deepcopy(model).double()
    probe = copy.deepcopy(ref)
    _make_bppsa(probe, xb.double(), **plan_kwargs)
    loss_fn = nn.CrossEntropyLoss()
    ref.zero_grad(set_to_none=True)
    loss_fn(ref(xb.double()), yb).backward()
    return _probe_gradients(ref, probe, xb, yb, loss_fn)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    return sum(int((model(x[i:i + batch]).argmax(-1) == y[i:i + batch]).sum()) for i in range(0, len(y), batch)) / len(y)


def train_side_by_side(
    *,
    seq_len: int,
    samples: int,
    epochs: int,
    batch_size: int,
    hidden: int = 20,
    lr: float = 3e-3,
    clip: Optional[float] = CLIP,
    seed: int = 0,
    device: Optional[str] = None,
    levels="auto",
    layout: str = "auto",
    forward: str = "sequential",
    progress: bool = True,
    check_gradients: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[RunLog, RunLog, dict]:
    """Train autograd and BPPSA copies of ``BitstreamClassifier`` on the same data; return their logs and a summary.

    ``clip``: gradient-norm clipping threshold for both runs (``None``: off). ``check_gradients``: at the
    first step of every epoch, BPPSA's gradients on the autograd run's weights and batch vs autograd's
    (untimed).
    """
    from tqdm.auto import tqdm

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x_all, y_all = bitstream_dataset(samples, seq_len, seed=seed)
    x_all, y_all = x_all.to(dev), y_all.to(dev)
    plan_kwargs = dict(levels=levels, layout=layout, forward=forward)
    models, opts, logs = {}, {}, {}
    for name in ("autograd", "bppsa"):
        torch.manual_seed(seed)
        m = BitstreamClassifier(hidden).to(dev)
        if name == "bppsa":
            _make_bppsa(m, x_all[:batch_size], **plan_kwargs)
        models[name], opts[name], logs[name] = m, torch.optim.Adam(m.parameters(), lr=lr), RunLog(name)
    n_batches = max(1, samples // batch_size)
    # cosine decay to zero over the run (both runs): the final weights settle instead of hopping,
    # so the end-of-run quality of either run is a fair sample of it
    scheds = {k: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=epochs * n_batches) for k, o in opts.items()}
    probe = None
    if check_gradients:
        probe = BitstreamClassifier(hidden).to(dev)
        _make_bppsa(probe, x_all[:batch_size], **plan_kwargs)
    checks: list[tuple[int, float]] = []
    loss_fn = nn.CrossEntropyLoss()
    order_gen = torch.Generator().manual_seed(seed + 1)
    bar = tqdm(total=epochs * n_batches, desc="training", unit="step", disable=not progress, leave=False)
    step = 0
    epoch_log: list[dict] = []
    for epoch in range(epochs):
        perm = torch.randperm(samples, generator=order_gen)[: n_batches * batch_size].view(n_batches, batch_size)
        ep = {k: [0.0, 0, 0] for k in models}
        ep_check = None
        for b_idx, idx in enumerate(perm):
            xb, yb = x_all[idx.to(dev)], y_all[idx.to(dev)]
            for name in ("autograd", "bppsa"):
                m, opt, rl = models[name], opts[name], logs[name]
                _sync(dev)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                logits = m(xb)
                loss = loss_fn(logits, yb)
                _sync(dev)
                t1 = time.perf_counter()
                loss.backward()
                _sync(dev)
                t2 = time.perf_counter()
                if probe is not None and name == "autograd" and b_idx == 0:
                    ep_check = _probe_gradients(m, probe, xb, yb, loss_fn)
                    checks.append((step, ep_check))
                    _sync(dev)
                    t0 += time.perf_counter() - t2  # the check is not part of the training step's time
                if clip is not None:
                    nn.utils.clip_grad_norm_(m.parameters(), clip)
                opt.step()
                scheds[name].step()
                _sync(dev)
                t3 = time.perf_counter()
                correct = int((logits.argmax(-1) == yb).sum())
                rl.losses.append(float(loss.detach()))
                rl.correct.append(correct)
                rl.seen.append(len(yb))
                rl.step_s.append(t3 - t0)
                rl.backward_s.append(t2 - t1)
                e = ep[name]
                e[0] += rl.losses[-1] * len(yb)
                e[1] += correct
                e[2] += len(yb)
            step += 1
            bar.update(1)
        bar.clear()
        epoch_log.append({k: {"loss": v[0] / v[2], "accuracy": v[1] / v[2]} for k, v in ep.items()})
        msg = "  ".join(f"{k}: loss {v[0] / v[2]:.4f} acc {v[1] / v[2]:.3f}" for k, v in ep.items())
        if ep_check is not None:
            msg += f"  | same-weights gradient diff {ep_check:.1e}"
        log(f"epoch {epoch + 1:3d}/{epochs}  {msg}")
    bar.close()
    summary = _summary(logs["autograd"], logs["bppsa"], dev, models["bppsa"])
    x_test, y_test = bitstream_dataset(HELD_OUT, seq_len, seed=seed + 1000)
    x_test, y_test = x_test.to(dev), y_test.to(dev)
    a_l, b_l = logs["autograd"].losses, logs["bppsa"].losses
    apart = next((i for i, (u, v) in enumerate(zip(a_l, b_l)) if abs(u - v) > 1e-4 * abs(u)), None)
    summary.update(
        steps_with_equal_loss=len(a_l) if apart is None else apart,
        seq_len=seq_len, samples=samples, epochs=epochs, batch_size=batch_size, hidden=hidden, lr=lr, clip=clip,
        seed=seed, epoch_log=epoch_log, held_out_samples=HELD_OUT,
        held_out_accuracy_autograd=accuracy(models["autograd"], x_test, y_test),
        held_out_accuracy_bppsa=accuracy(models["bppsa"], x_test, y_test),
        gradient_checks=[{"step": s_, "max_rel_diff": d} for s_, d in checks],
        gradient_max_rel_diff_float32=max((d for _, d in checks), default=None),
    )
    if check_gradients:
        summary["gradient_max_rel_diff_float64"] = float64_check(models["autograd"], x_all[:batch_size],
                                                                y_all[:batch_size], **plan_kwargs)
    return logs["autograd"], logs["bppsa"], summary


def _summary(auto: RunLog, ours: RunLog, dev: torch.device, model: BitstreamClassifier) -> dict:
    # the first step of each run pays one-time costs (allocator, kernel compilation): not timed
    skip = 1 if len(auto.step_s) > 1 else 0
    a_bwd, o_bwd = sum(auto.backward_s[skip:]), sum(ours.backward_s[skip:])
    a_step, o_step = sum(auto.step_s[skip:]), sum(ours.step_s[skip:])
    plan = getattr(model.rnn, "plan", None)
    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({threads} thread{'s' * (threads != 1)})"
    return {
        "device": name,
        "levels": getattr(plan, "levels", None),
        "layout": getattr(plan, "layout", None),
        "autograd_backward_s": a_bwd,
        "bppsa_backward_s": o_bwd,
        "autograd_step_s": a_step,
        "bppsa_step_s": o_step,
        "backward_speedup": a_bwd / o_bwd if o_bwd else float("nan"),
        "overall_speedup": a_step / o_step if o_step else float("nan"),
        # the loss of the last training step (one mini-batch); the printed epoch losses are means over
        # an epoch's steps (epoch_log)
        "last_step_loss_autograd": auto.losses[-1],
        "last_step_loss_bppsa": ours.losses[-1],
    }


def plot_curves(auto: RunLog, ours: RunLog, path: str, title: str = "") -> str:
    """Training loss vs cumulative training wall-clock time for both runs (paper Figure 7). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    # the first step pays one-time costs (allocator, first-call setup): left out, as in the summary
    skip = 1 if len(auto.step_s) > 1 else 0
    for rl, color, label in ((ours, "tab:blue", "BPPSA (spscan)"), (auto, "tab:red", "autograd baseline")):
        ax.plot(rl.wall_clock(skip), _smooth(rl.losses)[skip:], color=color, label=label, linewidth=1.4)
    ax.set_xlabel("training wall-clock time after the first step (s)")
    ax.set_ylabel("training loss (moving average)")
    ax.set_title(title or "Bitstream RNN: loss vs wall-clock time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _smooth(values: Sequence[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spscan demo",
        description=(
            "Train the paper's bitstream-classification RNN (section 4.1: hidden 20, Adam, Linear head on the "
            "last hidden state) with BPPSA and with autograd side by side from the same seed; print loss/accuracy "
            "per epoch, BPPSA's gradient difference from autograd on the same weights, held-out accuracy, the "
            "measured backward and overall speedups, and write the loss-vs-time curves as a PNG. "
            f"Both runs clip the gradient norm at {CLIP} and decay the learning rate to zero (cosine). The default "
            "peak learning rates (1e-3; 3e-3 with --quick) are "
            "higher than the paper's 1e-5 so the curves move within a demo."
        ),
    )
    p.add_argument("--quick", action="store_true", help="small run (about 15 s on a 2-core CPU)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--out", default="./spscan-demo", help="output directory for the PNG and summary.json (default ./spscan-demo)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length T (default 1000)")
    p.add_argument("--samples", type=int, default=None, help="number of training samples (default 2560; --quick 256)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 10; --quick 5)")
    p.add_argument("--batch-size", type=int, default=None, help="mini-batch size B (default 16)")
    p.add_argument("--hidden", type=int, default=20, help="hidden size (default 20, as in the paper)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak Adam learning rate, cosine-decayed to 0 (default 1e-3; --quick 3e-3; the paper uses 1e-5)")
    p.add_argument("--clip", type=float, default=CLIP,
                   help=f"gradient-norm clipping threshold for both runs (default {CLIP}; 0 turns it off)")
    p.add_argument("--levels", default="auto", help="scan up-sweep depth: auto, full or an int (0 = linear scan)")
    p.add_argument("--layout", default="auto", choices=["auto", "factored", "materialized"],
                   help="the recurrent chain's layout: 2T factored elements (W_hh^T, diagonal) or T materialized "
                        "H x H Jacobians")
    p.add_argument("--forward", default="sequential", choices=["sequential", "newton", "auto"],
                   help="forward of the BPPSA run: the module's own loop, Newton iterations over the planned scan "
                        "(spscan.recurrent.newton; falls back to the loop with a warning if it does not converge), or the cost "
                        "model's choice (default sequential)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, initial weights and batch order")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (there is none unless a terminal)")
    return p


def _check_device(name: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """``(device, None)`` if tensors can be made on ``name`` here, else ``(None, one-line reason)``."""
    if name is None:
        return ("cuda" if torch.cuda.is_available() else "cpu"), None
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        return None, f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        return None, f"--device {name}: CUDA is not available ({why}); run on the CPU with --device cpu"
    try:
        torch.empty(1, device=dev)
    except Exception as exc:  # any backend's refusal, reported in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"--device {name} is not usable here: {first}"
    return str(dev), None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m spscan demo``; returns the exit status (2 for bad arguments)."""
    args = _parser().parse_args(list(argv) if argv is not None else None)
    preset = "tiny" if args.tiny else ("quick" if args.quick else "default")
    T, N, E, B, lr = _PRESETS[preset]
    lr = args.lr if args.lr is not None else lr
    T = args.seq_len or T
    N = args.samples or N
    E = args.epochs or E
    B = args.batch_size or B
    levels = args.levels

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if levels not in ("auto", "full"):
        try:
            levels = int(levels)
        except ValueError:
            return fail(f"expected --levels auto, full or an int, got {levels!r}")
    if not lr > 0:
        return fail(f"expected a positive --lr, got {lr}")
    if not args.clip >= 0:
        return fail(f"expected --clip >= 0 (0 = off), got {args.clip}")
    if min(T, N, E, B, args.hidden) < 1:
        return fail("expected positive --seq-len, --samples, --epochs, --batch-size and --hidden")
    if N < B:
        return fail(f"expected --samples >= --batch-size, got {N} < {B}")
    dev, why = _check_device(args.device)
    if why:
        return fail(why)
    # a progress bar only on a terminal: redirected output stays one line per epoch
    progress = not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
    clip = args.clip or None
    print(f"bitstream RNN: T={T} B={B} H={args.hidden} samples={N} epochs={E} Adam lr={lr} "
          f"clip={clip if clip else 'off'} device={dev}", flush=True)
    auto, ours, summary = train_side_by_side(
        seq_len=T, samples=N, epochs=E, batch_size=B, hidden=args.hidden, lr=lr, clip=clip, seed=args.seed,
        device=dev, levels=levels, layout=args.layout, forward=args.forward, progress=progress,
        log=lambda line: print(line, flush=True),
    )
    last = summary["epoch_log"][-1]
    print(f"last epoch (mean over its steps): autograd loss {last['autograd']['loss']:.4f} acc {last['autograd']['accuracy']:.3f}, "
          f"BPPSA loss {last['bppsa']['loss']:.4f} acc {last['bppsa']['accuracy']:.3f}")
    steps = summary["epochs"] * (summary["samples"] // summary["batch_size"])
    same = summary["steps_with_equal_loss"]
    if same < steps:
        print(f"the two runs' losses agree to 4 digits for the first {same} of {steps} steps; then float32 "
              f"rounding (a different summation order) makes them two runs of the same training, as two autograd "
              f"runs on different hardware would be")
    else:
        print(f"the two runs' losses agree to 4 digits at all {steps} steps")
    print(f"held-out accuracy ({summary['held_out_samples']} new samples): autograd "
          f"{summary['held_out_accuracy_autograd']:.3f}, BPPSA {summary['held_out_accuracy_bppsa']:.3f}")
    print(f"gradients, BPPSA vs autograd on the same weights and batch (max relative difference over all "
          f"parameters): float32 {summary['gradient_max_rel_diff_float32']:.1e} (worst of "
          f"{len(summary['gradient_checks'])} checks), float64 {summary['gradient_max_rel_diff_float64']:.1e}")
    print(
        f"backward: autograd {summary['autograd_backward_s']:.3f}s, BPPSA {summary['bppsa_backward_s']:.3f}s "
        f"-> {summary['backward_speedup']:.2f}x"
    )
    print(
        f"training step: autograd {summary['autograd_step_s']:.3f}s, BPPSA {summary['bppsa_step_s']:.3f}s "
        f"-> {summary['overall_speedup']:.2f}x overall  (device: {summary['device']}, "
        f"layout: {summary['layout']}, levels: {summary['levels']})"
    )
    os.makedirs(args.out, exist_ok=True)
    png = plot_curves(
        auto, ours, os.path.join(args.out, "training_curves.png"),
        title=f"Bitstream RNN, T={T}, B={B} on {summary['device']}",
    )
    js = os.path.join(args.out, "summary.json")
    with open(js, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    print(f"wrote {png}")
    print(f"wrote {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
