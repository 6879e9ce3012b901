"""Planning an ``nn.Sequential`` chain: finding its layers (nested plain containers flattened, hooks
refused), one unit per layer, the choice of a normalization's form (dense blocks or low-rank factors), the
depth a batch-coupled layer allows, and the :class:`~spscan.chain.model.ModelPlan` they make
(:func:`plan_model`, :func:`plan_chain`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from spscan.chain.model import ModelPlan, has_hooks
from spscan.errors import NotPlannable
from spscan.layers import LayerUnit, make_unit, supported_layer_types, unit_capabilities
from spscan.planner.choose import Candidate, choose
from spscan.runtime.plan import build_plan, plan_profile

__all__ = ["UnitRefused", "check_hooks", "example_rejected", "is_chain_model", "levels_for_coupled_layers", "plan_chain",
           "plan_model"]


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


class UnitRefused(NotPlannable):
    """A layer of a chain whose analytic unit does not cover its configuration (``padding_mode="circular"``,
    ``sparse=True``, ...): ``spscan.plan`` and ``spscan.wrap`` trace the chain instead, that layer an opaque
    node (its own call and autograd backward)."""


def check_hooks(index: int, name: str, m: nn.Module) -> None:
    """Refuse layer ``index`` (``name``) of a chain planned directly if it has hooks (:func:`has_hooks`);
    ``spscan.plan`` and ``spscan.wrap`` trace such a chain instead, the hooked layer an opaque node."""
    if has_hooks(m):
        raise UnitRefused(
            f"layer {index} ({name or type(m).__name__}: {type(m).__name__}): forward/backward hooks other "
            "than torch.nn.utils.prune masks are not supported (they could change what the layer computes)")


# ----------------------------------------------------------------------------- chain discovery


def is_chain_model(model: nn.Module) -> bool:
    """A supported layer, or a plain ``nn.Sequential`` (nested plain ones allowed) of supported
    layers without hooks: planned as a chain directly. Anything else (a module with its own forward, a layer
    without a unit or with hooks, anywhere in it) is traced with torch.fx (:mod:`spscan.graph.plan`), where a
    sequential container is the trivial graph and a layer without a unit (or with hooks) an opaque node."""
    supported = supported_layer_types()
    if has_hooks(model):
        return False
    if type(model) in supported:
        return True
    if not _is_plain_sequential(model):
        return False
    for child in model._modules.values():
        if child is None:
            continue
        if isinstance(child, nn.Sequential):
            if not is_chain_model(child):
                return False
        elif type(child) not in supported or has_hooks(child):
            return False
    return True


def _plain_containers(model: nn.Module) -> bool:
    """A supported layer, or plain ``nn.Sequential`` containers all the way down (any leaves): what
    :func:`plan_model` takes, naming a leaf without a unit."""
    if type(model) in supported_layer_types():
        return True
    return _is_plain_sequential(model) and all(_plain_containers(c) for c in model._modules.values()
                                               if isinstance(c, nn.Sequential))


def _flatten_chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every layer of a (nested) ``nn.Sequential`` chain."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    supported = supported_layer_types()
    if not _is_plain_sequential(model):
        if type(model) in supported:
            return [("", model)]
        raise NotPlannable(
            f"{type(model).__name__} is not a chain spscan can plan: expected an nn.Sequential (without an "
            "overridden forward) of supported layers, or a single supported layer; a custom forward may "
            "branch, reuse or transform activations in ways the plan cannot see")
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, seq: nn.Module) -> None:
        # _modules, not named_children(): the latter skips a module repeated in the chain
        for name, child in seq._modules.items():
            if child is None:
                continue
            q = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Sequential):
                if not _is_plain_sequential(child):
                    raise NotPlannable(f"layer {len(out)} ({q}): {type(child).__name__} overrides forward; "
                                    "only plain nn.Sequential containers can be flattened into a chain")
                if has_hooks(child):  # its hooks run with its own call: traced, the container an opaque node
                    raise UnitRefused(f"layer {len(out)} ({q}): a container with hooks")
                walk(q, child)
            else:
                out.append((q, child))

    walk("", model)
    return out


# ----------------------------------------------------------------------------- planning


def example_rejected(k: int, in_shape: tuple, error: Exception) -> str:
    """Why layer ``k`` refused the example input that reached it, with what to do where the cause is likely
    a missing batch dimension (the first layer rejecting a per-sample shape of one dimension or none)."""
    msg = f"the example input reaching it has per-sample shape {in_shape}, which it rejects: {error}"
    if k == 0 and len(in_shape) <= 1:
        msg += (". The example input's first dimension is the batch (spscan plans per sample): a single sample "
                "needs a batch dimension; pass x.unsqueeze(0) (a batch of one) or a batch of your data")
    return msg


def levels_for_coupled_layers(units: Sequence[LayerUnit], kwargs: dict) -> dict:
    """A layer that couples the samples of a batch (train-mode BatchNorm) has no CSR values to
    multiply into up-sweep products: ``levels="auto"`` becomes the linear scan; a deeper forced
    depth is refused, naming the layer."""
    coupled = [u for u in units if not u.has_csr_values]
    if not coupled:
        return kwargs
    levels = kwargs.get("levels", "auto")
    if levels == "auto":
        return {**kwargs, "levels": 0}
    if levels != 0:
        u = coupled[0]
        raise ValueError(f"layer {u.index} ({u.name}): {u.operator_only_because}, so it runs as a structured "
                         f"operator only; levels={levels!r} would multiply it into up-sweep products: use levels=0 "
                         "or 'auto'" + (", or model.eval()" if u.capabilities.mode_dependent else ""))
    return kwargs


NORM_FORMS = ("auto", "dense", "factored")



def plan_chain(units: Sequence[LayerUnit], norm_form: str = "auto", operators: bool = True,
               **kwargs: Any) -> tuple[Any, list[bool], Any]:
    """The core plan of a chain of layer units, per layer whether it is factored, and the normalization-form
    :class:`~spscan.planner.choose.Decision` (``None`` when no layer has factors).

    A layer whose ``J^T`` is a block-diagonal of diagonal-plus-low-rank blocks
    (:class:`~spscan.layers.LowRankFactors`: LayerNorm, GroupNorm, Softmax, LogSoftmax) enters the
    chain either as its dense blocks (one element) or as its two factors ``L R`` (two elements,
    ``(1 + r) N`` entries per group each instead of ``N^2``). ``norm_form``:

    * ``"dense"``: the blocks (at depth 0 the wrapper applies the layer's own backward kernel and
      never forms them).
    * ``"factored"``: the factors, at any depth.
    * ``"auto"``: the planner's choice. At depth 0 nothing is multiplied, so the dense form (applied
      as the layer's kernel) is kept. Where the plan multiplies matrices (a depth ``K >= 1``, forced
      or chosen by ``levels="auto"``), both chains are planned and the one with the lower estimated
      critical-path time is kept (the factors must win by the profile's ``factored_margin``,
      :class:`~spscan.planner.cost.DeviceProfile`): the factors win
      where the blocks would fill the neighbours' products (a conv next to a GroupNorm), the blocks
      where the products are dense anyway (a Linear next to a LayerNorm over its whole output) and
      one element fewer is cheaper. Where a layer's blocks exceed the profile's ``dense_block_limit``
      entries per sample, only the factored chain is planned; if its best depth is 0, the linear
      scan with the layers' kernels is planned instead.

    ``kwargs`` go to :func:`spscan.runtime.plan.build_plan` (``levels``, ``backend``, ...).
    """
    if norm_form not in NORM_FORMS:
        raise ValueError(f"norm_form: expected one of {NORM_FORMS}, got {norm_form!r}")
    can = [u.capabilities.low_rank_factors and u.has_csr_values for u in units]
    dense = [False] * len(units)
    prof = plan_profile(kwargs.get("device"), kwargs.get("backend", "auto"))
    margin, limit = prof.factored_margin, prof.dense_block_limit

    def core_of(flags: Sequence[bool], **over: Any):
        pats = [p for u, f in zip(units, flags) for p in (u.factor_patterns() if f else (u.pattern,))]
        # what the wrapper applies by a layer's own operator (as ModelPlan.operator_flags) is priced by its work
        work = [e for u, f in zip(units, flags) for e in ((None, None) if f else (
            u.cost_entries if (operators and u.has_operator) or not u.has_csr_values else None,))]
        return build_plan(pats, bind=None, apply_entries=work, **{**kwargs, **over})

    def decided(core, flags, why: str, rivals: Sequence[tuple[str, Any]] = ()):
        """``(core, flags, the norm-form decision)``: the chain kept, and the rivals costed against it."""
        name = "factored" if any(flags) else "dense"
        best = core.candidates.get(core.levels)
        cands = [Candidate(name, best, why)]
        for other, plan in rivals:
            t = plan.candidates.get(plan.levels)
            factor = margin if other == "factored" else 1.0
            cands.append(Candidate(other, None if t is None else t * factor,
                                   f"depth {plan.levels}" + (f", estimate x {margin:g} (must win by it)"
                                                             if factor != 1.0 else "")))
        forced = name if norm_form != "auto" else None
        return core, flags, choose("normalization form", cands, forced,
                                   basis=f"{prof.name} critical-path model of each chain",
                                   notes=(f"factors must win by {margin:g}x; dense blocks <= {limit} entries per "
                                          "sample",))

    if not any(can):
        return core_of(dense), dense, None
    if norm_form == "dense":
        return decided(core_of(dense), dense, "as asked")
    if norm_form == "factored":
        return decided(core_of(can), can, "as asked")
    levels = kwargs.get("levels", "auto")
    if levels == 0:
        return decided(core_of(dense), dense, "depth 0: each layer's own backward kernel, nothing multiplied")
    if any(c and u.nnz > limit for u, c in zip(units, can)):
        other = core_of(can)
        if other.levels == 0:  # the linear scan: each layer's own kernel (faster than the factors' SpMVs)
            return decided(core_of(dense, levels=0), dense, "the factored chain's best depth is 0: kernels instead",
                           [("factored", other)])
        return decided(other, can, f"dense blocks exceed {limit} entries")
    plain = core_of(dense)
    if plain.levels == 0 and levels == "auto":
        return decided(plain, dense, "depth 0 chosen: each layer's kernel, no products to fill")
    other = core_of(can)
    if other.levels == 0:
        return decided(plain, dense, "the factored chain's best depth is 0: kernels are faster", [("factored", other)])
    t_plain, t_other = plain.candidates.get(plain.levels), other.candidates.get(other.levels)
    if t_plain is not None and t_other is not None and t_other * margin < t_plain:
        return decided(other, can, f"depth {other.levels}", [("dense", plain)])
    return decided(plain, dense, f"depth {plain.levels}", [("factored", other)])


def plan_model(model: nn.Module, example_input: torch.Tensor, *, prune_zeros: bool = False,
               operators: bool = True, **kwargs: Any) -> ModelPlan:
    """Plan an ``nn.Sequential`` chain (nested Sequentials are flattened) for scan backprop.

    Args:
        model: a plain ``nn.Sequential`` of supported layers (see
            :func:`spscan.layers.supported_layer_types`), or one supported layer.
        example_input: ``(B, *in_shape)``; only its per-sample shape (and dtype) matter — every
            later input must have the same per-sample shape.
        prune_zeros: also leave exactly-zero weights of Linear/Conv layers out of the patterns
            (they must stay zero while the plan is used).
        operators: in the wrapper's backward, layers that have a structured operator (conv,
            linear, activations, max-pool, batch-norm, reshapes, dropout) apply ``J^T`` directly
            instead of forming CSR values, wherever the scan only multiplies them by vectors.
        norm_form: ``"auto"`` (default), ``"dense"`` or ``"factored"``: how LayerNorm, GroupNorm,
            Softmax and LogSoftmax enter up-sweep products (see :func:`plan_chain`).
        **kwargs: passed to ``spscan.plan(patterns, **kwargs)`` (``levels``, ``backend``, ...).

    Raises:
        TypeError: a layer type without a unit (names the first one: index, name, type), or a
            model that is not a chain.
        ValueError: the example input does not fit a layer (names the layer and the shapes).
    """
    if isinstance(model, nn.Module) and not _plain_containers(model):
        raise NotPlannable(f"{type(model).__name__}: spscan.chain.model plans nn.Sequential chains of supported layers (or "
                        "one layer); a model with its own forward is traced with torch.fx by spscan.graph.plan: use "
                        "spscan.plan(model, example_input) or spscan.wrap(model, example_input)")
    chain = _flatten_chain(model)
    if not chain:
        raise ValueError("model: expected at least one layer, got an empty nn.Sequential")
    supported = supported_layer_types()
    for k, (name, m) in enumerate(chain):
        if type(m) not in supported:
            kind = "a container with its own forward" if list(m.children()) else "an unsupported layer type"
            raise NotPlannable(f"layer {k} ({name or '-'}): {type(m).__module__}.{type(m).__name__} is {kind}; "
                            f"supported: {', '.join(t.__name__ for t in supported)} (spscan.plan and spscan.wrap "
                            "trace such a chain with torch.fx and run that layer as its own autograd backward)")
        check_hooks(k, name, m)
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise ValueError("example_input: expected a tensor (B, *in_shape) with a batch dimension, got "
                         f"{getattr(example_input, 'shape', type(example_input).__name__)}")
    x = example_input.detach()[:1]
    in_shape0 = tuple(x.shape[1:])
    units: list[LayerUnit] = []
    with torch.no_grad():
        for k, (name, m) in enumerate(chain):
            in_shape = tuple(x.shape[1:])
            if unit_capabilities(m).shape_preserving:
                y = x  # no call: dropout would draw random numbers, train-mode BN would update stats
            else:
                try:
                    y = m(x)
                except Exception as e:  # the layer's own message says what it expected
                    raise ValueError(f"layer {k} ({name or '-'}: {type(m).__name__}): "
                                     + example_rejected(k, in_shape, e)) from e
                if not isinstance(y, torch.Tensor):
                    raise UnitRefused(f"layer {k} ({name or '-'}: {type(m).__name__}): returns {type(y).__name__}; "
                                     "expected one tensor (a chain passes one tensor on; e.g. return_indices=False)")
            try:
                units.append(make_unit(k, m, in_shape, tuple(y.shape[1:]), prune_zeros=prune_zeros))
            except (TypeError, ValueError) as e:
                if y is x:  # not called (shape-preserving): the input may well be what is wrong
                    raise
                raise UnitRefused(str(e)) from e  # the layer ran: its configuration is what the unit lacks
            x = y
    kwargs = levels_for_coupled_layers(units, kwargs)
    core, factored, norm = plan_chain(units, operators=operators, **kwargs)
    plan = ModelPlan(model, units, [n for n, _ in chain], in_shape0, core, operators=operators, factored=factored)
    plan.decisions = [d for d in (norm,) if d is not None]
    plan.bind_signatures()
    return plan
