"""The demo, the datasets and the training behaviour of BPPSA (paper §3.5)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from spscan.cli.datasets import IRMAS_SHAPES, bitstream_dataset, load_irmas_mfcc, synthetic_irmas
from spscan.cli.demo import BitstreamClassifier, main
from spscan.recurrent.wrapper import wrap_recurrent


def test_demo_tiny_writes_png_and_summary(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--tiny", "--out", str(out), "--device", "cpu"]) == 0
    png = out / "training_curves.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seq_len"] == 40 and summary["backward_speedup"] > 0 and summary["overall_speedup"] > 0
    assert summary["layout"] == "factored" and isinstance(summary["levels"], int) and "engine" not in summary
    assert summary["clip"] == 1.0 and len(summary["epoch_log"]) == 2
    # exactness on the same weights: float32 rounding, and float64 to a few ulps
    assert len(summary["gradient_checks"]) == 2 and summary["gradient_max_rel_diff_float32"] < 1e-4
    assert summary["gradient_max_rel_diff_float64"] < 1e-12
    assert 0 <= summary["held_out_accuracy_autograd"] <= 1 and 0 <= summary["held_out_accuracy_bppsa"] <= 1
    assert summary["steps_with_equal_loss"] == 6  # 2 epochs x 3 batches, T=40: far from float32 drift
    assert summary["last_step_loss_autograd"] > 0 and "final_loss_autograd" not in summary
    captured = capsys.readouterr()
    text = captured.out
    epochs = [ln for ln in text.splitlines() if ln.startswith("epoch ")]
    assert [ln.split()[1] for ln in epochs] == ["1/2", "2/2"]
    assert all("autograd: loss" in ln and "bppsa: loss" in ln and "same-weights gradient diff" in ln for ln in epochs)
    assert re.search(r"backward: autograd [\d.]+s, BPPSA [\d.]+s -> [\d.]+x", text)
    assert re.search(r"-> [\d.]+x overall", text)
    assert "agree to 4 digits at all 6 steps" in text
    assert "held-out accuracy" in text and re.search(r"float32 \S+ .*float64 \S+", text)
    assert f"wrote {out / 'summary.json'}" in text and f"wrote {png}" in text
    # output is not a terminal here: no progress bar on either stream
    assert "\r" not in text and "\r" not in captured.err and "step/s" not in captured.err


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    assert main(["--tiny", "--levels", "deep", "--out", str(tmp_path)]) == 2
    assert main(["--tiny", "--samples", "4", "--batch-size", "8", "--out", str(tmp_path)]) == 2
    assert main(["--tiny", "--lr", "0", "--out", str(tmp_path)]) == 2
    assert main(["--tiny", "--clip", "-1", "--out", str(tmp_path)]) == 2
    assert main(["--tiny", "--device", "not-a-device", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 5 and "--device 'not-a-device'" in err
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_demo_without_cuda_is_one_line_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "spscan", "demo", "--device", "cuda", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA is not available" in lines[0] and "--device cpu" in lines[0]


def test_demo_help_mentions_learning_rate(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "1e-5" in capsys.readouterr().out


def _train(dtype, use_scan: bool, steps: int = 200, seed: int = 3, jitter: int = 0) -> np.ndarray:
    """Loss curve of a tiny bitstream classifier (H=8, T=30, B=16, Adam) trained from ``seed``.

    ``jitter`` > 0 perturbs every initial weight by one float32 rounding (relative ``2^-24``, random
    signs from that seed): a run that differs from ``jitter=0`` only by float32 noise.
    """
    x_all, y_all = bitstream_dataset(64, 30, seed=seed)
    torch.manual_seed(seed)
    model = BitstreamClassifier(hidden=8)
    if jitter:
        g = torch.Generator().manual_seed(jitter)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 2.0**-24 * (2 * torch.randint(0, 2, p.shape, generator=g) - 1))
    model = model.to(dtype)
    if use_scan:
        model.rnn = wrap_recurrent(model.rnn, x_all[:16].to(dtype))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        idx = torch.arange(16) + 16 * (step % 4)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_all[idx].to(dtype)), y_all[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return np.array(losses)


def test_training_curves_match_autograd():
    """Paper §3.5: 200 Adam steps with the scan and with autograd from one seed give the same curve.

    float64: equal up to amplified rounding. float32: the scan's curve is as close to the float64 curve as
    autograd's float32 curves are (float32 noise), and the model trains. Training amplifies rounding
    chaotically after ~100 steps, so one autograd run is one sample of that noise: it is measured
    as the widest of three autograd runs whose initial weights differ by one float32 rounding.
    """
    ref = _train(torch.float64, use_scan=False)
    ours64 = _train(torch.float64, use_scan=True)
    assert np.abs(ours64 - ref).max() < 1e-7  # Adam amplifies 1e-16 rounding over 200 steps
    ours32 = _train(torch.float32, use_scan=True)
    assert ref[-20:].mean() < ref[:20].mean() - 0.05  # it trains
    noise = max(np.abs(_train(torch.float32, use_scan=False, jitter=j) - ref).max() for j in (0, 1, 2))
    assert np.abs(ours32 - ref).max() <= 2 * noise + 1e-4, (np.abs(ours32 - ref).max(), noise)


def test_bitstream_dataset_follows_eq8():
    x, y = bitstream_dataset(2000, 400, seed=5)
    assert x.shape == (2000, 400, 1) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(torch.unique(x).tolist()) <= {0.0, 1.0}
    assert torch.bincount(y, minlength=10).tolist() == [200] * 10
    rate = x.mean(dim=(1, 2))
    for c in range(10):
        assert abs(rate[y == c].mean().item() - (0.05 + 0.1 * c)) < 0.01
    x2, y2 = bitstream_dataset(2000, 400, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="num_classes"):
        bitstream_dataset(10, 10, num_classes=11)


@pytest.mark.parametrize("set_name", sorted(IRMAS_SHAPES))
def test_synthetic_irmas_shapes(set_name):
    x, y = synthetic_irmas(set_name, 33, seed=1)
    F, C = IRMAS_SHAPES[set_name]
    assert x.shape == (33, F, C) and y.shape == (33,) and int(y.max()) <= 10
    torch.testing.assert_close(x.mean(dim=1), torch.zeros(33, C), atol=1e-4, rtol=0)
    assert torch.equal(synthetic_irmas(set_name, 33, seed=1)[0], x)


def test_load_irmas_mfcc_layout(tmp_path):
    F, C = IRMAS_SHAPES["M"]
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "irmas_M.npz", features=rng.standard_normal((5, F, C)) * 3 + 1, labels=np.arange(5))
    x, y = load_irmas_mfcc(tmp_path, "M")
    assert x.shape == (5, F, C) and y.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(x.std(dim=1, unbiased=False), torch.ones(5, C), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"expected features of shape \(N, 259, 38\)"):
        load_irmas_mfcc(os.path.join(tmp_path, "irmas_M.npz"), "S")
    np.savez(tmp_path / "bad.npz", features=np.zeros((2, F, C)), labels=np.array([0, 11]))
    with pytest.raises(ValueError, match="labels in 0..10"):
        load_irmas_mfcc(tmp_path / "bad.npz", "M")


def test_cli_help_is_plain_text_and_points_to_each_command():
    """``python -m spscan --help``: plain text (no reStructuredText markup), naming both commands, their
    ``--help`` and the short ``--quick`` runs; no command at all is a usage error."""
    import contextlib
    import io

    from spscan.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    text = out.getvalue()
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    for want in ("demo --help", "bench --help", "demo --quick", "bench --quick"):
        assert want in text
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([]) == 2
    assert "usage: python -m spscan" in err.getvalue()
