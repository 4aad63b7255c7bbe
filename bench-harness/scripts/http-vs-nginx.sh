#!/usr/bin/env bash
# HTTP front vs nginx: a Shardline node with one data core and nginx with one
# worker (`return 200` with a small body), both pinned to the same core, are
# driven alternately by the same wrk settings (one thread pinned to another
# core, 50 connections, 10 s, --latency), for ROUNDS rounds. Prints req/s,
# p50 and p99 for each run and the ratio Shardline/nginx (req/s, median of
# the rounds) for the echo route and for a counter get. Target: >= 0.8.
#
# Usage: bench-harness/scripts/http-vs-nginx.sh [ROUNDS] [DURATION_S]
# Installs wrk and nginx from Debian (apt-get) when missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
DURATION=${2:-10}
CONNS=50
SERVER_CORE=0
WRK_CORE=$(( $(nproc) > 1 ? 1 : 0 ))
PORT_SL=17301
PORT_NGINX=17380
WORK=$(mktemp -d /tmp/http-vs-nginx.XXXXXX)

need=""
command -v wrk >/dev/null || need="$need wrk"
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need="$need nginx"
if [ -n "$need" ]; then
  echo "installing:$need"
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq $need >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

target_dir=${CARGO_TARGET_DIR:-target}
cargo build --release -q -p shardline --bin shardline
SL="$target_dir/release/shardline"

sl_pid=""
ngx_pid=""
cleanup() {
  [ -n "$sl_pid" ] && kill "$sl_pid" 2>/dev/null && wait "$sl_pid" 2>/dev/null || true
  [ -n "$ngx_pid" ] && kill "$ngx_pid" 2>/dev/null && wait "$ngx_pid" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# ---- the Shardline node: one data core, everything on SERVER_CORE ----
cat > "$WORK/node.toml" <<TOML
cluster_address  = "127.0.0.1:17101"
client_address   = "127.0.0.1:17201"
http_address     = "127.0.0.1:$PORT_SL"
seed_nodes       = ["127.0.0.1:17101"]
data_cores       = 1
pin_cores        = false
data_dir         = "$WORK/node"
number_of_shards = 100
durability       = "none"
[[entity_types]]
name = "echo"
kind = "echo"
[[entity_types]]
name = "counter"
kind = "counter"
TOML
taskset -c $SERVER_CORE "$SL" node --config "$WORK/node.toml" > "$WORK/node.out" 2> "$WORK/node.err" &
sl_pid=$!
for _ in $(seq 1 300); do
  grep -q "shardline: ready" "$WORK/node.out" 2>/dev/null && break
  kill -0 $sl_pid 2>/dev/null || { cat "$WORK/node.err"; exit 1; }
  sleep 0.1
done
grep -q "shardline: ready" "$WORK/node.out" || { echo "node not ready"; cat "$WORK/node.err"; exit 1; }
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$PORT_SL/health/ready" >/dev/null && break
  sleep 0.1
done

# ---- nginx: one worker, return 200 with a small body ----
mkdir -p "$WORK/nginx"
cat > "$WORK/nginx/nginx.conf" <<NGX
worker_processes 1;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  server {
    listen 127.0.0.1:$PORT_NGINX reuseport;
    keepalive_requests 100000000;
    location / { return 200 "hello"; }
  }
}
NGX
taskset -c $SERVER_CORE "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" 2> "$WORK/nginx/stderr" &
ngx_pid=$!
for _ in $(seq 1 50); do
  curl -sf "http://127.0.0.1:$PORT_NGINX/" >/dev/null && break
  sleep 0.1
done

# ---- wrk scripts: the same POST for both servers ----
cat > "$WORK/echo.lua" <<'LUA'
wrk.method = "POST"
wrk.body = "hello"
LUA
cat > "$WORK/get.lua" <<'LUA'
wrk.method = "POST"
wrk.body = "get"
LUA
curl -sf -d 'add 1' "http://127.0.0.1:$PORT_SL/v1/entities/counter/bench" >/dev/null

