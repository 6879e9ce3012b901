"""The one decision point: every alternative a front end has is a :class:`Candidate` with a predicted
time, and :func:`choose` picks one and keeps what it was compared with.

The questions a plan answers here: the scan depth (``levels``), the normalization form of a chain,
a recurrent step's layout, the recurrent forward (sequential or Newton), and whether a wrapped model
runs the scan at all or its own autograd backward (``native``). Each answer is a :class:`Decision`;
a plan's ``explain()`` lists them. A candidate the user forced is chosen whatever its prediction, and
the decision says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

__all__ = ["Candidate", "Decision", "choose", "explain", "format_seconds"]


def format_seconds(t: Optional[float]) -> str:
    """``t`` seconds for a table: ``1.23 ms``; ``-`` when unknown."""
    if t is None or not math.isfinite(t):
        return "-"
    if t >= 1.0:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


@dataclass(frozen=True)
class Candidate:
    """One alternative: ``name`` (what it is called in ``explain()`` and in options), the predicted
    seconds of what the question compares (``None``: not predicted, chosen only when forced or alone),
    a one-line ``detail`` and the ``value`` the front end acts on."""

    name: str
    predicted_s: Optional[float]
    detail: str = ""
    value: Any = None


@dataclass(frozen=True)
class Decision:
    """The answer to one ``question``: the ``chosen`` candidate among ``candidates`` (all of them, in
    the order offered); ``forced``: the user named it; ``basis``: what the predictions come from (the
    device profile); ``incumbent``/``margin``: the candidate kept unless another was predicted ``margin``
    times faster (a threshold of the profile, shown by :meth:`explain`)."""

    question: str
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    forced: bool = False
    basis: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    incumbent: Optional[str] = None
    margin: float = 1.0

    def candidate(self, name: str) -> Optional[Candidate]:
        return next((c for c in self.candidates if c.name == name), None)

    def explain(self) -> str:
        known = [c.predicted_s for c in self.candidates if c.predicted_s is not None and math.isfinite(c.predicted_s)]
        how = ("forced" if self.forced else "only candidate" if len(self.candidates) == 1 else
               "the only one available" if self.chosen.predicted_s is None else
               "lowest predicted" if self.chosen.predicted_s <= min(known) else f"kept: within {self.margin:g}x")
        head = f"{self.question}: {self.chosen.name} ({how}"
        head += f"; {self.basis})" if self.basis else ")"
        lines = [head]
        for c in self.candidates:
            mark = "*" if c is self.chosen else " "
            lines.append(f"  {mark} {c.name:<22} {format_seconds(c.predicted_s):>10}  {c.detail}".rstrip())
        lines += [f"  {n}" for n in self.notes]
        if self.incumbent is not None and self.margin != 1.0 and not self.forced and len(self.candidates) > 1:
            lines.append(f"  {self.incumbent} is kept unless another is predicted {self.margin:g}x faster")
        return "\n".join(lines)


def choose(question: str, candidates: Sequence[Candidate], forced: Optional[str] = None, basis: str = "",
           notes: Sequence[str] = (), incumbent: Optional[str] = None, margin: float = 1.0) -> Decision:
    """The candidate with the lowest predicted time (the first offered among equals), or the one named
    ``forced``. Candidates without a prediction are chosen only when forced or when no other is offered.

    ``incumbent``/``margin``: the candidate kept unless another is predicted at least ``margin`` times
    faster (a prediction's error should not make the choice lose to the safe option).

    Raises ``ValueError`` when there is no candidate or ``forced`` names none of them.
    """
    cands = tuple(candidates)
    if not cands:
        raise ValueError(f"{question}: no candidate to choose from")
    if forced is not None:
        pick = next((c for c in cands if c.name == forced), None)
        if pick is None:
            raise ValueError(f"{question}: {forced!r} is not a candidate here (candidates: "
                             f"{', '.join(c.name for c in cands)})")
        return Decision(question, pick, cands, True, basis, tuple(notes), incumbent, margin)
    known = [c for c in cands if c.predicted_s is not None and math.isfinite(c.predicted_s)]
    pick = min(known, key=lambda c: c.predicted_s) if known else cands[0]
    keep = next((c for c in known if c.name == incumbent), None)
    if keep is not None and pick is not keep and pick.predicted_s * margin > keep.predicted_s:
        pick = keep
    return Decision(question, pick, cands, False, basis, tuple(notes), incumbent, margin)


def explain(decisions: Sequence[Decision], title: str = "") -> str:
    """The decisions of a plan, one block each, under ``title``."""
    body = "\n".join(d.explain() for d in decisions) or "(no choices: every alternative was fixed)"
    return f"{title}\n{body}" if title else body
