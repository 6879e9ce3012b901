"""numba, imported on first use, for the compiled CPU loops (:mod:`.chain`, :mod:`.recurrence`,
:mod:`.nt`, :mod:`.pool`).

numba is optional and slow to import: a process that never runs a compiled loop never imports it,
and where it is not installed :func:`available` says so and the callers run their NumPy or torch
paths instead.
"""

from __future__ import annotations

__all__ = ["available", "numba_module"]

_numba = None  # the numba module once imported; False if it is not installed


def _load():
    global _numba
    if _numba is None:
        try:
            import numba
        except ImportError:
            _numba = False
        else:
            _numba = numba
    return _numba


def available() -> bool:
    """Whether the compiled loops can run (numba importable)."""
    return bool(_load())


def numba_module():
    """The numba module (imported once, on first use); ``RuntimeError`` where it is not installed."""
    mod = _load()
    if not mod:
        raise RuntimeError("spscan's compiled CPU kernels need numba (pip install numba)")
    return mod
