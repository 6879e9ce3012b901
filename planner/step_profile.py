"""What one training step of a wrapped model costs, run through the scan or through the model's own
autograd backward (``native``): the fitted constants of a machine and the predictions made from them.

A step's cost is a sum over the model's layers (units, each of a family such as ``ConvUnit``) plus a
fixed part per regime::

    t_regime(model) = base[regime] + sum_u (fixed[family_u, regime] + per_work[family_u, regime] * work_u)

for the regimes ``native`` and ``scan``, and on a GPU ``graph`` (the whole step replayed from CUDA graphs,
:mod:`spscan.runtime.graphed`), which a profile either prices for every family or not at all,

with ``work_u = B * (nnz of J_u^T + d_in + d_out)`` (multiply-adds of ``J^T g`` plus the elements the
layer reads and writes). An opaque node (a traced operation without an analytic unit) runs its own
forward and autograd backward in every regime: it is priced by the operations its call made when it
was planned, each as the family that runs the same work (a GEMM or attention product as a
``LinearUnit`` of its multiply-adds, a convolution as a ``ConvUnit``, anything else as an
``ElementwiseUnit`` of the elements it writes) at the native constants where it runs as it does under
autograd (``scan``), at the regime's own where the step is replayed from a recording (``graph``: the
node's launches are in the graph with the rest, :data:`REPLAYED_REGIMES`), plus one layer's wrapper cost. A recurrent module costs
``fixed + per_step * T + per_mac * T * B * (I + H) * H * gates + per_state * T * B * H * gates`` per
(layer, direction).

A profile also holds the constants of the scan's critical-path model (:class:`~spscan.planner.cost.DeviceProfile`,
:attr:`StepProfile.critical_path`: the depth, storage and normalization-form decisions of every plan) and the
thresholds of every decision made with it: one profile per machine decides everything.

The constants are fitted on the machine at hand by :func:`spscan.calibrate` and cached per
machine (device name, cores, torch version, thread count) under :func:`cache_dir`; until a machine is
calibrated the reference profile of its device class is used (``data/step-profile-<device>*.json``,
fitted on the machines ``bench/results/calibration.md`` lists), and the plan's ``explain()`` says which.
Predictions decide; they never change a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .cost import DeviceProfile, profile_for

__all__ = ["OPTIONAL_REGIMES", "PREDICTED", "REGIMES", "StepProfile", "cache_dir", "load_step_profile", "machine_key", "recurrent_features",
           "reference_profile"]

REGIMES = ("native", "scan")
#: regimes a profile may price besides :data:`REGIMES`: ``graph``, the scan's backward replayed from a CUDA
#: graph (a GPU profile's); a profile either prices one for every family or not at all
OPTIONAL_REGIMES = ("graph",)
#: regimes that replay every launch of a step from a recording, an opaque node's operations too: their own
#: constants price every term (:meth:`StepProfile.layers_time`)
REPLAYED_REGIMES = frozenset({"graph"})
#: the family of a term already priced in seconds per regime, ``(PREDICTED, {regime: seconds})``: a node that
#: makes its own decision (a recurrent layer inside a model) and is priced at what that decision predicts
PREDICTED = "predicted"
FORMAT = 2
_DATA = Path(__file__).with_name("data")


def cache_dir() -> Path:
    """Where fitted profiles are kept: ``$SPSCAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/spscan``, else
    ``~/.cache/spscan``."""
    env = os.environ.get("SPSCAN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spscan"


def machine_key(device_type: str, device_name: str, threads: int, torch_version: str) -> str:
    """The cache key of one machine configuration: what changes the constants (the device, the CPU's
    cores, the torch build, the thread count)."""
    text = "|".join([device_type, device_name, platform.machine(), str(os.cpu_count()), torch_version,
                     str(int(threads))])
    return f"{device_type}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass
class StepProfile:
    """Fitted step-cost constants of one machine configuration (see the module docstring).

    ``families[family][regime] = (fixed_s, per_work_s)``; ``recurrent[cell][regime] =
    (fixed_s, per_step_s, per_mac_s, per_state_s)``; ``base[regime]`` the fixed seconds of a step.
    """

    name: str
    device_type: str
    base: dict[str, float]
    families: dict[str, dict[str, tuple[float, float]]]
    recurrent: dict[str, dict[str, tuple[float, ...]]] = field(default_factory=dict)
    source: str = "reference"  # "reference" (shipped) or "calibrated" (fitted on this machine)
    fitted_on: str = ""
    # thresholds of the decisions made with this profile (a profile file may set them; calibration keeps them):
    # ``backward="auto"`` runs the scan only where it is predicted ``scan_margin`` times faster than the
    # model's own backward (near a tie the prediction's error could make the scan the slower one, and native
    # never loses); ``graph`` is offered only where a step's activations fit ``graph_max_activation_bytes``
    # (a recorded step keeps them, and a copy of the input, between steps, per signature, where autograd
    # frees them after each backward)
    scan_margin: float = 1.1
    graph_max_activation_bytes: int = 1 << 30
    # the critical-path model's constants where this machine's differ from its device class's
    # (:func:`~spscan.planner.cost.profile_for`): field name -> value
    critical_path_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def critical_path(self) -> DeviceProfile:
        """The scan's critical-path model on this machine: the device class's constants with this profile's
        overrides (what every plan's depth, storage and normalization form are decided with)."""
        return profile_for(self.device_type, self.critical_path_overrides or None)

    # ---------------------------------------------------------------- predictions

    def has_regime(self, regime: str) -> bool:
        """Whether this profile prices ``regime`` (every profile prices :data:`REGIMES`)."""
        return regime in self.base

    def has_recurrent_regime(self, cell: str, regime: str) -> bool:
        """Whether this profile prices ``regime`` for recurrent modules of ``cell`` kind."""
        return regime in self.recurrent.get(_cell(cell), {})

    def _family(self, family: str) -> dict[str, tuple[float, float]]:
        got = self.families.get(family)
        return got if got is not None else self.families["default"]

    def layers_time(self, layers: Iterable[tuple], regime: str) -> float:
        """Predicted seconds of one step of a model whose layers are ``(family, work)`` pairs, or
        ``(family, work, priced_as)`` triples: a term that costs what it costs under autograd in the scan
        too (the forward and autograd backward of an opaque node's own operations, run as they are)
        names the regime whose constants price it, ``"native"``; a regime that replays the whole step
        (:data:`REPLAYED_REGIMES`) prices it with its own. A :data:`PREDICTED` term adds its seconds for the
        regime (its ``native`` ones for a regime it does not name)."""
        t = self.base[regime]
        replayed = regime in REPLAYED_REGIMES
        for family, work, *priced_as in layers:
            if family == PREDICTED:
                t += work.get(regime, work["native"])
                continue
            fixed, per = self._family(family)[priced_as[0] if priced_as and not replayed else regime]
            t += fixed + per * work
        return t

    def recurrent_time(self, cell: str, seq_len: int, batch: int, input_size: int, hidden: int,
                       regime: str) -> float:
        """Predicted seconds of one step (forward and backward) of one (layer, direction) of a recurrent
        module of ``cell`` kind (``rnn``/``rnn_tanh``/``rnn_relu``, ``gru``, ``lstm``)."""
        coef = self.recurrent[_cell(cell)][regime]
        return sum(c * f for c, f in zip(coef, recurrent_features(cell, seq_len, batch, input_size, hidden)))

    def describe(self) -> str:
        what = "calibrated on this machine" if self.source == "calibrated" else "reference profile, not calibrated here"
        return f"step profile {self.name} ({what})"

    def describe_thresholds(self) -> str:
        """The bound this profile offers ``graph`` within, as ``explain()`` shows it (a GPU profile's; the
        scan margin is shown by the decision it decides, :attr:`~spscan.planner.choose.Decision.margin`)."""
        if self.device_type != "cuda":
            return ""
        return f"graph offered up to {self.graph_max_activation_bytes / (1 << 30):g} GiB of activations"

    # ---------------------------------------------------------------- files

    def to_json(self) -> dict:
        return {"format": FORMAT, "name": self.name, "device_type": self.device_type, "base": self.base,
                "families": {f: {r: list(v) for r, v in d.items()} for f, d in self.families.items()},
                "recurrent": {c: {r: list(v) for r, v in d.items()} for c, d in self.recurrent.items()},
                "source": self.source, "fitted_on": self.fitted_on, "scan_margin": self.scan_margin,
                "graph_max_activation_bytes": self.graph_max_activation_bytes,
                "critical_path": dict(self.critical_path_overrides)}

    @classmethod
    def from_json(cls, d: dict) -> "StepProfile":
        if d.get("format") != FORMAT:
            raise ValueError(f"step profile format {d.get('format')!r}, expected {FORMAT}")
        fams = {f: {r: _pair(v) for r, v in regs.items()} for f, regs in d["families"].items()}
        rec = {c: {r: _quad(v) for r, v in regs.items()} for c, regs in d.get("recurrent", {}).items()}
        regimes = set(REGIMES) | {r for r in OPTIONAL_REGIMES if r in d["base"]}
        base = {r: float(d["base"][r]) for r in sorted(regimes)}
        if "default" not in fams or any(set(v) != regimes for v in fams.values()):
            raise ValueError(f"step profile: every family needs the regimes {sorted(regimes)} (the base's), and a "
                             "'default' family is required")
        margin = d.get("scan_margin", cls.scan_margin)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 1.0 <= margin < float("inf"):
            raise ValueError(f"step profile: scan_margin must be a finite number >= 1, got {margin!r}")
        limit = d.get("graph_max_activation_bytes", cls.graph_max_activation_bytes)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"step profile: graph_max_activation_bytes must be an int >= 0, got {limit!r}")
        over = d.get("critical_path", {})
        if not isinstance(over, dict):
            raise ValueError(f"step profile: critical_path must be a dict of DeviceProfile fields, got {over!r}")
        try:  # every field checked as a plan file's are
            DeviceProfile.from_dict({**profile_for(str(d["device_type"])).__dict__, **over})
        except ValueError as e:
            raise ValueError(f"step profile: critical_path: {e}") from None
        return cls(str(d["name"]), str(d["device_type"]), base, fams, rec, str(d.get("source", "reference")),
                   str(d.get("fitted_on", "")), float(margin), limit, dict(over))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def _pair(v: Sequence[float]) -> tuple[float, float]:
    a, b = (float(t) for t in v)
    return a, b


