#!/usr/bin/env bash
# `make test`: the gateway's tests alone, then the engine tests as two streams side by
# side. Each line is prefixed with its part's name; the run fails if any part fails.
#
#   gateway        everything that serves no real vLLM engine, then the gateway suite
#                  again on a local Redis Cluster (issue 14), with nothing beside it: its
#                  time bounds (fault recovery, one tenant's latency under another's
#                  attack, concurrency slots freed in time) hold only on a quiet machine.
#   architectures  the architecture matrix (`-m architectures`: 15 engines, three
#                  starting at a time), beside
#   engine         every other test that serves a real vLLM engine. An engine start
#                  mostly waits (processes spawn and import, one core compiles), so this
#                  stream fills what the matrix leaves; their checks compare numbers, and
#                  bound no time of their own tightly.
#
# One after the other, the suite took 88 minutes of CI's 90 on a slow machine (stop 41).
# Running the gateway's tests beside the engines was tried and refused: each such run
# failed one timed test or another (a p95 under attack, leases stranded after a Redis
# hang, a concurrency slot freed late), at nice 19 and under SCHED_IDLE alike.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# Ctrl-C or CI's own limit stops every stream and what they started.
trap 'trap - INT TERM; kill 0' INT TERM

stream() {  # NAME COMMAND...: COMMAND's output, each line prefixed "[NAME] "
  local name=$1
  shift
  "$@" 2>&1 | sed -u "s/^/[$name] /"
  return "${PIPESTATUS[0]}"
}

gateway_suite() {
  "$PY" -m pytest -m "not engine and not architectures" --durations=40 &&
    STEERGATE_TEST_REDIS=cluster "$PY" -m pytest tests/gateway \
      -m "not engine and not browser and not faults and not own_redis" --durations=15
}

stream gateway gateway_suite
gateway=$?

# What both engine streams read, made before they start (neither builds it under the other).
"$PY" -c "from tests.harness import tiny_model_dir; tiny_model_dir()" || exit 1
stream architectures "$PY" -m pytest -m architectures -p no:cacheprovider --durations=20 &
architectures=$!
stream engine "$PY" -m pytest -m "engine and not architectures" -p no:cacheprovider \
  --durations=30
engine=$?
wait "$architectures"
architectures=$?

echo "make test: exit status gateway $gateway, architectures $architectures, engine $engine"
[ "$gateway" -eq 0 ] && [ "$architectures" -eq 0 ] && [ "$engine" -eq 0 ]
