"""Draw simulated timelines as PNG, one row per device, as the papers' pipeline figures do.

Uses matplotlib's object API with the Agg canvas directly, so drawing changes no global
matplotlib state (no ``matplotlib.use``, no pyplot figures left open).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from spscan.parallel.pipeline.simulator import Timeline

__all__ = ["draw_timelines", "timeline_figure", "KIND_COLORS", "KIND_NAMES"]

KIND_COLORS = {
    "F": "#7fd3e6",  # forward (the papers' cyan)
    "B": "#f2d45c",  # full backward (yellow)
    "I": "#f2d45c",  # input gradient
    "W": "#f0a35e",  # weight gradient
    "R": "#b39ddb",  # scan: slice reduction
    "X": "#9e9e9e",  # scan: one round
}


KIND_NAMES = {"F": "forward", "B": "full backward", "I": "input gradient", "W": "weight gradient",
              "R": "scan: slice reduction", "X": "scan: one round"}


def _label(a) -> str:
    mb = "" if a.microbatch is None else str(a.microbatch)
    if a.kind == "X":
        return f"X{a.round}"
    if a.layers[0] == a.layers[1]:
        return f"{a.kind}{a.layers[0]}{'.' + mb if mb else ''}"
    return f"{a.kind}{mb}"


def draw_timelines(timelines: Sequence[Timeline], path: str, title: Optional[str] = None,
                   until: Optional[float] = None, dpi: int = 110) -> str:
    """Write the timelines, stacked, to the PNG ``path`` (its folder is created); returns ``path``.

    Each box is one action: colour by kind (``F`` cyan, ``I``/``B`` yellow, ``W`` orange, ``R`` purple,
    ``X`` grey), labelled with the kind, layer (per-layer schedules) and micro-batch. Every panel has
    the same time axis (the longest timeline's, or ``until``, which crops it: asynchronous timelines are
    long), so the schedules compare at a glance; a legend names each kind.
    """
    fig = timeline_figure(timelines, title, until)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def timeline_figure(timelines: Sequence[Timeline], title: Optional[str] = None, until: Optional[float] = None):
    """The figure :func:`draw_timelines` writes (a matplotlib ``Figure`` on an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not timelines:
        raise ValueError("timelines: expected at least one Timeline, got none")
    rows = sum(t.devices for t in timelines)
    fig = Figure(figsize=(12, 1.0 + 0.32 * rows + 0.55 * len(timelines)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(timelines), 1, squeeze=False,
                        gridspec_kw={"height_ratios": [max(1, t.devices) for t in timelines]})[:, 0]
    end = until if until is not None else max((a.end for tl in timelines for dev in tl.actions for a in dev),
                                              default=1.0)
    for ax, tl in zip(axes, timelines):
        for d, dev in enumerate(tl.actions):
            for a in dev:
                if a.start >= end:
                    continue
                width = min(a.end, end) - a.start
                if width <= 0 and a.kind != "X":
                    continue
                width = max(width, end * 0.002)
                y0, h = d - 0.4, 0.8
                if tl.extra.get("dual_issue"):  # forward and backward share the unit: two half rows
                    y0, h = (d - 0.4, 0.4) if a.kind == "F" else (d, 0.4)
                ax.broken_barh([(a.start, width)], (y0, h), facecolors=KIND_COLORS.get(a.kind, "#cccccc"),
                               edgecolors="black", linewidth=0.3)
                if width > end / 60:
                    ax.text(a.start + width / 2, y0 + h / 2, _label(a), ha="center", va="center", fontsize=5.5)
        ax.set_ylim(tl.devices - 0.5, -0.5)
        ax.set_yticks(range(tl.devices))
        ax.set_yticklabels([f"dev {d}" for d in range(tl.devices)], fontsize=7)
        ax.set_xlim(0, end)
        ax.tick_params(axis="x", labelsize=7)
        stale = f", max staleness {tl.max_staleness}" if tl.max_staleness else ""
        ax.set_title(f"{tl.schedule}: p={tl.devices}, m={tl.microbatches}, step {tl.step_time:.4g}, "
                     f"bubble {tl.bubble_fraction:.0%}{stale}", fontsize=8, loc="left")
    axes[-1].set_xlabel("time (in the units of the layer costs)", fontsize=8)
    present = {a.kind for tl in timelines for dev in tl.actions for a in dev}
    kinds = [k for k in KIND_COLORS if k in present] + sorted(present - set(KIND_COLORS))
    fig.legend(handles=[Patch(facecolor=KIND_COLORS.get(k, "#cccccc"), edgecolor="black",
                              label=f"{k}: {KIND_NAMES.get(k, k)}") for k in kinds],
               loc="upper right", fontsize=7, ncol=len(kinds))
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig
