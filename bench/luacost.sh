#!/usr/bin/env bash
# Counts the instructions Redis spends on one Lua operation: each FILE is
# Lua setup code, a line "-- body", then the operation; the script runs
# the operation N times (default 1000) in one EVAL on a redis-server under
# callgrind, and an empty loop after the same setup, and prints the
# difference per run, counted inside Redis's call() only. For the engine's
# unit costs (bench/results.md: what a string, a pack, a SET cost).
# bench/luacost/*.lua are the ones bench/results.md cites.
# Usage: N=1000 bench/luacost.sh FILE... (QF_REDIS_SERVER=path: that
# redis-server, as bench/callgrind.sh takes it)
set -euo pipefail
command -v valgrind >/dev/null || { echo "luacost.sh: valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
dir=$(mktemp -d)
port=$(( 20000 + RANDOM % 20000 ))
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=call --callgrind-out-file="$dir/out.%p" \
  "${QF_REDIS_SERVER:-redis-server}" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" >"$dir/valgrind.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
# measure prints the instructions of one EVAL of $1 (callgrind_control is
# given the pid: without it, it would zero and dump every callgrind on the host)
measure() {
  rm -f "$dir"/out.*.*
  callgrind_control -z "$server" >/dev/null
  redis-cli -p "$port" eval "$1" 0 >/dev/null
  callgrind_control -d "$server" >/dev/null
  grep '^summary:' "$dir"/out.*.* | awk '{print $2}'
}
n=${N:-1000}
for f in "$@"; do
  setup=$(sed -n '1,/^-- body/p' "$f")
  body=$(sed -n '/^-- body/,$p' "$f")
  empty="$setup
for i = 1, $n do end return 1"
  measure "$empty" >/dev/null # the first EVAL of a script also compiles it
  base=$(measure "$empty")
  full="$setup
for i = 1, $n do
$body
end return 1"
  measure "$full" >/dev/null
  echo "$f: $(( ($(measure "$full") - base) / n )) instructions per run"
done
