"""The one wrapper of ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` modules: a single-layer module's plan
(:class:`~spscan.recurrent.plan.RecurrentPlan`) or a stacked / bidirectional one's
(:class:`~spscan.recurrent.stacked.StackedRecurrentPlan`, one single-layer plan per (layer, direction)) behind the same
module, the same scan-or-native choice per ``(T, B)`` and the same step."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from spscan.runtime.autograd import refuse_functorch
from spscan.runtime.choices import BackwardChoice, recurrent_decision, recurrent_shapes, sequence_signature
from spscan.options import option_default
from spscan.planner.choose import Decision
from spscan.recurrent.plan import plan_recurrent
from spscan.recurrent.backward import check_input, run_wrapped
from spscan.recurrent.stacked import is_stacked, plan_stacked

__all__ = ["RecurrentWrapper", "wrap_recurrent"]


class RecurrentWrapper(BackwardChoice, nn.Module):
    """An ``nn.RNN``/``nn.GRU``/``nn.LSTM`` (single-layer, stacked, bidirectional) whose backward runs through
    the BPPSA scan: one scan over time per (layer, direction), top layer first.

    Holds the module itself (``self.module``): ``parameters()`` are the module's own objects, ``torch.optim``
    works unchanged and ``train()``/``eval()`` reach it (dropout between stacked layers follows
    ``module.training``). ``forward(x, hx=None)`` returns what the module returns: ``(output, h_n)`` or
    ``(output, (h_n, c_n))``; batch size and sequence length may change between calls (one scan plan per
    length is kept).
    """

    _model_attr = "module"

    def __init__(self, module: nn.Module, example_input: Optional[torch.Tensor] = None, **plan_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        backward = plan_kwargs.pop("backward", option_default("backward"))
        self.plan = (plan_stacked if is_stacked(module) else plan_recurrent)(module, example_input, **plan_kwargs)
        self._init_choice(backward, sequence_signature(module, example_input))

    def _backward_decision(self, key) -> Decision:
        m = self.module
        return recurrent_decision(self.plan.cell.family, recurrent_shapes(m), key[0], key[1], m.weight_hh_l0.device,
                                  self.backward_mode, self.plan.describe())

    def forward(self, x: torch.Tensor, hx=None):
        return super().forward(x, hx)

    def _signature(self, x: Any) -> Optional[tuple[int, int]]:
        return sequence_signature(self.module, x)

    def _scan_dtype(self) -> torch.dtype:
        return self.module.weight_hh_l0.dtype

    @torch.compiler.disable  # under torch.compile the scan's step runs as it is (a graph break), not traced
    def _scan_step(self, key, choice: str, x: torch.Tensor, hx):
        refuse_functorch()
        plan = self.plan
        check_input(plan.module, x)
        plan.check_unchanged()  # the module's configuration may have been changed after wrapping
        h0, c0 = plan.split_state(hx)
        out = run_wrapped(plan, self.module, x, hx, h0, c0, plan.step_params(), choice == "graph")
        self._after_step(key, choice)
        return out

    def extra_repr(self) -> str:
        return self.plan.describe()


def wrap_recurrent(rnn: nn.Module, example_input: Optional[torch.Tensor] = None,
                   **plan_kwargs: Any) -> RecurrentWrapper:
    """``nn.Module`` around ``rnn`` (same parameter objects) whose backward is the BPPSA scan.

    ``example_input``: ``(T, B, I)`` (``(B, T, I)`` if batch_first) or ``(T, I)``; its ``T`` is planned now,
    other lengths on first use. Forward returns exactly what ``rnn`` returns (``forward="newton"``: computed
    by Newton iterations over the planned scan, equal to the module's up to rounding); ``loss.backward()``
    fills ``.grad`` of the input, the initial state and every parameter as autograd would (dropout masks
    between stacked layers included). ``plan_kwargs`` as :func:`spscan.recurrent.plan.plan_recurrent` takes them,
    applied to every (layer, direction).
    """
    return RecurrentWrapper(rnn, example_input, **plan_kwargs)
