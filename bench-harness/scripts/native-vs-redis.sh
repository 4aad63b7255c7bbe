#!/usr/bin/env bash
# Native protocol vs redis: a Shardline node with one data core and a
# redis-server (no persistence), both pinned to the same core, are driven
# alternately from another core with the same shape of load: 50
# connections, closed loop, depth (requests per batch on each connection) 1
# and 16, over 10,000 keys, for ROUNDS rounds.
#
#   counter add  (shardline-bench pipelined --op counter-add)  vs  redis INCR
#   counter get  (shardline-bench pipelined --op counter-get)  vs  redis GET
#   echo         (shardline-bench pipelined --op echo)         vs  redis ECHO
#
# `shardline-bench pipelined` is a client in redis-benchmark's shape: one
# event loop over the connections, each writing a batch of DEPTH requests
# and waiting for their replies. CLIENTS="pipelined run" also drives the
# node with `shardline-bench run` (a writer and a reader thread per
# connection, sliding window): its sleeping reader threads make the node
# pay a thread wake-up per reply, so its CPU per request is higher for a
# reason that is the client's, and is shown apart as "shardline(DUR,run)".
#
# For each run it prints req/s, p50/p99 (HdrHistogram in shardline-bench,
# redis-benchmark's own percentiles for redis) and the server's CPU per
# request in microseconds (utime + stime of the server process from
# /proc/PID/stat over the run, divided by the requests served: less
# sensitive to a shared machine than req/s). Then the medians of the rounds
# and the ratios Shardline/redis. Targets (issue "the data path"): CPU per
# counter add <= 1.0x INCR at depth 16 and <= 1.2x at depth 1 with
# durability "none".
#
# Usage: bench-harness/scripts/native-vs-redis.sh [ROUNDS] [DURATION_S]
#   DURABILITIES="none always interval:5" (default "none") also runs the
#   Shardline side with those durabilities (interval:N is N ms group commit).
# Installs redis (redis-server, redis-benchmark) from Debian when missing.
# Builds the binaries with the release profile as it is set (LTO on), under
# CARGO_TARGET_DIR when set; several figures in docs/node.md were measured
# with LTO off (CARGO_PROFILE_RELEASE_LTO=false
# CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16) and say so.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
DURATION=${2:-10}
DURABILITIES=${DURABILITIES:-none}
CLIENTS=${CLIENTS:-pipelined}
CONNS=50
KEYS=10000
SERVER_CORE=0
LOAD_CORE=$(( $(nproc) > 1 ? 1 : 0 ))
PORT_REDIS=17479
WORK=$(mktemp -d /tmp/native-vs-redis.XXXXXX)

if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
  echo "installing: redis-server redis-tools"
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq redis-server redis-tools >/dev/null
fi

target_dir=${CARGO_TARGET_DIR:-target}
cargo build --release -q --workspace --bins
SL="$target_dir/release/shardline"
BENCH="$target_dir/release/shardline-bench"

sl_pid=""
redis_pid=""
stop_node() {
  if [ -n "$sl_pid" ]; then
    kill "$sl_pid" 2>/dev/null || true
    wait "$sl_pid" 2>/dev/null || true
    sl_pid=""
  fi
}
cleanup() {
  stop_node
  [ -n "$redis_pid" ] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# start_node DURABILITY: a one-data-core node on SERVER_CORE; sets sl_pid.
start_node() {
  local dur=$1 toml_dur
  case "$dur" in
    none | always) toml_dur="\"$dur\"" ;;
    interval:*) toml_dur="{ interval_ms = ${dur#interval:} }" ;;
    *) echo "unknown durability $dur" >&2; exit 2 ;;
  esac
  rm -rf "$WORK/node"
  cat > "$WORK/node.toml" <<TOML
