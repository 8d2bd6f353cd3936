#!/usr/bin/env bash
# The GPU measurements issue 22 still needs, as one prepared run for a lent device
# (one H200: about 6 minutes of its 15; torch + Triton there, no vLLM). Run from
# anywhere; every report goes to $OUT (or ./gpu-out) as well as stdout.
#
#   bash bench/gpu_session.sh              # on the device
#   bash bench/gpu_session.sh --rehearse   # the same run on CPU at toy sizes, kernels
#                                          # in Triton's interpreter (about 2 minutes)
#
# 1. add only (no clamp tables), compiled as vLLM compiles: the unsteered / steered
#    targets at 1-256 tokens, `kernel` against `inductor`, and Inductor's kernel counts;
# 2. the default clamp cap (4 per point): one launch per point (steer_and_clamp);
# 3. the older per-size compile at 1 token, to show what the size-1 graph cost.
#
# PYTHON names the interpreter (default python3, the one the device's image documents;
# it need not have `python`).
# tests/engine/test_gpu_session_rehearsal.py rehearses this script in CI, with the
# project's dependencies that the device lacks (pydantic, orjson, vLLM) hidden.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
py="${PYTHON:-python3}"
extra=("$@")
for arg in "$@"; do
    # The interpreter runs the kernel checks only if Triton is first imported with it.
    [[ $arg == --rehearse ]] && export TRITON_INTERPRET=1
done
mkdir -p "$out"
common=(--compiled-only --tokens 1,16,64,256 --compiled-layers 8 --repeats 11)
status=0
run() {
    local name=$1
    shift
    echo "== $name: $py bench/steering_overhead_gpu.py $*"
    "$py" bench/steering_overhead_gpu.py "$@" --out "$out/$name.txt" || status=1
}
run compiled-add-only "${common[@]}" --clamps 0 "${extra[@]}"
run compiled-clamps4 "${common[@]}" --clamps 4 "${extra[@]}"
run per-size-1-token --compiled-only --tokens 1 --compiled-layers 8 --repeats 11 --clamps 0 \
    --compile-mode per-size "${extra[@]}"
exit $status
