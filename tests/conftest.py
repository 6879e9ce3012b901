import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when a kernel is
# decorated, so it is set here, before any test module imports triton; the library never sets it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite checks the scan: a wrapped model runs it unless a test asks for backward="auto" or "native"
# (the default, "auto", may choose the model's own backward, which would leave the scan untested). The
# cost model plans with the reference profiles, not with whatever this machine has calibrated.
os.environ.setdefault("SPSCAN_BACKWARD", "scan")
os.environ.setdefault("SPSCAN_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".no-calibration"))
from hypothesis import HealthCheck, settings

# One pinned, derandomized profile so CI runs the same examples every time.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SPSCAN_HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