# to_us VALUE: wrk latency ("812.00us", "1.23ms", "1.01s") in microseconds.
to_us() {
  awk -v v="$1" 'BEGIN {
    n = v + 0
    if (v ~ /us$/) print n; else if (v ~ /ms$/) print n * 1000;
    else if (v ~ /m$/) print n * 60000000; else if (v ~ /s$/) print n * 1000000; else print n }'
}

CLK_TCK=$(getconf CLK_TCK)
# cpu_ticks PID: utime + stime of the process (all its threads), in ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# run NAME URL LUA PID: one wrk run; prints "rps p50_us p99_us cpu_us_per_request"
# (server CPU from /proc/PID/stat, less sensitive to a loaded machine than req/s).
run() {
  local out c0 c1
  c0=$(cpu_ticks "$4")
  out=$(taskset -c $WRK_CORE wrk -t1 -c$CONNS -d${DURATION}s --latency -s "$3" "$2")
  c1=$(cpu_ticks "$4")
  local rps p50 p99 errs reqs cpu
  reqs=$(awk '/requests in/ {print $1}' <<<"$out")
  cpu=$(awk -v a="$c0" -v b="$c1" -v n="$reqs" -v hz="$CLK_TCK" 'BEGIN {printf "%.2f", (b - a) * 1e6 / hz / n}')
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
  p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
  errs=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' <<<"$out")
  if [ -n "$errs" ]; then
    echo "warning: $1: $errs non-2xx responses" >&2
  fi
  echo "$rps $(to_us "$p50") $(to_us "$p99") $cpu"
}

# Warm-up (not recorded): entities activated, shard homes cached, caches warm.
for url in "http://127.0.0.1:$PORT_SL/v1/entities/echo/bench" "http://127.0.0.1:$PORT_SL/v1/entities/counter/bench" "http://127.0.0.1:$PORT_NGINX/"; do
  taskset -c $WRK_CORE wrk -t1 -c$CONNS -d2s -s "$WORK/get.lua" "$url" >/dev/null
done
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"

declare -A RPS
ngx_worker=$(pgrep -P "$ngx_pid" | head -1)
[ -n "$ngx_worker" ] || ngx_worker=$ngx_pid
declare -A CPU
printf '%-22s %5s %12s %10s %10s %12s\n' "run" "round" "req/s" "p50_us" "p99_us" "cpu_us/req"
for r in $(seq 1 "$ROUNDS"); do
  for case in echo get; do
    for server in shardline nginx; do
      if [ "$server" = shardline ]; then pid=$sl_pid; else pid=$ngx_worker; fi
      if [ "$server" = shardline ]; then
        if [ "$case" = echo ]; then url="http://127.0.0.1:$PORT_SL/v1/entities/echo/bench"
        else url="http://127.0.0.1:$PORT_SL/v1/entities/counter/bench"; fi
      else
        url="http://127.0.0.1:$PORT_NGINX/"
      fi
      read -r rps p50 p99 cpu < <(run "$server-$case" "$url" "$WORK/$case.lua" "$pid")
      printf '%-22s %5s %12.0f %10.0f %10.0f %12s\n' "$server-$case" "$r" "$rps" "$p50" "$p99" "$cpu"
      RPS[$server-$case]="${RPS[$server-$case]:-} $rps"
      CPU[$server-$case]="${CPU[$server-$case]:-} $cpu"
    done
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo
for case in echo get; do
  s=$(echo "${RPS[shardline-$case]}" | median)
  n=$(echo "${RPS[nginx-$case]}" | median)
  ratio=$(awk -v s="$s" -v n="$n" 'BEGIN {printf "%.3f", s / n}')
  label=$([ "$case" = echo ] && echo "echo route" || echo "counter get")
  printf 'ratio shardline/nginx (%s, median req/s %.0f / %.0f): %s (target >= 0.8)\n' "$label" "$s" "$n" "$ratio"
  sc=$(echo "${CPU[shardline-$case]}" | median)
  nc=$(echo "${CPU[nginx-$case]}" | median)
  printf '  server CPU per request (%s, median): shardline %.2f us, nginx %.2f us, nginx/shardline %.3f\n' \
    "$label" "$sc" "$nc" "$(awk -v s="$sc" -v n="$nc" 'BEGIN {printf "%.3f", n / s}')"
done
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), rev $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
