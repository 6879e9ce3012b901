"""The module wrapper of a planned model (:class:`SpscanModule`): the model's own forward, its backward the
scan's (or autograd's, as the wrapper's choice says); a plan per per-sample shape and mode, made again
on first use (:class:`Replan`). :func:`wrap_chain` wraps an ``nn.Sequential`` chain; a traced model's
wrapper (:class:`spscan.graph.plan.GraphSpscanModule`) is this one with a traced plan.
"""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional

import torch
import torch.nn as nn

from spscan.errors import NotPlannable
from spscan.options import option_default
from spscan.planner.choose import Decision
from spscan.runtime.autograd import PartsRead, gated, refuse_functorch
from spscan.runtime.checks import buffers_kept
from spscan.runtime.choices import BackwardChoice, batch_of, layers_decision
from spscan.chain.model import LayerReplaced, ModelPlan, global_hooks, has_hooks
from spscan.layers.opaque import OpaqueUnit
from spscan.chain.planning import plan_model

__all__ = ["MAX_SHAPE_PLANS", "PLAIN_ARGUMENT_TYPES", "Replan", "SpscanModule", "model_device", "model_dtype",
           "wrap_chain"]


def model_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype of ``model``'s first floating parameter (else buffer); ``None`` for a model without one."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def model_device(model: nn.Module) -> Optional[torch.device]:
    """Where ``model``'s parameters (else buffers) live; ``None`` for a model without either."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


#: the kinds of value a traced forward's optional arguments are planned at (:attr:`ModelPlan.fixed_arguments`:
#: fx specializes the graph to them); a call passes the planned value where it is that value or equal to it
PLAIN_ARGUMENT_TYPES = (type(None), bool, int, float, str)
_NOT_PLANNED = object()  # an argument the plan has no value for (SpscanModule._unplanned_argument)
#: how many plans a wrapper keeps for the per-sample shapes (and modes) it was called with (SpscanModule._plan_for)
MAX_SHAPE_PLANS = 8
_MISSING = object()


def _plain(v: Any) -> bool:
    return type(v) in PLAIN_ARGUMENT_TYPES or (type(v) is tuple and all(type(e) in PLAIN_ARGUMENT_TYPES for e in v))


def _held(parent: nn.Module, name: str) -> tuple:
    """The container ``parent`` holds as ``name`` (``parent`` itself for ``""``), as ``(its id, its modules'
    names)``."""
    c = parent._modules.get(name) if name else parent
    return (id(c), tuple(c._modules) if c is not None else ())


class PythonState:
    """The plain Python attributes (None, bools, numbers, strings, tuples of them: ``self.tau``, ``self.use_skip``,
    ``stride``) of the modules a plan was made from, read as they are now (:meth:`now`).

    Tracing bakes them into the graph (``x / self.tau`` is ``x / 0.5``) and units read them when they are made,
    so a plan is valid for the values it was made with: the wrapper keeps its plans under them, and a model
    whose attribute changed after planning (a temperature annealed, a flag toggled) is planned again, as for a
    new input shape. Read are the modules whose Python forward is traced: the user's and libraries' own, not
    torch's layers (their attributes are their constructor's arguments; a unit reads what it follows, such as
    dropout's ``p``, when it runs), which keeps the per-step read small (ResNet-18: the blocks' few attributes).
    A module that runs as its own call (an opaque node) reads its attributes itself: its subtree is left out
    (its forward may change them on every call, as a counter would). So are the names of the modules in each
    container (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``: a forward looping over one is traced with
    the modules it held, and a layer appended after wrapping must be planned). Where the traced forward read a
    tensor's dtype as a value (:attr:`ModelPlan.reads_dtype`), the parameters' dtype is read too (last)."""

    def __init__(self, model: nn.Module, plan: ModelPlan) -> None:
        own = {id(u.module) for u in plan.units if isinstance(u, OpaqueUnit)}
        self.model, self.reads_dtype = model, bool(getattr(plan, "reads_dtype", False))
        self.slots: list[tuple[str, nn.Module, tuple[str, ...]]] = []
        # each container as its parent holds it (``self.layers = nn.ModuleList(...)`` assigned anew is seen)
        self.containers: list[tuple[str, nn.Module, str]] = []
        skip: list[str] = []
        for path, m in model.named_modules():
            if any(path == q or path.startswith(q + ".") for q in skip):
                continue
            if id(m) in own:
                skip.append(path)
                continue
            if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                parent, _, name = path.rpartition(".")
                self.containers.append((path, model.get_submodule(parent), name) if path else (path, model, ""))
            if type(m).__module__.startswith("torch.") and m is not model:
                continue
            names = tuple(k for k, v in vars(m).items() if not k.startswith("_") and k != "training" and _plain(v))
            if names:
                self.slots.append((path, m, names))

    def now(self) -> tuple:
        values = tuple(m.__dict__.get(n, _MISSING) for _, m, names in self.slots for n in names)
        values += tuple(_held(parent, name) for _, parent, name in self.containers)
        return values + (model_dtype(self.model),) if self.reads_dtype else values

    def changed(self, before: tuple, after: tuple) -> str:
        """``module.name: old -> new`` of the first attribute that differs between two :meth:`now` values."""
        it = iter(zip(before, after))
        for path, m, names in self.slots:
            for n in names:
                a, b = next(it)
                if a != b or type(a) is not type(b):
                    where = f"{path}.{n}" if path else n
                    return f"{where}: {a!r} -> {b!r}"
        for path, _, _ in self.containers:
            a, b = next(it)
            if a != b:
                if a[1] == b[1]:
                    return f"{path or 'the model'}: another container assigned"
                return (f"the modules of {path or 'the model'}: {len(a[1])} ({', '.join(a[1])}) -> {len(b[1])} "
                        f"({', '.join(b[1])})")
        if self.reads_dtype and before[-1] != after[-1]:
            return f"the parameters' dtype (read as a value in the forward): {before[-1]} -> {after[-1]}"
        return ""


class SpscanModule(BackwardChoice, nn.Module):
    """``model`` with the same forward, whose backward runs through the scan.

    Holds ``model`` as a submodule, so ``parameters()`` yields the model's own parameter objects
    and optimizers work unchanged. Input ``(B, *in_shape)``, output ``(B, *out_shape)``.
    ``backward``: ``"auto"`` (the planner chooses, per batch size, the scan, the model's own
    autograd backward or, on a GPU, the scan's whole step from CUDA graphs: :attr:`decision`,
    :meth:`explain`), ``"scan"``, ``"native"`` or ``"graph"``. With gradients off, or nothing that needs
    one, a call runs the model's own forward; under ``torch.autocast`` see
    :meth:`~spscan.runtime.choices.BackwardChoice._call_choice`. A traced model whose forward takes optional
    arguments (``forward(x, mask=None)``) is planned with their defaults; see :meth:`forward`.
    """

    def __init__(self, model: nn.Module, plan: ModelPlan, backward: str = "auto", batch: Optional[int] = None,
                 device: Optional[torch.device] = None, replan: Optional["Replan"] = None):
        super().__init__()
        self.model = model
        self.plan = plan
        self._replan = replan
        self._python = PythonState(model, plan)
        self._state = self._python.now()  # the attributes the present plan was made with
        self._warned_state = False
        self._unplannable: Optional[str] = None  # the model, changed after wrapping, can no longer be planned
        # the plans made for other per-sample shapes and, for a traced model, the other mode: (mode, shape) -> plan,
        # the most recently used last (_plan_for); None for a shape the scan cannot plan (backward="auto": native)
        self._plans: "OrderedDict[tuple, Optional[ModelPlan]]" = OrderedDict({self._plan_key(plan): plan})
        # where the steps run, for the choice: the plan's device, else the model's, else the example input's
        self._example_device = device
        self._init_choice(backward, None if batch is None else (tuple(plan.in_shape), int(batch)))

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """The model's call on ``x``, its backward as :attr:`decision` says. Further arguments are those of the
        model's own forward: where they are the values the graph was planned with (its defaults,
        :attr:`ModelPlan.fixed_arguments`) the call is planned as any other; other values (a mask where the
        default is None) change the graph, so with ``backward="auto"`` that call runs the model's own forward
        and backward, and with a forced ``scan`` or ``graph`` it is refused (TypeError). An input of another
        per-sample shape than the example's (an image of another size, a sequence of another length) is planned
        for its shape on first use (:meth:`_plan_for`)."""
        slot = self.plan.state
        if slot is not None:  # state arguments (``forward(input, hidden)``), read from the plan's slot
            return self._with_state(slot, x, args, kwargs)
        if args or kwargs:
            try:
                other = self._unplanned_argument(x, args, kwargs)
            except TypeError:  # arguments the model's forward does not take: its own error
                return self.model(x, *args, **kwargs)
            if other is not None:
                if self.backward_mode not in ("auto", "native") and torch.is_grad_enabled():
                    raise TypeError(f"{type(self).__name__} with backward={self.backward_mode!r}: the scan runs the "
                                    f"graph of {type(self.model).__name__} traced with "
                                    f"{self._planned_arguments() or 'no arguments'} besides the input; "
                                    f"this call passes {other}, which changes it (backward='auto' runs such a call "
                                    "through the model's own backward)")
                return self.model(x, *args, **kwargs)
        return super().forward(x)

    def _with_state(self, slot: Any, x: Any, args: tuple, kwargs: dict) -> Any:
        """The call of a model planned with state arguments (:mod:`spscan.graph.state`): the state the next step
        reads is ``args``, where they are of the example's structure, per-sample shapes, dtypes and device, of the
        input's batch and without gradients; else, with ``backward="auto"``, the model's own forward and backward
        (a forced scan refuses them: TypeError)."""
        if not isinstance(x, torch.Tensor):
            return self.model(x, *args, **kwargs)
        try:
            bound = inspect.signature(self.model.forward).bind(x, *args, **kwargs)
        except TypeError:  # arguments the model's forward does not take (the state left out): its own error
            return self.model(x, *args, **kwargs)
        state = bound.args[1:]  # the state passed by keyword too (``attention_mask=m``), in the forward's order
        why = f"keyword arguments ({', '.join(bound.kwargs)})" if bound.kwargs else slot.mismatch(x, state)
        if why is None:
            slot.set(state)
            return super().forward(x, *state)
        if self.backward_mode not in ("auto", "native") and torch.is_grad_enabled():
            raise TypeError(f"{type(self).__name__} with backward={self.backward_mode!r}: {type(self.model).__name__}"
                            f" was planned with state arguments like the example's; this call passes {why} "
                            "(backward='auto' runs such a call through the model's own backward)")
        return self.model(x, *args, **kwargs)

    def _unplanned_argument(self, x: Any, args: tuple, kwargs: dict) -> Optional[str]:
        """``name=value`` of the first argument besides ``x`` that is not the value the graph was planned with
        (None: every one is); TypeError where the model's forward does not take them."""
        fixed = self.plan.fixed_arguments
        bound = inspect.signature(self.model.forward).bind(x, *args, **kwargs)
        for name, value in list(bound.arguments.items())[1:]:
            planned = fixed.get(name, _NOT_PLANNED)
            if not (value is planned or (type(value) is type(planned) and type(value) in PLAIN_ARGUMENT_TYPES
                                         and value == planned)):
                shown = f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
                return f"{name}={shown}"
        return None

    def _planned_arguments(self) -> str:
        """``name=value, ...`` of :attr:`ModelPlan.fixed_arguments` ('' for none)."""
        return ", ".join(f"{k}={v!r}" for k, v in self.plan.fixed_arguments.items())

    def _call_choice(self, key: Optional[Hashable], x: Any) -> str:
        """As :meth:`BackwardChoice._call_choice`, and with ``backward="auto"`` an input of a per-sample shape the
        scan cannot plan runs the model's own step (``"native"``)."""
        if self._forward_alone():  # nothing is recorded (an evaluation under no_grad): nothing to plan for
            return "native"
        if self.backward_mode == "auto" and (self._unplannable is not None or self._unplanned_hooks() is not None):
            return "native"
        if key is not None and self.backward_mode == "auto":
            plan = self._plan_for(key[0], x)
            if plan is None or (key[1] == 1 and plan.squeezes_batch):
                return "native"
        return super()._call_choice(key, x)

    def _unplanned_hooks(self) -> Optional[str]:
        """What hooks the scan would not run (None: none): hooks on the model itself or registered for every
        module (``register_module_forward_hook``), registered after planning; the scan calls no module."""
        if global_hooks():
            return "hooks registered for every module (torch.nn.modules.module.register_module_*_hook)"
        if has_hooks(self.model):
            return f"hooks on {type(self.model).__name__} itself, registered after planning"
        return None

    def _backward_decision(self, key) -> Decision:
        shape, batch = key
        plan = self._plan_for(shape)
        detail = f"{plan.element_name}s: {len(plan)}, depth {plan.levels}"
        if len(self._plans) > 1:
            detail += f", input (B, {', '.join(map(str, shape))})"
        device = plan.core.device or model_device(self.model) or self._example_device
        notes: tuple[str, ...] = ()
        if self._replan is not None:
            notes = (f"an input of another per-sample shape is planned for its shape on first use (the last "
                     f"{MAX_SHAPE_PLANS} kept)",)
        if self.backward_mode == "auto" and plan.fixed_arguments:
            notes += (f"planned with {self._planned_arguments()}; a call with other values: native",)
        return layers_decision(plan.units, batch, device, self.backward_mode, detail, notes=notes)

    def _signature(self, x: Any) -> Optional[tuple[tuple[int, ...], int]]:
        """``(per-sample shape, batch size)``: each per-sample shape has its plan, each batch size its decision."""
        x = self.plan.batch_first(x)
        b = batch_of(x)
        return None if b is None else (tuple(x.shape[1:]), b)

    def _forward_alone(self) -> bool:
        return not torch.is_grad_enabled()  # nothing is recorded: the model's own forward

    def _scan_dtype(self) -> Optional[torch.dtype]:
        return model_dtype(self.model)

    @torch.compiler.disable  # under torch.compile the scan's step runs as it is (a graph break), not traced
    def _scan_step(self, key: Optional[int], choice: str, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        refuse_functorch()
        hooks = self._unplanned_hooks()
        if hooks is not None:
            raise ValueError(f"{type(self).__name__} with backward={self.backward_mode!r}: {hooks}: the scan does not "
                             "call the modules, so they would not run (backward='auto' runs the model's own step)")
        if self._replan is not None and key is not None:
            self._plan_for(key[0], x)
        if key is not None and key[1] == 1 and self.plan.squeezes_batch:
            raise ValueError(f"{type(self.model).__name__}'s forward squeezes a tensor of the batch where it may drop "
                             "the batch dim (squeeze() without a dim, or of dim 0): at batch 1 it does, and "
                             f"{type(self).__name__} with backward={self.backward_mode!r} keeps it (backward='auto' "
                             "runs such a call through the model's own step)")
        own, x = x, self.plan.batch_first(x)  # the model's input, and as the plan runs it
        try:
            flat = self._step_tensors(x)
        except LayerReplaced as e:  # ``model.fc = nn.Linear(...)`` after wrapping: planned again, as it is now
            if self._replan is None:
                raise
            try:
                self._layers_replaced(e, own)
            except NotPlannable as why:  # the model as it is now is not plannable: autograd's own steps
                if self.backward_mode != "auto":
                    raise
                self._unplannable = str(why).splitlines()[0]
                warnings.warn(f"spscan: {self._unplannable}: {type(self.model).__name__} runs autograd's own "
                              "steps from now on (backward='native')", stacklevel=4)
                return self.model(own, *rest)
            x = self.plan.batch_first(own)  # the new layers may read the input in another layout
            flat = self._step_tensors(x)
        if x.shape[0] == 0 or not (x.requires_grad or any(t.requires_grad for t in flat)):
            # an empty batch (nothing to scan), or nothing that needs a gradient: plain torch
            return self.model(own, *rest)
        self._warn_opaque()  # a forced scan whose plan has nodes that run autograd's own backward: once
        if self.plan.stopped_roles:  # parameters only gradient stops lead from: None, as autograd leaves them
            flat = [t.detach() if i in self.plan.stopped_roles else t for i, t in enumerate(flat)]
        y_in = x.detach() if self.plan.input_stopped else x
        record = None
        if self.plan.part_gates:  # parameters only some parts of the result depend on
            record = PartsRead()
            flat = gated(flat, self.plan.part_gates, record)
        y = self.plan.run_step(y_in, flat, choice == "graph")
        self._after_step(key, choice)
        tail = self.plan.output_tail
        return y if tail is None else tail(y, x, record)

    def _layers_replaced(self, e: LayerReplaced, own: torch.Tensor) -> None:
        """Plan the model again as it is now for the input ``own`` (in the model's layout), every plan made before
        dropped (they run modules it no longer has), and the decisions with them; warn."""
        what = str(e).splitlines()[0].split("; wrap")[0]
        warnings.warn(f"spscan: {what}: {type(self.model).__name__} is planned again (new parameters "
                      "are not in an optimizer made before: add them, as without spscan)", stacklevel=4)
        for old in self._plans.values():
            if old is not None:
                old.release_buffers()
        self._plans.clear()
        self.plan = self._replan.for_input(self.model, own)
        self._python = PythonState(self.model, self.plan)
        self._state = self._python.now()
        self._plans[self._plan_key(self.plan)] = self.plan
        self._decisions.clear()

    def _plan_key(self, plan: ModelPlan, shape: Optional[tuple] = None) -> tuple:
        """What a plan is kept under: the mode a traced plan was specialized to (None for a chain, whose units
        follow their modules' modes), the per-sample input shape and the modules' plain attributes
        (:class:`PythonState`) it was made with."""
        return (plan.planned_training, tuple(plan.in_shape) if shape is None else tuple(shape), self._state)

    def _plan_for(self, shape: tuple, x: Optional[torch.Tensor] = None) -> Optional[ModelPlan]:
        """Make :attr:`plan` the one that runs an input of per-sample ``shape`` in the model's present mode, and
        return it (None: the scan cannot plan that shape, and ``backward="auto"`` runs the model's own step).
        A plan made here is made from the call's input ``x`` where given (a forward that indexes with its
        input's values, ``out.gather(1, lengths - 1)``, runs on it as on any batch of the user's).

        * Each per-sample shape has its plan (an image of another size, a sequence of another length: a recurrent
          layer inside the model is planned for that length), made on first use from a zero example of that shape;
          the last :data:`MAX_SHAPE_PLANS` are kept, the oldest one's buffers freed.
        * A traced plan is specialized to the mode it was traced in (``self.training`` read in Python): in the
          other mode (the model's ``training`` flag) the plan traced in that mode runs, made on first use; both
          are kept, as training and evaluation alternate.
        * A plan made in eval mode at a depth a train-mode BatchNorm cannot run at (levels ``"auto"``) is made
          again as the model now is, once (the linear scan, which runs in either mode).
        """
        plan, mode, shape, state = self.plan, self.model.training, tuple(shape), self._python.now()
        if plan.in_shape == shape and plan.planned_training in (None, mode) and state == self._state:
            if self._replan is not None and self._replan.levels == "auto" and plan.needs_linear_scan():
                self.plan = self._replan(self.model, shape, x)
                self._plans[self._plan_key(plan)] = self.plan
                plan.release_buffers()
            return self.plan
        if state != self._state:
            what = self._python.changed(self._state, state)
            if self._replan is None:
                raise ValueError(f"{what}: an attribute of the model changed after it was planned, and this plan "
                                 "cannot be made again; wrap the model again")
            if not self._warned_state:
                self._warned_state = True
                warnings.warn(f"spscan: {what} changed after {type(self.model).__name__} was planned: the graph "
                              "is planned again for the new value, as for a new input shape (tracing bakes "
                              "Python values into it; one that changes every step makes every step plan again: "
                              "keep such a value in a tensor, a buffer)", stacklevel=4)
        if self._replan is None:  # planned directly (no way to plan another shape): the contract's own check
            return plan
        key = (None if plan.planned_training is None else mode, shape, state)
        if key not in self._plans:
            try:
                self._plans[key] = self._replan(self.model, shape, x)
            except NotPlannable:
                if self.backward_mode != "auto":
                    raise
                self._plans[key] = None  # the model's own step for this shape
            except ValueError as e:  # the model rejects that shape (its own error, as planning words it)
                raise ValueError(f"input: per-sample shape {shape}, planned on first use (the example's was "
                                 f"{tuple(plan.in_shape)}): {e}") from e
            while len(self._plans) > MAX_SHAPE_PLANS:
                _, old = self._plans.popitem(last=False)
                if old is not None and old is not plan:
                    old.release_buffers()
        self._plans.move_to_end(key)
        got = self._plans[key]
        if got is not None:
            self.plan, self._state = got, state
        return got

    def _step_tensors(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.plan.step_tensors(x)


class Replan:
    """How a wrapper's plan is made again (:meth:`SpscanModule._scan_step`): the planning function, the
    example input's shape and dtype (a zero batch of them stands in, on the model's device) and the options."""

    def __init__(self, plan_fn: Callable[..., ModelPlan], example_input: torch.Tensor, options: dict,
                 batch_dim: int = 0) -> None:
        self.plan_fn, self.options, self.batch_dim = plan_fn, dict(options), batch_dim
        self.shape, self.dtype = tuple(example_input.shape), example_input.dtype

    @property
    def levels(self) -> Any:
        return self.options.get("levels", "auto")

    def for_input(self, model: nn.Module, x: torch.Tensor) -> ModelPlan:
        """A plan of ``model`` as it is now for an input like ``x`` (its layers replaced: it may take its batch
        on another dim than before); later plans take their example in that layout."""
        dtype = (model_dtype(model) or x.dtype) if x.is_floating_point() else x.dtype
        with buffers_kept(model):  # planning runs layers (a spectral norm's power iteration updates its buffers)
            plan = self.plan_fn(model, torch.zeros(x.shape, dtype=dtype, device=x.device), **self.options)
        self.shape, self.dtype, self.batch_dim = tuple(x.shape), x.dtype, plan.input_batch_dim
        return plan

    def __call__(self, model: nn.Module, per_sample: Optional[tuple] = None,
                 example: Optional[torch.Tensor] = None) -> ModelPlan:
        """A plan of ``model`` as it is now, for the example's per-sample shape or ``per_sample``: from
        ``example`` (the caller's input of that per-sample shape, in the model's layout) where given, else from
        a zero batch of the example's size."""
        d = self.batch_dim  # the example's batch, on the dim the model reads it from (``per_sample`` without it)
        if per_sample is None:
            shape = self.shape
        else:
            shape = tuple(per_sample)[:d] + self.shape[d:d + 1] + tuple(per_sample)[d:]
        # a floating example in the model's dtype now (converted since it was wrapped: ``model.double()``)
        dtype = (model_dtype(model) or self.dtype) if self.dtype.is_floating_point else self.dtype
        if isinstance(example, torch.Tensor) and example.dim() == len(shape) and example.dtype == self.dtype \
                and example.shape[:d] + example.shape[d + 1:] == tuple(shape[:d]) + tuple(shape[d + 1:]):
            x = example.detach().to(dtype)
        else:
            x = torch.zeros(shape, dtype=dtype, device=model_device(model) or torch.device("cpu"))
        with buffers_kept(model):
            return self.plan_fn(model, x, **self.options)


def wrap_chain(model: nn.Module, example_input: torch.Tensor, *, replan_fn: Optional[Callable[..., ModelPlan]] = None,
               **plan_kwargs: Any) -> SpscanModule:
    """An ``nn.Module`` equal to ``model`` in forward whose backward is the scan.

    ``loss.backward()`` fills ``x.grad`` and every parameter's ``.grad`` (not those with
    ``requires_grad=False``) as autograd would. ``plan_kwargs`` go to :func:`plan_model`; ``replan_fn`` plans
    the model again where it changed after wrapping (default :func:`plan_model`).
    """
    backward = plan_kwargs.pop("backward", option_default("backward"))
    replan_fn = plan_model if replan_fn is None else replan_fn
    with buffers_kept(model):
        plan = plan_model(model, example_input, **plan_kwargs)
    return SpscanModule(model, plan, backward, example_input.shape[0], example_input.device,
                        Replan(replan_fn, example_input, plan_kwargs))
