import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