cluster_address  = "127.0.0.1:17102"
client_address   = "127.0.0.1:17202"
seed_nodes       = ["127.0.0.1:17102"]
data_cores       = 1
pin_cores        = false
data_dir         = "$WORK/node"
number_of_shards = 100
durability       = $toml_dur
[[entity_types]]
name = "echo"
kind = "echo"
idle_timeout_ms = 0
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
TOML
  taskset -c $SERVER_CORE "$SL" node --config "$WORK/node.toml" > "$WORK/node.out" 2> "$WORK/node.err" &
  sl_pid=$!
  for _ in $(seq 1 300); do
    grep -q "shardline: ready" "$WORK/node.out" 2>/dev/null && break
    kill -0 $sl_pid 2>/dev/null || { cat "$WORK/node.err"; exit 1; }
    sleep 0.1
  done
  grep -q "shardline: ready" "$WORK/node.out" || { echo "node not ready"; cat "$WORK/node.err"; exit 1; }
}

taskset -c $SERVER_CORE redis-server --port $PORT_REDIS --bind 127.0.0.1 --save "" \
  --appendonly no --protected-mode no --daemonize no > "$WORK/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 1 50); do
  redis-cli -p $PORT_REDIS ping >/dev/null 2>&1 && break
  sleep 0.1
done

CLK_TCK=$(getconf CLK_TCK)
# cpu_ticks PID: utime + stime of the process (all its threads), in ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# sl_run CLIENT OP DEPTH: prints "rps p50_us p99_us cpu_us_per_request errors".
sl_run() {
  local c0 c1 j=$WORK/run.json
  c0=$(cpu_ticks "$sl_pid")
  if [ "$1" = run ]; then
    taskset -c $LOAD_CORE "$BENCH" run --connect "127.0.0.1:17202" --op "$2" \
      --connections $CONNS --pipeline "$3" --entities $KEYS --duration "${DURATION}s" \
      --no-progress --json "$j" > "$WORK/bench.out" 2>&1
  else
    taskset -c $LOAD_CORE "$BENCH" pipelined --connect "127.0.0.1:17202" --op "$2" \
      --connections $CONNS --pipeline "$3" --entities $KEYS --duration "${DURATION}s" \
      --json "$j" > "$WORK/bench.out" 2>&1
  fi
  c1=$(cpu_ticks "$sl_pid")
  python3 - "$j" <<'PY' | awk -v a="$c0" -v b="$c1" -v hz="$CLK_TCK" \
    '{printf "%s %s %s %.2f %s\n", $1, $2, $3, (b - a) * 1e6 / hz / $4, $5}'
import json, sys
j = json.load(open(sys.argv[1]))
l = j["latency"]
print(round(j["throughput_per_s"]), l["p50_us"], l["p99_us"], max(1, j["ok"] + j["errors"]), j["errors"])
PY
}

# redis_run CMD DEPTH: prints "rps p50_us p99_us cpu_us_per_request errors".
redis_run() {
  local c0 c1 out n
  # About DURATION seconds of requests at the last measured rate.
  n=${REDIS_N:-$(( DURATION * 150000 ))}
  [ "$2" -gt 1 ] && n=$(( n * 6 ))
  c0=$(cpu_ticks "$redis_pid")
  # shellcheck disable=SC2086
  out=$(taskset -c $LOAD_CORE redis-benchmark -p $PORT_REDIS -c $CONNS -P "$2" -n "$n" \
    -r $KEYS --csv $1)
  c1=$(cpu_ticks "$redis_pid")
  # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
  awk -F'","' -v a="$c0" -v b="$c1" -v hz="$CLK_TCK" -v n="$n" 'NR == 2 {
    gsub(/"/, "", $0); split($0, f, ",");
    printf "%.0f %.0f %.0f %.2f 0\n", f[2], f[5] * 1000, f[7] * 1000, (b - a) * 1e6 / hz / n }' <<<"$out"
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

declare -A RPS CPU P50 P99
# sl_key DURABILITY CLIENT: the row name of a Shardline run.
sl_key() { if [ "$2" = pipelined ]; then echo "shardline($1)"; else echo "shardline($1,$2)"; fi; }
redis_cmd() {
  case "$1" in
    counter-add) echo "INCR counter:__rand_int__" ;;
    counter-get) echo "GET counter:__rand_int__" ;;
    echo) echo "ECHO hello" ;;
  esac
}

