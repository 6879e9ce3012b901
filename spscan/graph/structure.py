"""The structure of a traced graph (:class:`~spscan.graph.trace.Traced`) as the scan runs it: a chain of
series-parallel blocks (:func:`series_parallel`), or, for any DAG, a chain over its live set
(:func:`live_steps`, within :data:`LIVE_STATE_LIMIT`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.fx as fx

from spscan.errors import NotPlannable
from spscan.graph.nodes import refuse_node
from spscan.graph.segments import LiveStep, Parallel
from spscan.layers.registry import JOIN_ADD as _ADD, JOIN_CAT as _CAT

__all__ = ["LIVE_STATE_LIMIT", "NotSeriesParallel", "live_steps", "series_parallel"]

#: A general DAG is refused when its live-set chain would carry more than this many times the values
#: of the graph's own tensors (``sum_s d_live(s) > LIVE_STATE_LIMIT * sum_n d_n``, per sample).
LIVE_STATE_LIMIT = 16


class NotSeriesParallel(NotPlannable):
    """The graph is not a chain of series-parallel blocks: it is planned as a live-set chain instead."""


def live_steps(traced: Any) -> list[Any]:
    """The graph as a chain over its live set (see :class:`LiveStep`), in fx's topological order.
    A node whose only input is the whole live set and is read by nothing else stays a plain unit
    (nodes the output does not depend on were left out when traced: :meth:`~spscan.graph.trace.Traced._drop_dead`).
    """
    nodes = [n for n in traced.graph.nodes if n in traced.kind]
    last = {p: i for i, n in enumerate(nodes) for p in traced.tin[n]}
    dim = {n: int(np.prod(traced.env[n].shape[1:])) for n in nodes}
    # the live sets first (cheap), so that a graph past the limit is refused before any pattern is built
    live, plan, widths = [traced.input_node], [], []
    for i, n in enumerate(nodes[1:], 1):
        keep = [j for j, t in enumerate(live) if last.get(t, -1) > i]
        plan.append((n, list(live), keep))
        live = [live[j] for j in keep] + [n]
        widths.append((sum(dim[t] for t in live), n, live))
    total, own = sum(w for w, _, _ in widths), sum(dim[n] for n in nodes[1:])
    if total > LIVE_STATE_LIMIT * own:
        w, n, ts = max(widths, key=lambda t: t[0])
        raise refuse_node(n, f"as a live-set chain (the graph is not series-parallel) it would carry {total} values per "
                      f"sample over its {len(plan)} steps, more than {LIVE_STATE_LIMIT}x the {own} of the graph's "
                      f"own tensors (widest after this node: {len(ts)} live tensors, {w} values: "
                      f"{', '.join(t.name for t in ts)})")
    steps: list[Any] = []
    for n, before, keep in plan:
        inputs = [before.index(p) for p in traced.tin[n]]
        kind, leaf = traced.kind[n], traced.leaf_of.get(n)
        if kind == "unit" and len(before) == 1 and not keep and len(traced.tin[n]) == 1:
            steps.append(leaf)
            continue
        offs = [0] * len(inputs)
        if kind == _CAT:
            offs = [int(o) for o in np.cumsum([0] + [dim[p] for p in traced.tin[n][:-1]])]
        steps.append(LiveStep(kind, leaf, [dim[t] for t in before], keep, inputs, offs, n.name,
                               [t.name for t in before]))
    return steps

def series_parallel(traced: Any) -> list[Any]:
    """The graph as a chain of series-parallel blocks: units in series, and blocks whose branches fork at one
    node and meet at an add or a channel concatenation (:class:`~spscan.graph.segments.Parallel`), walked back
    from the output. Raises :class:`NotSeriesParallel` naming the node where the graph is not one."""
    nodes = [n for n in traced.graph.nodes if n in traced.kind]
    users: dict[fx.Node, int] = {n: 0 for n in nodes}
    for n in nodes:
        for p in set(traced.tin[n]):
            users[p] += 1
        if len(set(traced.tin[n])) != len(traced.tin[n]):
            raise refuse_node(n, "a join reading the same tensor twice", NotSeriesParallel)
    dom: dict[fx.Node, set] = {}
    for n in nodes:
        preds = traced.tin[n]
        dom[n] = ({n} | set.intersection(*[dom[p] for p in preds])) if preds else {n}
    order = {n: i for i, n in enumerate(nodes)}
    consumed: dict[fx.Node, int] = {n: 0 for n in nodes}
    segs = _back(traced, traced.output_node, traced.input_node, dom, order, consumed, set())
    for n in nodes:
        if n is not traced.output_node and consumed[n] != users[n]:
            raise refuse_node(n, "its output is read across branches of different blocks (the graph is not a "
                          "chain of series-parallel blocks)", NotSeriesParallel)
    return segs

def _back(traced: Any, end, start, dom, order, consumed: dict, visited: set) -> list[Any]:
    """The segments between ``start`` and ``end`` (exclusive, inclusive), walking back from ``end``; counts in
    ``consumed`` how often each node is read on the way."""
    segs: list[Any] = []
    node = end
    while node is not start:
        if node in visited:
            raise refuse_node(node, "read by two branches of one block (not series-parallel)", NotSeriesParallel)
        visited.add(node)
        kind = traced.kind[node]
        if kind == "unit" and len(traced.tin[node]) > 1:
            raise refuse_node(node, "a node reading several graph tensors", NotSeriesParallel)
        if kind == "unit":
            segs.insert(0, traced.leaf_of[node])
            src = traced.tin[node][0]
            consumed[src] += 1
            node = src
        elif kind in (_ADD, _CAT):
            fork = max(dom[node] - {node}, key=lambda n: order[n])
            if order[fork] < order[start]:
                raise refuse_node(node, f"this join's branches start before {start.format_node()}, outside the block "
                              "it belongs to (not series-parallel)", NotSeriesParallel)
            branches = []
            for inp in traced.tin[node]:
                if inp is fork:
                    consumed[fork] += 1
                    branches.append([])
                else:
                    consumed[inp] += 1
                    branches.append(_back(traced, inp, fork, dom, order, consumed, visited))
            d_in = int(np.prod(traced.env[fork].shape[1:]))
            d_outs = [int(np.prod(traced.env[i].shape[1:])) for i in traced.tin[node]]
            segs.insert(0, Parallel(kind, branches, d_in, d_outs, traced.opts))
            node = fork
        else:
            raise refuse_node(node, "unexpected node in the graph")
    return segs
