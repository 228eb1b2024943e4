#!/usr/bin/env bash
# Side-by-side benchmark on one machine, one Redis, one load, one key set:
# ratelimitd (Redis store, in-memory store) and Kuadrant's limitador-server
# (Redis, memory), both driven through Envoy's ShouldRateLimit by
# `loadtest`, plus the ceiling of ratelimitd's Redis script alone
# (redis-benchmark). Prints a markdown table and the ratios.
#
#   LIMITADOR_DIR=/path/to/limitador loadtest/bench.sh
#
# LIMITADOR_DIR: a checkout of Kuadrant/limitador OUTSIDE this repository,
# built with `cargo build --release -p limitador-server` (never vendored;
# it needs libclang and protoc: PROTOC can point at the protoc that this
# project's build fetched with protoc-bin-vendored).
# DURATION (s, default 10), CONCURRENCY (default 64), KEYS (default hot),
# CONNECTIONS (default 4) tune the load.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${LIMITADOR_DIR:?set LIMITADOR_DIR to a built Kuadrant/limitador checkout}"
LIMITADOR="$LIMITADOR_DIR/target/release/limitador-server"
[ -x "$LIMITADOR" ] || { echo "bench: $LIMITADOR not built (cargo build --release -p limitador-server)" >&2; exit 1; }
DURATION="${DURATION:-10}"
CONCURRENCY="${CONCURRENCY:-64}"
KEYS="${KEYS:-hot}"
CONNECTIONS="${CONNECTIONS:-4}"

cargo build --release --locked -p ratelimitd -p loadtest >&2
RATELIMITD="$PWD/target/release/ratelimitd"
LOADTEST="$PWD/target/release/loadtest"
# shellcheck source=loadtest/common.sh
source loadtest/common.sh  # the script runs from the repository root (cd above)

# One Redis for everyone, flushed between runs.
REDIS_PORT="$(free_port)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes --pidfile "$WORK/redis.pid" >/dev/null
wait_port "$REDIS_PORT"
PIDS+=("$(cat "$WORK/redis.pid")")
REDIS_URL="redis://127.0.0.1:$REDIS_PORT"

# The same limit for both: domain/namespace "edge", a counter per user, far
# above what the load reaches (every decision is counted, none denied).
write_edge_config "$WORK/envoy"
echo "rules: []" > "$WORK/native.yaml"
cat > "$WORK/limits.yaml" <<'YAML'
- namespace: edge
  max_value: 1000000000
  seconds: 60
  conditions: []
  variables:
    - descriptors[0]['user']
YAML

