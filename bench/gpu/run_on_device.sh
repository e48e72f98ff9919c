#!/usr/bin/env bash
# The learner's GPU check in one go, on a GPU machine that has torch, transformers, accelerate and peft but no
# network: bench/gpu_update.py (the table of bench/README.md), then the tests marked `cuda`. From the checkout root:
#
#   bash bench/gpu/run_on_device.sh     # into $OUT (default /tmp/lit_gpu_out): gpu_update.json and .md, the logs
#
# lit_sdk's light dependencies that such a machine lacks travel as wheels in a git-ignored folder ($LIT_WHEELS,
# default .whl, which .gitignore leaves out of git). Fill it on a machine with the network, from the
# checkout root, with the versions constraints.txt pins:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
#     opentelemetry-instrumentation==0.66b2 pyzmq==27.3.0
#
# About 8 minutes at most: the wheels 60 s, the benchmark 390 s (its own budget is 330 s), the tests what is left.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/lit_gpu_out}
WHEELS=${LIT_WHEELS:-.whl}
mkdir -p "$OUT"
SECONDS=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lit_site "$WHEELS"/*.whl || echo "run_on_device: installing the wheels from $WHEELS failed"
else
    echo "run_on_device: no wheels in $WHEELS: lit_sdk's dependencies must already be installed"
fi
export PYTHONPATH=src:/tmp/lit_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

# shellcheck disable=SC2086  # GPU_UPDATE_ARGS: more arguments, split (e.g. --tiny for a try on a CPU)
timeout 390 python3 bench/gpu_update.py --out "$OUT" ${GPU_UPDATE_ARGS:-} 2>&1 | tee "$OUT/gpu_update.log"
bench=${PIPESTATUS[0]}
echo "run_on_device: bench/gpu_update.py exit status $bench (1: a run failed; 124: stopped at 390 s)"

left=$((470 - SECONDS))
if [ "$left" -lt 30 ]; then
    echo "run_on_device: ${left} s left: the cuda tests are not run"
else
    # the tests marked cuda live in one module (the rest of the suite needs vLLM, agents... this machine lacks)
    timeout "$left" python3 -m pytest -q -p no:cacheprovider -m cuda tests/trainer/learner/test_cuda.py 2>&1 \
        | tee "$OUT/pytest_cuda.log"
    tests=${PIPESTATUS[0]}
    summary=$(grep -v '^$' "$OUT/pytest_cuda.log" | tail -n 1)
    case $tests in
        0) echo "run_on_device: cuda tests (exit status 0): $summary" ;;
        124) echo "run_on_device: the cuda tests were stopped after ${left} s" ;;
        *) echo "run_on_device: cuda tests exit status $tests (failures or collection errors): $summary" ;;
    esac
fi
echo "run_on_device: done in ${SECONDS} s"
exit "$bench"
