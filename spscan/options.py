"""The planning options of :func:`spscan.plan` and :func:`spscan.wrap`, defined once.

Both functions take these as keyword-only parameters with the defaults below, and their docstrings
list them from this table, so the two cannot drift apart (a test compares the signatures with
:data:`OPTIONS`). Each option says which kinds of model it applies to; an option given a value
other than its default for a model it does not apply to is refused by name, as is an unknown
keyword (with the closest valid name).
"""

from __future__ import annotations

import difflib
import inspect
import os
import textwrap
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIONS", "Option", "check_options", "option_default", "options_doc", "takes_options", "unknown_option"]

# kinds of what is planned
PATTERNS = "patterns"  # a chain of transposed-Jacobian patterns
CHAIN = "chain"  # an nn.Sequential (or one layer)
GRAPH = "graph"  # any other model torch.fx traces
RECURRENT = "recurrent"  # nn.RNN / nn.GRU / nn.LSTM, stacked or bidirectional

_MODELS = frozenset({CHAIN, GRAPH, RECURRENT})
_ALL = frozenset({PATTERNS}) | _MODELS
_KIND_NAMES = {PATTERNS: "a chain of patterns", CHAIN: "an nn.Sequential chain", GRAPH: "a traced model",
               RECURRENT: "nn.RNN/nn.GRU/nn.LSTM"}


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    applies: frozenset
    doc: str


OPTIONS: tuple[Option, ...] = (
    Option("levels", "auto", _ALL,
           '"auto" (the cost model picks the up-sweep depth), "full" (pure Blelloch) or an int K >= 0 '
           "(0 = the linear scan; clamped to the chain's maximum depth). Every choice gives the same "
           "gradients up to floating-point reordering."),
    Option("backend", "auto", _ALL,
           '"auto" (Triton on CUDA, torch on CPU), "torch" or "triton".'),
    Option("device", None, _ALL,
           "the device the plan is for; None: the example input's (a model) or whatever each call "
           "passes (patterns). A device that is not available is refused."),
    Option("dtype", None, _ALL,
           "torch.float32 or torch.float64; None: the model's (a model) or whatever each call passes."),
    Option("max_memory", None, _ALL,
           "a byte limit for the backward's peak at batch_size: levels='auto' lowers the depth to fit; "
           "a forced depth that does not fit raises ValueError with the numbers."),
    Option("batch_size", None, _ALL,
           "the batch size the cost model and the memory check assume (calls may use any); None: the "
           "example input's batch (a model), 16 (patterns)."),
    Option("operators", True, frozenset({CHAIN, GRAPH}),
           "in the backward, layers with a structured operator (conv, linear, activations, pooling, "
           "normalization, reshapes, dropout) apply J^T directly where the scan only multiplies them by "
           "vectors; False forms CSR values everywhere."),
    Option("prune_zeros", False, frozenset({CHAIN, GRAPH}),
           "also leave exactly-zero Linear/Conv weights out of the patterns (they must stay zero)."),
    Option("norm_form", "auto", frozenset({CHAIN, GRAPH}),
           '"auto", "dense" or "factored": how LayerNorm/GroupNorm/Softmax blocks enter the chain '
           "(dense blocks, or their diagonal-plus-low-rank factors)."),
    Option("dag", "auto", frozenset({GRAPH}),
           '"auto" (series-parallel blocks where the graph is one, else the live-set chain) or "live" '
           "(the live-set chain always)."),
    Option("layout", "auto", frozenset({RECURRENT}),
           '"auto", "factored" or "materialized": how a recurrent step\'s Jacobian enters the chain.'),
    Option("forward", "sequential", frozenset({RECURRENT}),
           '"sequential" (the module\'s own forward), "newton" (Newton iterations over the '
           'forward-direction scan) or "auto".'),
    Option("backward", "auto", _MODELS,
           '(spscan.wrap) "auto" (the cost model chooses, per input signature, the scan or the model\'s own '
           'autograd backward, whichever it predicts faster: wrapped.explain() says which and why), "scan", '
           '"native" (always the model\'s own backward: autograd\'s gradients bit for bit) or "graph" (on a GPU, the '
           'whole training step of the scan, forward and backward, replayed from two CUDA graphs per input '
           'signature; bitwise equal to "scan"). The environment variable SPSCAN_BACKWARD sets the default.'),
    Option("newton", None, frozenset({RECURRENT}),
           "a spscan.recurrent.newton.NewtonOptions (or a dict of its fields) for forward='newton'/'auto'."),
)

