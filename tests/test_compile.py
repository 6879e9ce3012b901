"""A wrapped model under ``torch.compile``: the scan's step and the planner's first decision for a new input
signature run as they are (graph breaks, ``torch.compiler.disable``), the rest is compiled. Gradients equal
autograd's on the same steps, the batch size changing. (TorchDynamo used to trace into the compiled CPU
recurrences and fail inside its own bytecode rewriting.)

The ``aot_eager`` backend runs TorchDynamo and AOTAutograd without generating code, so this runs in seconds
on any machine; inductor takes the same graphs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import spscan
from wrapper_models import MODELS as ALL_MODELS, output


MODELS = {k: ALL_MODELS[k] for k in ("cnn", "residual", "gru", "stacked_lstm")}


_out = output


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backward", ["scan", "auto", "native"])
def test_compiled_wrapper_equals_autograd(name, backward):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    wrapped = spscan.wrap(model, torch.randn(4, *shape, dtype=torch.float64), backward=backward)
    compiled = torch.compile(wrapped, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of TorchDynamo's about what it met on the way either
        for batch in (4, 3, 4):
            x = torch.randn(batch, *shape, dtype=torch.float64)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = compiled(xa), ref(xb)
            torch.testing.assert_close(_out(ya), _out(yb), rtol=1e-12, atol=1e-12)
            _out(ya).square().sum().backward()
            _out(yb).square().sum().backward()
            for a, b in zip([xa.grad, *[p.grad for p in model.parameters()]],
                            [xb.grad, *[p.grad for p in ref.parameters()]]):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
