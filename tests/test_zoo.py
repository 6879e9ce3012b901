"""The zoo: models nobody on the team wrote (torchvision's, timm's, and code as it is posted in popular
repositories: ``tests/zoo_models.py``), wrapped as they are with ``spscan.wrap(model, x, backward="scan")``,
give autograd's output and gradients in float64.

One test per model, in the style of timm's ``tests/test_models.py``: the model (train mode, float64) and a
deep copy of it before wrapping (a model with ``torch.nn.utils.weight_norm``, which cannot be deep-copied:
the same seeded build); two steps (batch 2, the example input itself, then a new batch of 3) with the same
loss on both sides, ``(y * w).sum()`` for fixed random ``w`` (every output entry matters); the output, the
input's gradient (a floating input; token ids have none) and every parameter's gradient equal autograd's up
to 1e-9 of their largest entry (a parameter's gradient: of the larger of its own largest entry and
:data:`FLOOR` times the model's largest gradient), and after both steps every buffer (BatchNorm's running
statistics) equals the copy's. Wrapping leaves ``model.state_dict()``'s keys as they were, and the
wrapper's are the model's. A failure names every tensor that differs and by how much; the worst relative
error of each step is recorded as a property of the test (``--junitxml``).

A case that needs torchvision or timm is skipped, saying so, where that package is not importable.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import spscan
from zoo_models import BY_NAME, CASE_NAMES, missing

TOL = 1e-9  #: max |spscan - autograd| relative to max |autograd| of the same tensor
#: a parameter's gradient is compared relative to at least this fraction of the model's largest gradient: a
#: gradient that is zero in exact arithmetic (a BatchNorm's bias or weight whose channel reaches the loss only
#: through train-mode BatchNorms, which remove per-channel shifts and scales: tv_mobilenet_v3_small,
#: tv_efficientnet_b0, tv_densenet have such) holds float64 noise from sums of much larger terms, 1e-10 of
#: its own size apart on the two sides; it is not compared by that noise (a wrong gradient is off by O(1))
FLOOR = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread for each zoo model: its time goes to tracing and planning and to small float64 ops, and
    two OpenMP threads that contend with other processes for two cores spin-wait (on a shared two-core machine
    the file took 5 min 41 s with two threads, 64 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor, 1e-300)
    return float((a - b).abs().max()) / scale if b.numel() else 0.0


def _step(model, case, x, seed):
    """One step: the output the loss reads and the input's gradient (None for token ids)."""
    for p in model.parameters():
        p.grad = None
    xi = x.clone().requires_grad_(x.is_floating_point())
    y = case.output(model(xi))
    wt = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(seed))
    loss = (y * wt).sum()
    loss.backward()
    return y.detach(), xi.grad


def _double(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


@pytest.mark.parametrize("name", CASE_NAMES)
def test_zoo_model_gives_autograds_gradients(name, request):
    case = BY_NAME[name]
    why = missing(case.needs)
    if why:
        pytest.skip(why)
    model = case.build("test").double()
    try:
        ref = copy.deepcopy(model)
    except RuntimeError:  # torch.nn.utils.weight_norm's modules cannot be deep-copied: the same seeded build
        ref = case.build("test").double()
    for (n, a), b_ in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b_), f"the reference copy differs in {n}"
    keys = list(model.state_dict())
    x0 = _double(case.batch(2, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a forced scan names the nodes that run autograd's own backward
        wrapped = spscan.wrap(model, x0, backward="scan")
    assert list(model.state_dict()) == keys, "wrapping changed the model's state_dict keys"
    assert list(wrapped.state_dict()) == keys, "the wrapper's state_dict keys are not the model's"

    for step, b in enumerate((2, 3)):
        x = x0 if step == 0 else _double(case.batch(b, seed=step))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y, gx = _step(wrapped, case, x, 100 + step)
        y_ref, gx_ref = _step(ref, case, x, 100 + step)
        assert y.shape == y_ref.shape, f"step {step} (batch {b}): output shape {tuple(y.shape)}"
        errors = [("output", _rel(y, y_ref))]
        if gx_ref is not None:
            assert gx is not None, f"step {step} (batch {b}): no input gradient"
            errors.append(("input", _rel(gx, gx_ref)))
        pairs = list(zip(model.named_parameters(), ref.parameters(), strict=True))
        floor = FLOOR * max((float(q.grad.abs().max()) for _, q in pairs if q.grad is not None), default=0.0)
        for (n, p), q in pairs:
            assert (p.grad is None) == (q.grad is None), \
                f"step {step} (batch {b}): {n}: gradient {'missing' if p.grad is None else 'where autograd has none'}"
            if q.grad is not None:
                errors.append((n, _rel(p.grad, q.grad, floor)))
        request.node.user_properties.append((f"step{step}_worst", "{} {:.2e}".format(*max(errors, key=lambda t: t[1]))))
        bad = [(n, e) for n, e in errors if not e <= TOL]
        assert not bad, (f"step {step} (batch {b}): {len(bad)} of {len(errors)} differ from autograd (relative, "
                         f"limit {TOL:g}): " + ", ".join(f"{n} {e:.2e}" for n, e in bad[:8])
                         + (" ..." if len(bad) > 8 else ""))

    bad = []
    for (n, a), b_ in zip(model.named_buffers(), ref.buffers(), strict=True):
        if a.is_floating_point():
            if not _rel(a, b_) <= TOL:
                bad.append(f"{n} {_rel(a, b_):.2e}")
        elif not torch.equal(a, b_):
            bad.append(n)
    assert not bad, "buffers differ from autograd's copy after two steps: " + ", ".join(bad)
