#!/usr/bin/env bash
# The whole GPU check in one command, on a bare CUDA machine (no package registry needed):
#
#   bench/gpu/run.sh [--quick] [OUTDIR]
#
# 1. installs this checkout (pip --no-deps --no-build-isolation -e .: torch, triton, numpy,
#    scipy, pytest, hypothesis and pytest-benchmark must already be there);
# 2. runs the GPU tests (tests/test_gpu.py and the kernel tests, which compile for the device);
# 3. runs the GPU benchmarks (each row a ratio against a baseline timed in the same run);
# 4. writes into OUTDIR (default: $OUT if set, else ./gpu-run): run.log, summary.json,
#    bench.json (every benchmark row), report.md and a few PNGs.
#
# Everything fits an 8-minute wall-clock budget (SPSCAN_GPU_BUDGET_S overrides, in seconds), the
# headline rows first; --quick is a smoke run of a few minutes. Without a CUDA device it says so, runs what a CPU
# can (install, test collection, CPU benchmark rows, the report) and exits with status 3.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
quick=()
outdir=""
for arg in "$@"; do
    case "$arg" in
        --quick) quick=(--quick) ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        -*) echo "run.sh: unknown option $arg (expected --quick and/or an output folder)" >&2; exit 2 ;;
        *) outdir="$arg" ;;
    esac
done
outdir="${outdir:-${OUT:-$root/gpu-run}}"
mkdir -p "$outdir"
start=$(date +%s)
budget="${SPSCAN_GPU_BUDGET_S:-480}"
py="${PYTHON:-python3}"
cd "$root" || exit 2
export PYTHONUNBUFFERED=1
{
    echo "== install ($py: $("$py" --version 2>&1))"
    "$py" -m pip install -q --no-deps --no-build-isolation -e . || { echo "install failed"; exit 2; }
    "$py" "$here/driver.py" --out "$outdir" --deadline $((start + budget)) "${quick[@]}"
} 2>&1 | tee "$outdir/run.log"
exit "${PIPESTATUS[0]}"
