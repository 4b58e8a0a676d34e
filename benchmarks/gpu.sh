#!/usr/bin/env bash
# The PyTorch benchmark suites on a CUDA GPU: the compiled suite
# (benchmarks/compiled.py: inference with inductor, the training step with
# aot_eager and an inductor reference row) and the eager suite
# (benchmarks/eager.py), each model and input on the GPU
# (AMANDA_BENCH_DEVICE=cuda; every timed step ends with a synchronisation).
#
#   benchmarks/gpu.sh [extra options of benchmarks.run, e.g. --quick]
#
# Results (<suite>.md, <suite>.json, the logs and the device) go to $OUT when
# it is set, else to benchmarks/results/gpu. Without a CUDA GPU it says so and
# exits 0. Each suite runs under a time limit (COMPILED_LIMIT, EAGER_LIMIT
# seconds; 320 + 120 by default) so the whole script ends within 8 minutes;
# a suite that hits its limit is reported and the script exits 1.
# PYTHON selects the interpreter (default: python).
set -u -o pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "benchmarks/gpu.sh needs CUDA: torch sees no CUDA GPU here (or torch is missing); nothing was run."
    exit 0
fi

DEST=${OUT:-benchmarks/results/gpu}
mkdir -p "$DEST"
export AMANDA_BENCH_DEVICE=cuda HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TF_CPP_MIN_LOG_LEVEL=3
"$PY" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))" \
    | tee "$DEST/device.txt"

status=0
run_suite() {   # name, time limit in seconds, extra options
    local name=$1 limit=$2
    shift 2
    echo "== $name suite (limit ${limit}s) =="
    timeout "$limit" "$PY" -m benchmarks.run --only "$name" --out "$DEST" "$@" 2>&1 \
        | { grep -v '^DEBUG' || true; } | tee "$DEST/$name.log"
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "benchmarks/gpu.sh: the $name suite exited with status $rc (124: over its ${limit}s limit)" \
            | tee -a "$DEST/$name.log"
        status=1
    fi
}
run_suite compiled "${COMPILED_LIMIT:-320}" "$@"
run_suite eager "${EAGER_LIMIT:-120}" "$@"
echo "results in $DEST"
exit $status
