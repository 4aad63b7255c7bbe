#!/usr/bin/env bash
# A/B of two builds of the node on the native request path: echo and counter
# add through `shardline-bench run`, closed loop, 50 connections, depth
# DEPTH (default 16), 10,000 entities, DURATION s (default 10) per run,
# ROUNDS rounds (default 3) alternating A and B on the same machine, a
# one-data-core node (durability "none") on CPU 0 and the load on CPU 1.
# Prints per run req/s, p50/p99 and the server's CPU per request in µs
# (utime + stime from /proc/PID/stat over the run / requests), and the
# 1-minute load average.
#
# Usage: bench-harness/scripts/node-ab.sh DIR_A DIR_B
#   each DIR holds a `shardline` binary (e.g. target/release of two builds
#   with CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16);
#   the load generator is DIR_B/shardline-bench. Run it in a network
#   namespace when others use the machine: it binds 127.0.0.1:17102/17202.
set -euo pipefail
A=${1:?usage: node-ab.sh DIR_A DIR_B}; B=${2:?usage: node-ab.sh DIR_A DIR_B}
ROUNDS=${ROUNDS:-3}; DURATION=${DURATION:-10}; DEPTH=${DEPTH:-16}; CONNS=50; KEYS=10000
WORK=$(mktemp -d /tmp/node-ab.XXXXXX)
CLK_TCK=$(getconf CLK_TCK)
BENCH=$B/shardline-bench
sl_pid=""
stop_node() { if [ -n "$sl_pid" ]; then kill "$sl_pid" 2>/dev/null || true; wait "$sl_pid" 2>/dev/null || true; sl_pid=""; fi; }
trap 'stop_node; rm -rf "$WORK"' EXIT
start_node() {
  rm -rf "$WORK/node"
  cat > "$WORK/node.toml" <<TOML
cluster_address  = "127.0.0.1:17102"
client_address   = "127.0.0.1:17202"
seed_nodes       = ["127.0.0.1:17102"]
data_cores       = 1
pin_cores        = false
data_dir         = "$WORK/node"
number_of_shards = 100
durability       = "none"
[[entity_types]]
name = "echo"
kind = "echo"
idle_timeout_ms = 0
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
TOML
  taskset -c 0 "$1" node --config "$WORK/node.toml" > "$WORK/node.out" 2> "$WORK/node.err" &
  sl_pid=$!
  for _ in $(seq 1 300); do grep -q "shardline: ready" "$WORK/node.out" 2>/dev/null && break; kill -0 $sl_pid 2>/dev/null || { echo "node exited"; cat "$WORK/node.out" "$WORK/node.err"; exit 1; }; sleep 0.1; done
  grep -q "shardline: ready" "$WORK/node.out" || { echo "node not ready"; cat "$WORK/node.err"; exit 1; }
  taskset -c 1 "$BENCH" run --connect 127.0.0.1:17202 --op counter-add --connections $CONNS --pipeline 16 --entities $KEYS --duration 3s --no-progress > /dev/null 2>&1
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
run() {
  local c0 c1 j=$WORK/run.json
  c0=$(cpu_ticks "$sl_pid")
  taskset -c 1 "$BENCH" run --connect 127.0.0.1:17202 --op "$1" --connections $CONNS --pipeline $DEPTH --entities $KEYS --duration "${DURATION}s" --no-progress --json "$j" > "$WORK/bench.out" 2>&1
  c1=$(cpu_ticks "$sl_pid")
  python3 - "$j" <<'PY' | awk -v a="$c0" -v b="$c1" -v hz="$CLK_TCK" '{printf "%s %s %s %.2f %s\n", $1, $2, $3, (b - a) * 1e6 / hz / $4, $5}'
import json, sys
j = json.load(open(sys.argv[1])); l = j["latency"]
print(round(j["throughput_per_s"]), l["p50_us"], l["p99_us"], max(1, j["ok"] + j["errors"]), j["errors"])
PY
}
printf '%-8s %-12s %5s %10s %8s %8s %11s %6s %s\n' variant op round req/s p50_us p99_us cpu_us/req errors load1
for r in $(seq 1 $ROUNDS); do
  for v in A B; do
    if [ "$v" = A ]; then dir=$A; else dir=$B; fi
    stop_node; start_node "$dir/shardline"
    for op in echo counter-add; do
      read -r rps p50 p99 cpu errs < <(run $op)
      printf '%-8s %-12s %5s %10s %8s %8s %11s %6s %s\n' $v $op $r $rps $p50 $p99 $cpu $errs "$(cut -d' ' -f1 /proc/loadavg)"
    done
  done
done