run() { # label, then the command starting the target on $PORT
  local label="$1"; shift
  redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
  "$@" >"$WORK/$label.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  wait_port "$PORT"
  sleep 0.5
  "$LOADTEST" --target "http://127.0.0.1:$PORT" --api envoy --domain edge --keys "$KEYS" \
    --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --duration "$DURATION" \
    --target-pid "$pid" --label "$label" --json "$WORK/$label.json" 2>/dev/null >&2
  # Then open loop at half the throughput just measured: latency from each
  # request's intended send time, so queueing is not hidden.
  local half
  half="$(python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["decisions_per_second"] / 2))' "$WORK/$label.json")"
  "$LOADTEST" --target "http://127.0.0.1:$PORT" --api envoy --domain edge --keys "$KEYS" \
    --rate "$half" --connections "$CONNECTIONS" --duration "$DURATION" \
    --target-pid "$pid" --label "$label-half" --json "$WORK/$label-half.json" 2>/dev/null >&2
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

ratelimitd_env() {
  # exec: the measured PID must be the service's, not a wrapper's.
  exec env RATELIMITD__GRPC__LISTEN="127.0.0.1:$PORT" RATELIMITD__HTTP__LISTEN="127.0.0.1:$(free_port)" \
    RATELIMITD__RULES__PATH="$WORK/native.yaml" RATELIMITD__RULES__ENVOY_PATH="$WORK/envoy" \
    RATELIMITD__SHED__MODE=off RATELIMITD__DLQ__FILE="$WORK/dlq.jsonl" RUST_LOG=warn "$@"
}

PORT="$(free_port)"; run ratelimitd-redis ratelimitd_env RATELIMITD__REDIS__URL="$REDIS_URL" "$RATELIMITD" serve
PORT="$(free_port)"; run ratelimitd-memory ratelimitd_env "$RATELIMITD" serve
PORT="$(free_port)"; run limitador-redis "$LIMITADOR" --rls-port "$PORT" --http-port "$(free_port)" "$WORK/limits.yaml" redis "$REDIS_URL"
PORT="$(free_port)"; run limitador-memory "$LIMITADOR" --rls-port "$PORT" --http-port "$(free_port)" "$WORK/limits.yaml" memory

# The ceiling of our script alone: redis-benchmark calling it with one
# decision per call (one job of one key: the same key, window, limit and
# flags as the load above), from as many clients as the load has callers.
# ratelimitd itself sends what queued during the previous call as one call,
# so it can pass this figure: the ratio shows what coalescing buys.
SHA="$(redis-cli -p "$REDIS_PORT" SCRIPT LOAD "$(cat src/limiter/scripts/decide_batch.lua)")"
CEILING="$(redis-benchmark -p "$REDIS_PORT" -c "$CONCURRENCY" -n 500000 -q \
  EVALSHA "$SHA" 1 'rle2:{edge}:60|user=user-0' 1 60000 1000000000 1 0 1000000000 1 1 1 1 | tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1 | cut -d' ' -f1)"

python3 - "$WORK" "$CEILING" "$DURATION" "$CONCURRENCY" "$KEYS" <<'PY'
import json, sys
work, ceiling, duration, concurrency, keys = sys.argv[1], float(sys.argv[2]), *sys.argv[3:]
r = {l: json.load(open(f"{work}/{l}.json")) for l in ["ratelimitd-redis", "ratelimitd-memory", "limitador-redis", "limitador-memory"]}
h = {l: json.load(open(f"{work}/{l}-half.json")) for l in r}
print(f"Load: loadtest, ShouldRateLimit, closed loop, {concurrency} callers, keys {keys}, {duration} s each, then open loop at half that throughput for {duration} s; one Redis; 2 cores shared with the load generator.\n")
print("| target | decisions/s | target CPU µs/decision | p50 ms | p99 ms | errors | p99 ms at half saturation (rate) |")
print("|---|---|---|---|---|---|---|")
for label, x in r.items():
    lat, half = x["latency"], h[label]
    errors = sum(x["errors"].values()) + sum(half["errors"].values())
    print(f"| {label} | {x['decisions_per_second']:.0f} | {x['target_cpu_us_per_decision']:.1f} | {lat['p50_us']/1e3:.2f} | {lat['p99_us']/1e3:.2f} | {errors} | {half['latency']['p99_us']/1e3:.3f} ({half['decisions_per_second']:.0f}/s) |")
print(f"| redis-benchmark, our script alone (one decision per call) | {ceiling:.0f} | | | | | |\n")
rr, rm, lr, lm = (r[k] for k in ["ratelimitd-redis", "ratelimitd-memory", "limitador-redis", "limitador-memory"])
rows = [
    ("decisions/s, Redis store, vs limitador with Redis", rr["decisions_per_second"] / lr["decisions_per_second"], ">= 4x"),
    ("CPU per decision, Redis store, vs limitador with Redis", rr["target_cpu_us_per_decision"] / lr["target_cpu_us_per_decision"], "<= 0.25x"),
    ("decisions/s, in-memory store, vs limitador in memory", rm["decisions_per_second"] / lm["decisions_per_second"], ">= 1.5x"),
    ("decisions/s, Redis store, vs redis-benchmark running our script", rr["decisions_per_second"] / ceiling, ">= 0.8x"),
]
absolute = [
    ("p99 at half saturation, Redis store", h["ratelimitd-redis"]["latency"]["p99_us"] / 1e3, "<= 1 ms"),
    ("p99 at half saturation, in-memory store", h["ratelimitd-memory"]["latency"]["p99_us"] / 1e3, "<= 0.25 ms"),
]
print("| measure | measured | target |")
print("|---|---|---|")
for name, value, target in rows:
    print(f"| {name} | {value:.2f}x | {target} |")
for name, value, target in absolute:
    print(f"| {name} | {value:.3f} ms | {target} |")
PY
