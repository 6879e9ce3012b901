import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# the suites time the scan against autograd: a wrapped model runs the scan unless a row asks otherwise
# (the never-slower suite passes backward="auto" and times what the planner chose)
os.environ.setdefault("SPSCAN_BACKWARD", "scan")


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


@pytest.fixture
def one_thread():
    """One torch thread per side for the row (the recurrent rows compare one-threaded loops)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(before)


@pytest.fixture
def flush_denormal():
    """Denormals flushed for the row (a recurrence decaying towards zero otherwise times denormal arithmetic)."""
    flushed = torch.set_flush_denormal(True)
    yield flushed
    torch.set_flush_denormal(False)


def time_mode(mode: str, forward, clock=None) -> float:
    """Seconds of one training-step part by ``clock`` (default ``time.perf_counter``): ``"backward"``
    times ``loss.backward()`` after an untimed ``forward()``, ``"forward"`` the forward alone (its
    backward runs untimed, freeing the graph), ``"step"`` both."""
    import time

    clock = clock or time.perf_counter
    if mode == "backward":
        loss = forward()
        t0 = clock()
        loss.backward()
        return clock() - t0
    if mode == "forward":
        t0 = clock()
        loss = forward()
        t = clock() - t0
        loss.backward()
        return t
    t0 = clock()
    forward().backward()
    return clock() - t0