# gate blocks per cell family (the data files' keys); a cell's full name keys its family too
_GATES = {"rnn": 1, "gru": 3, "lstm": 4}
_FAMILY = {"rnn_tanh": "rnn", "rnn_relu": "rnn"}


def _cell(cell: str) -> str:
    return _FAMILY.get(cell, cell)


def recurrent_features(cell: str, seq_len: int, batch: int, input_size: int, hidden: int) -> list[float]:
    """What a recurrent (layer, direction)'s constants multiply: ``[1, T, multiply-adds, states]``, with
    ``states = T * B * H * gates`` (gate values written and read back once per step)."""
    states = seq_len * batch * hidden * _GATES[_cell(cell)]
    return [1.0, float(seq_len), float(states * (input_size + hidden)), float(states)]


def _quad(v: Sequence[float]) -> tuple[float, ...]:
    out = tuple(float(t) for t in v)
    if len(out) != 4:
        raise ValueError(f"a recurrent cost needs 4 constants (fixed, per step, per mac, per state), got {len(out)}")
    return out


def reference_profile(device_type: str, threads: Optional[int] = None) -> StepProfile:
    """The shipped profile of a device class (``cpu`` or ``cuda``); for a CPU, the one fitted at the thread
    count nearest ``threads`` (files ``step-profile-cpu-<threads>t.json``; None: the fewest threads)."""
    if device_type == "cuda":
        path = _DATA / "step-profile-cuda.json"
    else:
        fitted = sorted((int(p.stem.rsplit("-", 1)[1][:-1]), p) for p in _DATA.glob("step-profile-cpu-*t.json"))
        want = fitted[0][0] if threads is None else int(threads)
        path = min(fitted, key=lambda tp: (abs(tp[0] - want), tp[0]))[1]
    return StepProfile.from_json(json.loads(path.read_text()))


_LOADED: dict[str, StepProfile] = {}


def load_step_profile(device_type: str, key: Optional[str], threads: Optional[int] = None) -> StepProfile:
    """The profile fitted for ``key`` (:func:`machine_key`) if this machine was calibrated, else the
    reference profile of ``device_type`` (at ``threads``). Read once per process."""
    if key is not None and key in _LOADED:
        return _LOADED[key]
    prof = None
    if key is not None:
        path = cache_dir() / f"{key}.json"
        if path.is_file():
            try:
                prof = StepProfile.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                prof = None  # a stale or damaged cache entry: the reference profile is used
    if prof is None:
        prof = reference_profile(device_type, threads)
    if key is not None:
        _LOADED[key] = prof
    return prof


def forget_loaded() -> None:
    """Drop the profiles read so far (a new calibration is read on next use)."""
    _LOADED.clear()
