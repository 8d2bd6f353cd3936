#!/usr/bin/env bash
# `make test`: the whole suite as three streams that run at once, each line prefixed with
# its stream's name, then the timed tests alone. The run fails if any part fails.
#
#   gateway        everything that serves no real vLLM engine, then the gateway suite
#                  again on a local Redis Cluster (issue 14), at normal priority.
#   architectures  the architecture matrix (`-m architectures`: 15 engines, three
#                  starting at a time), under SCHED_IDLE.
#   engine         every other test that serves a real vLLM engine, under SCHED_IDLE.
#                  An engine start mostly waits (processes spawn and import, one core
#                  compiles), so this stream fills what the matrix leaves.
#   timed          once the three are done, on a quiet machine: the tests that bound
#                  their own time tightly (`-m "faults or timed"`: fault recovery, one
#                  tenant's latency under another's attack), plain and on the cluster.
#
# SCHED_IDLE is `chrt --idle 0` (`nice -n 19` where that is refused). Neither keeps the
# engines fully out of the way: beside them a bystander's p95 under attack went from 18 to
# 142 ms (bound 118) at nice 19, and leases stranded after a Redis hang went to 5 (bound 2)
# under SCHED_IDLE. Hence the quiet tail. No check in the engine streams bounds its own
# time tightly.
#
# One after the other, the suite took 88 minutes of CI's 90 on a slow machine (stop 41).
# Anything that two streams read is made before they start, so no stream builds it
# under another.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

"$PY" -c "from tests.harness import tiny_model_dir; tiny_model_dir()" || exit 1

if chrt --idle 0 true 2>/dev/null; then
  idle=(chrt --idle 0)
else
  idle=(nice -n 19)
fi

# Ctrl-C or CI's own limit stops every stream and what they started.
trap 'trap - INT TERM; kill 0' INT TERM

stream() {  # NAME COMMAND...: COMMAND's output, each line prefixed "[NAME] "
  local name=$1
  shift
  "$@" 2>&1 | sed -u "s/^/[$name] /"
  return "${PIPESTATUS[0]}"
}

# The cluster pass: the gateway suite again, minus what starts its own Redis or engine.
CLUSTER="not engine and not browser and not faults and not own_redis"

gateway_suite() {
  "$PY" -m pytest -m "not engine and not architectures and not faults and not timed" \
    --durations=40 &&
    STEERGATE_TEST_REDIS=cluster "$PY" -m pytest tests/gateway -m "$CLUSTER and not timed" \
      --durations=15
}

timed_suite() {
  "$PY" -m pytest -m "(faults or timed) and not engine and not architectures" \
    --durations=10 &&
    STEERGATE_TEST_REDIS=cluster "$PY" -m pytest tests/gateway -m "$CLUSTER and timed" \
      --durations=5
}

stream architectures "${idle[@]}" "$PY" -m pytest -m architectures -p no:cacheprovider \
  --durations=20 &
architectures=$!
stream engine "${idle[@]}" "$PY" -m pytest -m "engine and not architectures" \
  -p no:cacheprovider --durations=30 &
engine=$!
stream gateway gateway_suite
gateway=$?
wait "$architectures"
architectures=$?
wait "$engine"
engine=$?

stream timed timed_suite
timed=$?

echo "make test: exit status gateway $gateway, architectures $architectures, engine $engine," \
  "timed $timed"
[ "$gateway" -eq 0 ] && [ "$architectures" -eq 0 ] && [ "$engine" -eq 0 ] && [ "$timed" -eq 0 ]
