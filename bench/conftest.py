import os

import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
