#!/usr/bin/env bash
# Counts the instructions redis-server spends per 5-limit reserve (steady:
# subjects whose blobs exist; first touch: a new subject each), per 1-limit
# reserve, per 5-limit settle (a correction above the estimate, and one
# below it), per reserve in batches of 16 and 64, per settle in batches of 64,
# per empty FCALL and per INCR by running it
# under callgrind (valgrind): figures that repeat within a few percent on a
# noisy machine, unlike timings. Usage: bench/callgrind.sh
# (QF_CALLGRIND_USERS=n spreads the steady reserves over n subjects;
# QF_CALLGRIND_KEEP=dir keeps the dumps there for callgrind_annotate;
# QF_REDIS_SERVER=path runs that redis-server instead of the one on PATH:
# one built with symbols lets callgrind_annotate name Redis's and Lua's
# functions, which the packaged binary's stripped ones do not;
# QF_CALLGRIND_IN=call counts only inside Redis's call(), a command's
# execution: without reading, parsing and replying, nor the timer's work,
# which grows with the wall time a run takes on a loaded machine;
# QF_CALLGRIND_CALLS=n measures n calls per figure, a multiple of 64,
# instead of 2048: quicker, for trying changes;
# QF_CALLGRIND_TEST=TestCallgrindCount measures ShouldRateLimit's counters
# instead, QF_CALLGRIND_TEST=TestCallgrindShapes a one-limit counter of the
# HTTP admit beside ShouldRateLimit's).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
dir=$(mktemp -d)
port=$(( 20000 + RANDOM % 20000 ))
only=()
[ -n "${QF_CALLGRIND_IN:-}" ] && only=(--collect-atstart=no "--toggle-collect=$QF_CALLGRIND_IN")
valgrind --tool=callgrind "${only[@]}" --callgrind-out-file="$dir/out.%p" \
  "${QF_REDIS_SERVER:-redis-server}" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" >"$dir/valgrind.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
# the server's pid: callgrind_control without one would also zero and dump
# any other callgrind on the machine
QF_CALLGRIND_ADDR=127.0.0.1:$port QF_CALLGRIND_DIR=$dir QF_CALLGRIND_PID=$server \
  go test -count=1 -timeout 60m -run "${QF_CALLGRIND_TEST:-TestCallgrindInstructions}" -v ./pkg/limits/ | grep -E 'callgrind|FAIL|ok|_test.go'
