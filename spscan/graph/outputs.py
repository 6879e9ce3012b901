"""What a traced forward returns, made from the scan's output: the graph tensor the scan's chain ends in, and
the tail that rebuilds the forward's result from it (tuples, dicts, ``None``s, tensors that do not keep the
batch first, several tensors at once).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.fx as fx

from spscan.graph.nodes import node_text, refuse_node
from spscan.layers.registry import JOIN_CAT as _CAT, NODE_UNITS
from spscan.runtime.autograd import PartsRead, split_parts

__all__ = ["OutputTail", "chain_end", "part_gates", "rebuilt", "stopped"]


def stopped(traced: Any, units: list, role_slices: list) -> tuple[frozenset, bool]:
    """The flat indices of the units' tensors every path of whose to the result passes through a gradient stop
    (a constant of the step: ``.detach()``, a value made under ``torch.no_grad()``; an opaque node's read of a
    tensor it passes no gradient to, as ``torch.where(a > 0, ...)`` reads ``a``), and whether the input's do:
    autograd leaves their gradient None, which the wrapper gets by handing them to the scan detached."""
    live, todo = set(), [traced.output_node]
    while todo:
        n = todo.pop()
        if n in live:
            continue
        live.add(n)
        if n not in traced.constants:
            dead = traced.dead_edges.get(n, ())
            todo.extend(t for t in traced.tin.get(n, ()) if t not in dead)
    index = {id(u): k for k, u in enumerate(units)}
    out = set()
    for n, leaf in traced.leaf_of.items():
        k = index.get(id(leaf.unit))
        if k is not None and n not in live:
            out.update(range(role_slices[k].start, role_slices[k].stop))
    return frozenset(out), traced.input_node not in live


def part_gates(traced: Any, units: list, role_slices: list) -> dict:
    """For a packed result: ``{flat index: parts}`` for each of the units' tensors that reaches some but not
    all of the result's parts (the others are never gated: a step whose loss reads no part has no backward)."""
    tail = traced.output_tail
    if tail is None or not tail.packed:
        return {}
    index = {id(u): k for k, u in enumerate(units)}
    reach: dict[int, set] = {}
    for j, source in enumerate(tail.sources):
        todo, seen = [source], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            leaf = traced.leaf_of.get(n)
            if leaf is not None and id(leaf.unit) in index:
                reach.setdefault(index[id(leaf.unit)], set()).add(j)
            todo.extend(traced.tin.get(n, ()))
    every = set(range(len(tail.sources)))
    gates = {}
    for k, parts in reach.items():
        if parts != every:
            for i in range(role_slices[k].start, role_slices[k].stop):
                gates[i] = frozenset(parts)
    return gates


class OutputTail:
    """The forward's result from the scan's output (see :func:`chain_end`): ``tail(y)``."""

    def __init__(self, structure: Any, sources: list, sizes: list, shapes: list, evaluators: dict, packed: bool,
                 reads: dict, input_node: Optional[fx.Node] = None, constants: frozenset = frozenset()) -> None:
        self.structure, self.sources, self.sizes, self.shapes = structure, sources, sizes, shapes
        self.evaluators, self.packed, self.reads = evaluators, packed, reads
        self.input_node = input_node  # the graph's input, where the result reads it besides the scan's output
        self.constants = constants  # sources that carry no gradient (a ``.detach()``-ed result): returned detached

    def __call__(self, y: torch.Tensor, x: Optional[torch.Tensor] = None, record: Optional[PartsRead] = None) -> Any:
        """The forward's result from the scan's output ``y`` and the step's input ``x`` (batch first, as the graph
        takes it: a result may read it, as a loss reads its targets from the token ids). ``record``: where the
        backward notes which parts the loss read (:func:`~spscan.runtime.autograd.split_parts`, for
        :func:`~spscan.runtime.autograd.gated`)."""
        b = y.shape[0]
        if self.packed and record is not None:
            parts = [p.reshape((b,) + s) for p, s in zip(split_parts(record, y, list(self.sizes)), self.shapes)]
        elif self.packed:
            # contiguous, as each was in the model (a .view() of it in the forward needs that)
            parts = [p.reshape((b,) + s).contiguous() for p, s in zip(y.split(self.sizes, 1), self.shapes)]
        else:
            parts = [y]
        got = {n: p.detach() if n in self.constants else p for n, p in zip(self.sources, parts)}
        if self.input_node is not None:
            got[self.input_node] = x

        def value(n: fx.Node) -> Any:
            if n in got:
                return got[n]
            return self.evaluators[n](*[value(t) for t in self.reads[n]])

        return rebuilt(self.structure, value)


