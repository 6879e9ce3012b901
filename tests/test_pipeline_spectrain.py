"""SpecTrain weight prediction and the asynchronous-pipeline emulation against hand-written references."""

import pytest
import torch
from torch import nn

from spscan.parallel.pipeline.spectrain import pipedream_staleness, predict_weights, train_pipelined


def _stages(seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(5, 6), nn.Tanh()).double(), nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double(),
            nn.Sequential(nn.Linear(6, 3)).double()]


def _batches(b):
    g = torch.Generator().manual_seed(100 + b)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


def _reference(steps, staleness, lr, mu, predict):
    """Versions kept explicitly: W[k][t] and V[k][t] after t updates of stage k."""
    stages = _stages()
    W = [[{n: p.detach().clone() for n, p in st.named_parameters()}] for st in stages]
    V = [[{n: None for n, _ in st.named_parameters()}] for st in stages]
    for b in range(steps):
        x, y = _batches(b)
        used = []
        for k in range(len(stages)):
            t = len(W[k]) - 1
            s = min(staleness[k], t)
            w = {n: v.clone() for n, v in W[k][t - s].items()}
            if predict and s:
                w = {n: w[n] - s * lr * V[k][t - s][n] if V[k][t - s][n] is not None else w[n] for n in w}
            used.append({n: v.requires_grad_(True) for n, v in w.items()})
        out = x
        for st, w in zip(stages, used):
            out = torch.func.functional_call(st, w, (out,))
        nn.functional.cross_entropy(out, y).backward()
        for k in range(len(stages)):
            cur_w, cur_v = W[k][-1], V[k][-1]
            nv = {n: used[k][n].grad.clone() if cur_v[n] is None else mu * cur_v[n] + used[k][n].grad for n in cur_w}
            W[k].append({n: cur_w[n] - lr * nv[n] for n in cur_w})
            V[k].append(nv)
    return [W[k][-1] for k in range(len(stages))]


def test_predict_weights_formula():
    w = [torch.tensor([1.0, 2.0]), torch.ones(2, 2)]
    v = [torch.tensor([0.5, -1.0]), None]
    got = predict_weights(w, v, lr=0.1, s=3)
    torch.testing.assert_close(got[0], torch.tensor([1.0 - 0.15, 2.0 + 0.3]))
    torch.testing.assert_close(got[1], torch.ones(2, 2))
    assert predict_weights(w, v, 0.1, 0)[0] is not w[0]
    torch.testing.assert_close(predict_weights(w, v, 0.1, 0)[0], w[0])
    with pytest.raises(ValueError, match="s: expected a non-negative int"):
        predict_weights(w, v, 0.1, -1)
    with pytest.raises(ValueError, match="momentum\\[0\\]: expected shape \\(2,\\)"):
        predict_weights(w, [torch.ones(3), None], 0.1, 1)


def test_exact_mode_is_momentum_sgd():
    stages = _stages()
    train_pipelined(stages, _batches, 6, "exact", [2, 1, 0], lr=0.1, momentum=0.9)
    ref = _stages()
    model = nn.Sequential(*ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for b in range(6):
        x, y = _batches(b)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for a, r in zip(stages, ref):
        for (na, pa), (nr, pr) in zip(a.named_parameters(), r.named_parameters()):
            torch.testing.assert_close(pa, pr, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["stale", "spectrain"])
def test_stale_and_predicted_weights_match_reference(mode):
    stale = pipedream_staleness(3)
    assert stale == [2, 1, 0]
    stages = _stages()
    train_pipelined(stages, _batches, 7, mode, stale, lr=0.2, momentum=0.9)
    ref = _reference(7, stale, 0.2, 0.9, predict=(mode == "spectrain"))
    for st, w in zip(stages, ref):
        for n, p in st.named_parameters():
            torch.testing.assert_close(p.detach(), w[n], rtol=1e-12, atol=1e-12)


def test_modes_differ_and_zero_staleness_is_exact():
    finals = {}
    for mode in ("exact", "stale", "spectrain"):
        st = _stages()
        train_pipelined(st, _batches, 5, mode, [2, 1, 0], lr=0.2)
        finals[mode] = torch.cat([p.detach().reshape(-1) for s in st for p in s.parameters()])
    assert not torch.equal(finals["exact"], finals["stale"])
    assert not torch.equal(finals["stale"], finals["spectrain"])
    st = _stages()
    train_pipelined(st, _batches, 5, "stale", [0, 0, 0], lr=0.2)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for s in st for p in s.parameters()]), finals["exact"])
    with pytest.raises(ValueError, match="staleness: expected 3"):
        train_pipelined(_stages(), _batches, 1, "stale", [1, 0], lr=0.1)
    with pytest.raises(ValueError, match="mode: expected"):
        train_pipelined(_stages(), _batches, 1, "async", [1, 0, 0], lr=0.1)