# Seed redis' keys so that GET finds values (as the counters get theirs).
redis-benchmark -p $PORT_REDIS -c $CONNS -P 16 -n $(( KEYS * 20 )) -r $KEYS -q INCR counter:__rand_int__ >/dev/null

printf '%-40s %5s %10s %9s %9s %11s %7s\n' "run" "round" "req/s" "p50_us" "p99_us" "cpu_us/req" "errors"
for dur in $DURABILITIES; do
  stop_node
  start_node "$dur"
  # Warm-up (not recorded): every counter activated, shard homes cached.
  taskset -c $LOAD_CORE "$BENCH" run --connect "127.0.0.1:17202" --op counter-add --connections $CONNS \
    --pipeline 16 --entities $KEYS --duration 3s --no-progress > /dev/null 2>&1
  for r in $(seq 1 "$ROUNDS"); do
    for depth in 1 16; do
      for op in counter-add counter-get echo; do
        # redis once per round and depth (not per durability)
        if [ "$dur" = "$(echo $DURABILITIES | awk '{print $1}')" ]; then
          read -r rps p50 p99 cpu errs < <(redis_run "$(redis_cmd $op)" "$depth")
          k="redis $op d$depth"
          printf '%-40s %5s %10s %9s %9s %11s %7s\n' "$k" "$r" "$rps" "$p50" "$p99" "$cpu" "$errs"
          RPS[$k]="${RPS[$k]:-} $rps"; CPU[$k]="${CPU[$k]:-} $cpu"
          P50[$k]="${P50[$k]:-} $p50"; P99[$k]="${P99[$k]:-} $p99"
        fi
        for client in $CLIENTS; do
          read -r rps p50 p99 cpu errs < <(sl_run "$client" "$op" "$depth")
          k="$(sl_key "$dur" "$client") $op d$depth"
          printf '%-40s %5s %10s %9s %9s %11s %7s\n' "$k" "$r" "$rps" "$p50" "$p99" "$cpu" "$errs"
          RPS[$k]="${RPS[$k]:-} $rps"; CPU[$k]="${CPU[$k]:-} $cpu"
          P50[$k]="${P50[$k]:-} $p50"; P99[$k]="${P99[$k]:-} $p99"
        done
      done
    done
  done
done

echo
echo "medians of $ROUNDS rounds; ratio = shardline / redis (CPU: lower is better; req/s: higher is better)"
printf '%-40s %10s %9s %9s %11s %10s %10s\n' "run" "req/s" "p50_us" "p99_us" "cpu_us/req" "cpu_ratio" "rps_ratio"
for dur in $DURABILITIES; do
  for depth in 1 16; do
    for op in counter-add counter-get echo; do
      rk="redis $op d$depth"
      sks=()
      for client in $CLIENTS; do sks+=("$(sl_key "$dur" "$client") $op d$depth"); done
      for k in "$rk" "${sks[@]}"; do
        [ "$k" = "$rk" ] && [ "$dur" != "$(echo $DURABILITIES | awk '{print $1}')" ] && continue
        rps=$(echo "${RPS[$k]}" | median); cpu=$(echo "${CPU[$k]}" | median)
        p50=$(echo "${P50[$k]}" | median); p99=$(echo "${P99[$k]}" | median)
        if [ "$k" != "$rk" ]; then
          rc=$(echo "${CPU[$rk]}" | median); rr=$(echo "${RPS[$rk]}" | median)
          printf '%-40s %10.0f %9.0f %9.0f %11.2f %10.2f %10.2f\n' "$k" "$rps" "$p50" "$p99" "$cpu" \
            "$(awk -v s="$cpu" -v r="$rc" 'BEGIN {print s / r}')" "$(awk -v s="$rps" -v r="$rr" 'BEGIN {print s / r}')"
        else
          printf '%-40s %10.0f %9.0f %9.0f %11.2f\n' "$k" "$rps" "$p50" "$p99" "$cpu"
        fi
      done
    done
  done
done
echo "targets: counter add CPU ratio <= 1.2 at d1 and <= 1.0 at d16 (durability none)"
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), rev $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