def rebuilt(a: Any, value: Any) -> Any:
    """``a`` (a traced output's structure) with each node replaced by ``value(node)``, in plain Python containers
    (fx keeps lists and dicts as immutable ones)."""
    if isinstance(a, fx.Node):
        return value(a)
    if isinstance(a, dict):
        return {k: rebuilt(v, value) for k, v in a.items()}
    if isinstance(a, tuple):
        items = [rebuilt(v, value) for v in a]
        return type(a)(*items) if hasattr(a, "_fields") else tuple(items)
    if isinstance(a, list):
        return [rebuilt(v, value) for v in a]
    return a


def chain_end(traced: Any, node: fx.Node) -> tuple[fx.Node, Optional[OutputTail]]:
    """What the scan's chain of ``traced`` (the :class:`~spscan.graph.trace.Traced` being built) ends in (one
    graph tensor) and how the forward's result is made from it (an :class:`OutputTail`, None where it is that
    tensor itself); ``node``: the graph's output node.

    The forward may return a structure (``logits, None``; ``logits, hidden``; a dict), tensors that do not
    keep the batch dim first (an RNN's ``h_n``, ``logits.view(-1, V)``), or numbers: the chain ends in the one
    graph tensor they are computed from, or in the concatenation of several (each flattened per sample),
    and the tail, run by the wrapper after the scan's step under autograd, rebuilds the result from it
    (the slices of that concatenation, then what the forward computed from them, recomputed). What the
    result reads of the input itself besides (a loss's targets taken from the token ids) the tail reads from the
    step's input."""
    res = node.args[0]
    if isinstance(res, fx.Node) and res in traced.kind:
        return res, None
    leaves: list[fx.Node] = []
    fx.node.map_arg(res, lambda n: leaves.append(n) or n)
    sources: list[fx.Node] = []
    for n in leaves:
        if n in traced.kind:
            sources.append(n)
        elif n in traced.virtual:
            sources += traced.virtual[n]
        elif isinstance(traced.env.get(n), torch.Tensor):
            raise refuse_node(n, "a tensor the forward returns that is not computed from the input (a constant "
                                 "of the step), which the scan's output does not carry")
    sources = list(dict.fromkeys(sources))
    if not sources:
        raise refuse_node(node, "the forward returns no tensor computed from the input")
    if traced.input_node in sources and len(sources) > 1:
        # the result reads the input itself besides what the scan computes (a loss's targets from the token ids,
        # a reconstruction loss against the input): the tail reads it from the step's input, not the scan's output
        sources.remove(traced.input_node)
        input_node: Optional[fx.Node] = traced.input_node
    else:
        input_node = None
    if sources == [traced.input_node]:
        if all(n is traced.input_node for n in leaves):
            raise refuse_node(node, "the forward's result is its input moved or copied by no layer (nothing to scan)")
        # computed from the input only by nodes whose results do not keep the batch first (a module returning a
        # tuple, ``nn.LSTMCell``'s ``(h, c)``): the whole forward would be one call of its own
        made = ", ".join(dict.fromkeys(node_text(n) for n in leaves if n is not traced.input_node))
        raise refuse_node(node, f"the forward's result ({made}) is made from the input by calls whose results do not "
                                "keep the batch dim first: the whole forward would be one call of its own, with "
                                "nothing to scan around it")
    if len(sources) == 1:
        end = sources[0]
    else:  # several: their concatenation, each flattened per sample (a join, as any cat of the graph)
        flats = []
        for n in sources:
            if traced.env[n].dim() == 2:
                flats.append(n)
                continue
            # each per sample as a row: flattened, or one number per sample (``y.sum(1)``) made a column
            op = torch.flatten if traced.env[n].dim() > 2 else torch.unsqueeze
            with traced.graph.inserting_before(node):
                f = traced.graph.call_function(op, (n, 1))
            f.meta = dict(n.meta)
            traced.env[f] = traced._unit(f, op, NODE_UNITS[op], (traced.env[n], 1), {}, [n], traced.env)
            flats.append(f)
        with traced.graph.inserting_before(node):
            end = traced.graph.call_function(torch.cat, (flats, 1))
        end.meta = dict(node.meta)
        traced.env[end] = traced._join(end, torch.cat, _CAT, ([traced.env[f] for f in flats], 1), {}, flats, traced.env)
    sizes = [int(np.prod(traced.env[n].shape[1:])) for n in sources]
    shapes = [tuple(traced.env[n].shape[1:]) for n in sources]
    evaluators = {n: traced._evaluator(n, traced.virtual[n])[0] for n in leaves if n in traced.virtual}
    reads = {n: traced.virtual[n] for n in evaluators}
    return end, OutputTail(res, sources, sizes, shapes, evaluators, len(sources) > 1, reads, input_node,
                           frozenset(n for n in sources if n in traced.constants))
