#!/usr/bin/env bash
# The wrapped models' CUDA-graph backward on a GPU, in one command (about 4 minutes; 6 with the recurrent rows):
#
#   bench/gpu/graphs.sh [OUTDIR]
#
# 1. installs this checkout (pip --no-deps --no-build-isolation -e .);
# 2. runs the tests that record real graphs: tests/test_graphed.py (wrapped CNNs, ResNet-20, LayerNorm
#    MLP with dropout, BatchNorm: bitwise equal to the eager scan) and the recurrent modules' replay;
# 3. calibrates this GPU's step profile, the graph regime included (spscan.calibrate, families only:
#    the recurrent constants stay the reference's), into OUTDIR/cache, and writes it to
#    OUTDIR/step-profile-cuda.json;
# 4. times forward and backward apart for LeNet-5 and ResNet-20 (bench/gpu/profile_graphs.py);
# 5. runs the "never slower" rows on CUDA at the default thread count with that profile: the CNNs,
#    the MLP and the transformer rows first, then the recurrent ones (OUTDIR/never-slower-*.md/.json).
#
# Each stage has a time limit; what finished is kept. OUTDIR defaults to $OUT, else ./gpu-graphs.
# GRAPHS_RECURRENT=0 leaves the recurrent rows out (no graph candidate there: their scan replays its own).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-${OUT:-$root/gpu-graphs}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
cd "$root" || exit 2
export PYTHONUNBUFFERED=1
export SPSCAN_CACHE_DIR="$out/cache"
log="$out/graphs.log"
stage() { echo "== $1 ($(date +%T))" | tee -a "$log"; }
{
    stage install
    "$py" -m pip install -q --no-deps --no-build-isolation -e . || exit 2
    "$py" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee -a "$log"
stage tests
# GRAPHS_TESTS=graphed: tests/test_graphed.py alone
recurrent_tests=("tests/test_recurrence_kernels.py")
[ "${GRAPHS_TESTS:-all}" = graphed ] && recurrent_tests=()
timeout 150 "$py" -m pytest -q -x -p no:cacheprovider tests/test_graphed.py "${recurrent_tests[@]}" \
    -k "graph or Graph or cuda" 2>&1 | tail -25 | tee -a "$log"
stage calibrate
timeout 150 "$py" - "$out" <<'EOF' 2>&1 | tee -a "$log"
import json, sys, torch, spscan
from spscan.calibration import calibrate
torch.set_num_threads(2)  # as the benchmarks run (bench/conftest.py): the profile is kept per thread count
prof = calibrate("cuda", recurrent=False, log=print)
d = prof.to_json()
open(f"{sys.argv[1]}/step-profile-cuda.json", "w").write(json.dumps(d, indent=1, sort_keys=True))
EOF
stage "profile: forward and backward apart"
timeout 60 "$py" bench/gpu/profile_graphs.py --out "$out" 2>&1 | grep " ms " | tee -a "$log"
stage "never-slower: CNNs, MLP, transformers"
timeout 200 "$py" -m bench.never_slower --out "$out/never-slower-cuda-cnn.md" --quick \
    -- -k "cuda-default and not _T1" -p no:cacheprovider 2>&1 | tail -8 | tee -a "$log"
[ "${GRAPHS_RECURRENT:-1}" = 0 ] && { stage "done (recurrent rows skipped)"; exit 0; }
stage "never-slower: recurrent"
timeout 110 "$py" -m bench.never_slower --out "$out/never-slower-cuda-rnn.md" --quick \
    -- -k "cuda-default and _T1" -p no:cacheprovider 2>&1 | tail -8 | tee -a "$log"
stage done
