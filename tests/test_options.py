"""The planning options of spscan.plan and spscan.wrap: one definition, keyword-only, clear refusals."""

from __future__ import annotations

import inspect

import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan
from spscan.options import OPTIONS


@pytest.mark.parametrize("func", [spscan.plan, spscan.wrap])
def test_plan_and_wrap_take_the_shared_options_keyword_only(func):
    params = inspect.signature(func).parameters
    named = [p for p in params.values() if p.kind == inspect.Parameter.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in named] == [(o.name, o.default) for o in OPTIONS]
    doc = inspect.getdoc(func)
    for o in OPTIONS:
        assert f"{o.name} (default {o.default!r}" in doc


@pytest.mark.parametrize("func", ["plan", "wrap"])
def test_unknown_option_names_the_function_the_name_the_closest_and_all(func):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with pytest.raises(TypeError) as e:
        getattr(spscan, func)(model, torch.randn(2, 4), levles=1)
    msg = str(e.value)
    assert msg.startswith(f"{func}() got an unexpected keyword argument 'levles'")
    assert "did you mean 'levels'" in msg and all(o.name in msg for o in OPTIONS)
    with pytest.raises(TypeError, match=r"wrap\(\) got an unexpected keyword argument 'chain' \(its options: levels"):
        spscan.wrap(model, torch.randn(2, 4), chain="x")


def test_unknown_option_on_a_chain_of_patterns():
    with pytest.raises(TypeError, match=r"plan\(\) got an unexpected keyword argument 'level'; did you mean 'levels'"):
        spscan.plan([sp.csr_array(sp.eye(3))], level=0)


def test_an_option_for_another_kind_of_model_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(TypeError, match=r"wrap\(\): option 'layout' is for nn.RNN/nn.GRU/nn.LSTM, not for a Sequential"):
        spscan.wrap(model, torch.randn(2, 4), layout="factored")
    with pytest.raises(TypeError, match=r"option 'operators' is for an nn.Sequential chain and a traced model, not for"):
        spscan.wrap(nn.GRU(2, 3), torch.randn(5, 1, 2), operators=False)
    with pytest.raises(TypeError, match="not for a chain of patterns"):
        spscan.plan([sp.csr_array(sp.eye(3))], norm_form="dense")
    # the defaults pass through whatever the model
    spscan.wrap(nn.GRU(2, 3), torch.randn(5, 1, 2), operators=True, norm_form="auto")


def test_a_model_needs_its_example_input():
    with pytest.raises(TypeError, match=r"wrap\(model, example_input\): a Sequential is planned from an example input"):
        spscan.wrap(nn.Sequential(nn.Linear(4, 3)))


def test_the_cost_model_plans_for_the_example_batch():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    assert spscan.plan(model, torch.randn(8, 4)).core.batch_size == 8
    assert spscan.plan(model, torch.randn(8, 4), batch_size=32).core.batch_size == 32
