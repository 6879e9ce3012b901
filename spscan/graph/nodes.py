"""Reading a traced node: what it calls (:func:`node_key`, the registry's key), where the user wrote it
(:func:`node_source`), the call as text (:func:`node_text`), and the refusal that names all of them and the
layer it is in (:func:`refuse_node`)."""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx
import torch.nn as nn

from spscan.errors import NotPlannable
from spscan.layers.registry import NODE_UNITS

__all__ = ["first_line", "node_key", "node_source", "node_text", "refuse_node"]


def node_key(node: fx.Node, root: nn.Module) -> Any:
    if node.op == "call_module":
        return type(root.get_submodule(node.target))
    if node.op == "call_method":
        return ("method", node.target)
    return node.target


def node_source(node: fx.Node) -> str:
    """The innermost user frame that made ``node`` (``file:line in fn: code``), and the module it is in."""
    frames, lines = [], (node.stack_trace or "").splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', ln)
        if m:
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append(m.groups() + ("" if nxt.startswith("File ") else nxt,))
    user = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    where = "source line unknown"
    if user:
        f, line, fn, code = user[-1]
        where = f"{f}:{line} in {fn}" + (f": {code.strip()}" if code else "")
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        where += f", in module '{path}' ({getattr(cls, '__name__', cls)})"
    return where


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def node_text(node: fx.Node) -> str:
    """``node`` as the call it stands for: ``operator.mul(relu, 2)``, ``x.view(...)``, ``self.fc(x)``."""
    args = [a.name if isinstance(a, fx.Node) else repr(a) for a in node.args]
    args += [f"{k}={v.name if isinstance(v, fx.Node) else repr(v)}" for k, v in node.kwargs.items()]
    if node.op == "call_method":
        return f"{args[0]}.{node.target}({', '.join(args[1:])})" if args else f".{node.target}()"
    if node.op == "call_module":
        name = f"self.{node.target}"
    else:
        t = node.target
        mod = {"_operator": "operator"}.get(getattr(t, "__module__", None) or "", getattr(t, "__module__", None) or "")
        name = f"{mod}.{getattr(t, '__name__', repr(t))}".lstrip(".")
    return f"{name}({', '.join(args)})"


def refuse_node(node: fx.Node, why: str, exc: type = NotPlannable) -> Exception:
    """An error naming the layer the node is in (its path and type), the call, where it was written, and
    why; a layer that subclasses a supported type with its own forward is told so."""
    stack = node.meta.get("nn_module_stack")
    head, hint = "", ""
    if stack:
        path, cls = list(stack.values())[-1]
        cls = cls if isinstance(cls, type) else None
        head = f"layer '{path}' ({getattr(cls, '__name__', cls)}): "
        base = next((b for b in (cls.__mro__[1:] if cls else ()) if b in NODE_UNITS), None)
        if base is not None and cls.forward is not base.forward:
            hint = (f"; {cls.__name__} subclasses nn.{base.__name__} but defines its own forward, which is traced "
                    f"op by op instead of taking nn.{base.__name__}'s Jacobian")
    return exc(f"{head}{node_text(node)} (node {node.name}, at {node_source(node)}): {why}{hint}")
