#!/usr/bin/env bash
# Reproduces the runtime decision (docs/decisions/runtime.md): runs the spike
# server (bench-harness/src/bin/runtime_spike.rs) on each executor pinned to
# core 0, drives it with redis-benchmark pinned to core 1, and prints
# requests/s and server CPU microseconds per request (utime+stime from
# /proc/PID/stat). Needs `redis-tools` (apt-get install -y redis-tools).
# Usage: bench-harness/scripts/runtime-spike.sh [ROUNDS] [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS="${1:-2}"
N="${2:-200000}"
TARGET="${CARGO_TARGET_DIR:-target}"
cargo build --release -q -p shardline-bench --bin runtime_spike
BIN="$TARGET/release/runtime_spike"
CLK_TCK=$(getconf CLK_TCK)
PORT=16379
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
printf "%-13s %-5s %-6s %12s %14s\n" runtime round depth "req/s" "cpu_us/req"
for round in $(seq 1 "$ROUNDS"); do
  for rt in glommio monoio monoio-plain tokio; do
    PORT=$((PORT + 1))
    taskset -c 0 "$BIN" "$rt" "$PORT" &
    PID=$!
    for _ in $(seq 1 100); do
      (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break
      sleep 0.05
    done
    for depth in 1 16; do
      n=$N
      [ "$depth" = 16 ] && n=$((N * 5))
      before=$(cpu_ticks "$PID")
      out=$(taskset -c 1 redis-benchmark -p "$PORT" -t ping_inline -c 50 -P "$depth" -n "$n" -q 2>/dev/null | tr '\r' '\n' | grep "requests per second" | tail -1)
      after=$(cpu_ticks "$PID")
      rps=$(echo "$out" | sed -E 's/.*: ([0-9.]+) requests per second.*/\1/')
      cpu_us=$(awk -v a="$after" -v b="$before" -v n="$n" -v t="$CLK_TCK" 'BEGIN{printf "%.2f", (a-b)*1e6/t/n}')
      printf "%-13s %-5s %-6s %12s %14s\n" "$rt" "$round" "$depth" "$rps" "$cpu_us"
    done
    kill "$PID"; wait "$PID" 2>/dev/null || true
  done
done
