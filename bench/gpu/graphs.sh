#!/usr/bin/env bash
# The wrapped models' CUDA-graph steps on a GPU, in one command (about 8 minutes with every stage):
#
#   bench/gpu/graphs.sh [OUTDIR]
#
# Stages, most important first (GRAPHS_STAGES picks some, in this order; default: all of them):
#   tests      the GPU tests that record real graphs: tests/test_graphed.py (wrapped CNNs, ResNet-20, LayerNorm
#              MLP with dropout, BatchNorm, single-layer, stacked and bidirectional recurrent modules:
#              bitwise equal to the eager scan) and tests/test_autocast_and_no_grad.py (AMP, a wrapper
#              moved to the GPU); every failure is reported, not only the first
#   opaque     the transformer layer's graphed steps in a loop that keeps its loss (bench/gpu/probe_graph_crash.py:
#              every variant rc 0, no failed recording)
#   cnn        the "never slower" CNN, MLP and transformer rows on CUDA at the default thread count, with
#              the shipped reference profile (what a user who never calibrates gets)
#   rnn        the recurrent rows, the same way, at the default thread count and at one thread (their
#              whole-step graph among the candidates; a row notes a graph side that ran partly eagerly)
#   cnn1       the CNN, MLP and transformer rows at one thread
#   compile    the CNN, MLP and transformer rows with torch.compile(model, mode="reduce-overhead") timed in
#              the same rounds (--peer-compile: a column "vs torch.compile"; compiling takes most of its time)
#   calibrate  spscan.calibrate() on this GPU at two threads (whole models; GRAPHS_CALIBRATE_RECURRENT=1
#              also fits the recurrent cells, graph included), written to OUTDIR/step-profile-cuda.json
#   profile    forward and backward timed apart for LeNet-5, ResNet-20, the transformer layer and an LSTM
#              (T = 100, B = 16; bench/gpu/profile_graphs.py)
#
# 0. installs this checkout first (pip --no-deps --no-build-isolation -e .). Each stage has a time limit;
# what finished is kept (OUTDIR/graphs.log, OUTDIR/never-slower-cuda-*.md/.json, OUTDIR/step-profile-cuda.json,
# OUTDIR/profile_graphs.log). OUTDIR defaults to $OUT, else ./gpu-graphs. The rows run with an empty
# profile cache, and the calibration with one of its own, both in a temporary folder (GRAPHS_CACHE_DIR
# keeps them): OUTDIR holds the results alone.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-${OUT:-$root/gpu-graphs}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
stages=" ${GRAPHS_STAGES:-tests opaque cnn rnn cnn1 compile calibrate profile} "
cd "$root" || exit 2
export PYTHONUNBUFFERED=1
cache="${GRAPHS_CACHE_DIR:-$(mktemp -d)}"
export SPSCAN_CACHE_DIR="$cache/rows"
log="$out/graphs.log"
stage() { echo "== $1 ($(date +%T))" | tee -a "$log"; }
want() { [[ "$stages" == *" $1 "* ]]; }
{
    stage install
    "$py" -m pip install -q --no-deps --no-build-isolation -e . || exit 2
    "$py" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
} 2>&1 | tee -a "$log"
if want tests; then
    stage tests
    timeout 240 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_graphed.py \
        tests/test_autocast_and_no_grad.py 2>&1 | tail -40 | tee -a "$log"
fi
if want opaque; then
    stage opaque
    timeout 150 "$py" bench/gpu/probe_graph_crash.py 2>&1 | cut -c1-300 | head -40 | tee -a "$log"
fi
rows() {  # rows NAME TIMEOUT PYTEST-K [OPTION...]
    stage "never-slower: $1"
    timeout "$2" "$py" -m bench.never_slower --out "$out/never-slower-cuda-$1.md" --quick "${@:4}" \
        -- -k "$3" -p no:cacheprovider 2>&1 | tail -8 | tee -a "$log"
}
want cnn && rows cnn 200 "cuda-default and not _T1"
want rnn && rows rnn 240 "cuda and _T1"
want cnn1 && rows cnn-1-thread 200 "cuda-1-threads and not _T1"
want compile && rows compile 420 "cuda-default and not _T1" --peer-compile
if want calibrate; then
    stage calibrate
    SPSCAN_CACHE_DIR="$cache/calibrate" timeout 240 "$py" - "$out" "${GRAPHS_CALIBRATE_RECURRENT:-0}" <<'EOF' 2>&1 | tee -a "$log"
import json, sys, torch, spscan
from spscan.cli.calibration import calibrate
torch.set_num_threads(2)  # as the benchmarks run (bench/conftest.py): the profile is kept per thread count
prof = calibrate("cuda", recurrent=sys.argv[2] == "1", log=print)
open(f"{sys.argv[1]}/step-profile-cuda.json", "w").write(json.dumps(prof.to_json(), indent=1, sort_keys=True))
EOF
fi
if want profile; then
    stage "profile: forward and backward apart"
    # -X faulthandler: a crash prints the Python stack it happened in (kept in the log with the rows)
    timeout 120 "$py" -X faulthandler bench/gpu/profile_graphs.py --out "$out" \
        --models lenet5,resnet20,transformer_encoder,lstm_T100_B16 2>&1 \
        | grep -E " ms |Fatal Python error|^Thread|^Current thread|^  File " | head -60 | tee -a "$log"
fi
stage done