_BY_NAME = {o.name: o for o in OPTIONS}


def unknown_option(func: str, name: str) -> TypeError:
    """The error for an unknown keyword of ``func``: the bad name, the closest valid one, all of them."""
    close = difflib.get_close_matches(name, list(_BY_NAME), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{func}() got an unexpected keyword argument {name!r}{hint} "
                     f"(its options: {', '.join(_BY_NAME)})")


def check_options(func: str, kind: str, given: dict[str, Any], what: str) -> dict[str, Any]:
    """The options that apply to ``kind``, as the front end takes them (``given``: what the caller
    passed; the others take their defaults).

    An option set (to other than its default) that does not apply to ``kind`` raises ``TypeError``
    naming it, ``what`` (the user's object) and the kinds it is for. ``batch_size=None`` for a chain
    of patterns means 16.
    """
    out: dict[str, Any] = {}
    env = {k: v for k, v in environment_defaults().items() if kind in _BY_NAME[k].applies}
    given = {**{o.name: o.default for o in OPTIONS}, **env, **given}
    for name, value in given.items():
        opt = _BY_NAME.get(name)
        if opt is None:
            raise unknown_option(func, name)
        if kind in opt.applies:
            out[name] = value
        elif value is not opt.default and value != opt.default:
            kinds = " and ".join(_KIND_NAMES[k] for k in (PATTERNS, CHAIN, GRAPH, RECURRENT) if k in opt.applies)
            raise TypeError(f"{func}(): option {name!r} is for {kinds}, not for {what}")
    if out.get("batch_size", 0) is None:
        if kind == PATTERNS:
            out["batch_size"] = 16
        else:
            del out["batch_size"]
    return out


#: option -> the environment variable that overrides its default (e.g. a test suite that must exercise
#: the scan on every model sets ``SPSCAN_BACKWARD=scan``); a value given in the call always wins
ENVIRONMENT = {"backward": "SPSCAN_BACKWARD"}


def environment_defaults() -> dict[str, Any]:
    out = {}
    for name, var in ENVIRONMENT.items():
        value = os.environ.get(var)
        if value:
            out[name] = value
    return out


def option_default(name: str) -> Any:
    """The default of option ``name`` in effect: its environment override if set, else :data:`OPTIONS`'."""
    return environment_defaults().get(name, _BY_NAME[name].default)


def options_doc(indent: int = 4) -> str:
    """The options as a docstring section (``Options:`` and one entry per option)."""
    pad = " " * indent
    lines = [f"{pad}Options (keyword-only; each says what it applies to):"]
    for o in OPTIONS:
        kinds = "all" if o.applies == _ALL else ", ".join(sorted(o.applies))
        head = f"{pad}    {o.name} (default {o.default!r}; {kinds}): "
        body = textwrap.fill(o.doc, width=100, initial_indent=head, subsequent_indent=pad + " " * 8)
        lines.append(body)
    return "\n".join(lines) + "\n"


def takes_options(func):
    """Give ``func(..., **options)`` the options as its keyword-only parameters: its signature (what
    ``help``, ``inspect`` and editors show) and an ``Options`` section appended to its docstring, both
    from :data:`OPTIONS`. ``func`` validates what it receives with :func:`check_options`."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default) for o in OPTIONS]
    func.__signature__ = sig.replace(parameters=params)
    func.__doc__ = (func.__doc__ or "").rstrip() + "\n\n" + options_doc(4)
    return func
