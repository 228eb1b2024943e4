#!/usr/bin/env bash
# What a decision costs at the rates users run: open loop at each of RATES
# and closed loop (saturation), one target after the other in one run,
# each on one Redis (or in memory): the target's CPU time (and its system part), context
# switches and CPU migrations per decision (all its threads, from
# /proc/PID), its throughput and latency.
#
#   loadtest/rates.sh OUTDIR
#
# Targets: ratelimitd serving Envoy rules (domain edge, a counter per
# user), and with LIMITADOR (a limitador-server built outside this
# repository) limitador-server and ratelimitd started as limitador-server,
# each with the same command line and limits file; with BASELINE (another
# ratelimitd build) that build first, the same way. API (envoy: the Envoy
# API, ShouldRateLimit; check: Check, unary; stream: CheckStream, closed
# loop only) for the first target; the limitador pair answers
# ShouldRateLimit. STORE (redis, memory), RATES (default "2000 5000
# 10000"), CONCURRENCY (callers of the closed loop, 64), CONNECTIONS (4),
# USERS (users uniform, 10000), DURATION (s per run, 10), SERVICE_CPUS,
# LOAD_CPUS, REDIS_CPUS (taskset -c lists; default unpinned: on 2 cores
# everything shares them, as in docs/performance.md's table),
# SERVICE_ENV (more VAR=value for ratelimitd), RATELIMITD, LOADTEST
# (default $CARGO_TARGET_DIR, else target, /release/…), FLOOR (the floor
# program, default beside LOADTEST; FLOOR=none skips it). Last, at each rate,
# the floor: `floor`'s responder, the same wake-ups and loopback round
# trips as a decision (to the same Redis with STORE=redis) and no work,
# what no decision on this machine can cost less than. Writes
# OUTDIR/table.md and each run's JSON.
set -euo pipefail
OUT="${1:?usage: loadtest/rates.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=loadtest/common.sh
source "$HERE/common.sh"
RATELIMITD="${RATELIMITD:-${CARGO_TARGET_DIR:-$HERE/../target}/release/ratelimitd}"
LOADTEST="${LOADTEST:-${CARGO_TARGET_DIR:-$HERE/../target}/release/loadtest}"
FLOOR="${FLOOR:-$(dirname "$LOADTEST")/floor}"
API="${API:-envoy}"; STORE="${STORE:-redis}"; RATES="${RATES:-2000 5000 10000}"
CONCURRENCY="${CONCURRENCY:-64}"; CONNECTIONS="${CONNECTIONS:-4}"; USERS="${USERS:-10000}"
DURATION="${DURATION:-10}"
SERVICE_CPUS="${SERVICE_CPUS:-}"; LOAD_CPUS="${LOAD_CPUS:-}"; REDIS_CPUS="${REDIS_CPUS:-}"
for bin in "$RATELIMITD" "$LOADTEST" ${FLOOR#none}; do
  [ -x "$bin" ] || { echo "rates: $bin not built (cargo build --release -p ratelimitd -p loadtest; FLOOR=none skips the floor)" >&2; exit 1; }
done

write_edge_config "$WORK/envoy"
write_edge_limits "$WORK/edge-limits.yaml" plain
cat > "$WORK/native.yaml" <<'YAML'
rules:
  - { rule_id: playback, resource_path: /api/v1/playback, limit: 1000000000, window_seconds: 60 }
YAML
REDIS_URL=""
if [ "$STORE" = redis ]; then
  REDIS_PORT="$(free_port)"
  start_redis "$REDIS_CPUS" "$REDIS_PORT"
  REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
fi

# measure NAME API: the open-loop runs and the closed-loop run against the
# target on SVC_PORT (process SVC_PID), after a warm-up.
measure() {
  local name="$1" api="$2" rate
  local common=(--target "http://127.0.0.1:$SVC_PORT" --api "$api" --keys "uniform:$USERS" --connections "$CONNECTIONS" --target-pid "$SVC_PID")
  (pin "$LOAD_CPUS" "$LOADTEST" "${common[@]}" --rate 1000 --duration 2 --label warm-up >/dev/null 2>&1)
  if [ "$api" != stream ]; then
    for rate in $RATES; do
      (pin "$LOAD_CPUS" "$LOADTEST" "${common[@]}" --rate "$rate" --duration "$DURATION" --label "$name-$rate" \
        --json "$OUT/$name-$rate.json" 2>/dev/null)
    done
  fi
  (pin "$LOAD_CPUS" "$LOADTEST" "${common[@]}" --concurrency "$CONCURRENCY" --duration "$DURATION" --label "$name-closed" \
    --json "$OUT/$name-closed.json" 2>/dev/null)
}
flush() { if [ -n "$REDIS_URL" ]; then "${REDIS_CLI:-redis-cli}" -p "$REDIS_PORT" flushall >/dev/null; fi; }

TARGETS=()
store_env=(); [ -n "$REDIS_URL" ] && store_env=(RATELIMITD__REDIS__URL="$REDIS_URL")
# BASELINE: another ratelimitd build measured the same way first (before/after).
for target in ${BASELINE:+baseline} ratelimitd; do
  bin="$RATELIMITD"; [ "$target" = baseline ] && bin="$BASELINE"
  flush
  # shellcheck disable=SC2086
  start_service "$SERVICE_CPUS" "$bin" "${store_env[@]}" ${SERVICE_ENV:-}
  measure "$target" "$API"
  stop_service
  TARGETS+=("$target")
done

if [ -n "${LIMITADOR:-}" ]; then
  # ratelimitd under the name limitador-server reads limitador's command line.
  mkdir -p "$WORK/as"
  ln -s "$(cd "$(dirname "$RATELIMITD")" && pwd)/$(basename "$RATELIMITD")" "$WORK/as/limitador-server"
  for target in limitador ratelimitd-as-limitador; do
    bin="$LIMITADOR"; [ "$target" = ratelimitd-as-limitador ] && bin="$WORK/as/limitador-server"
    flush
    SVC_PORT="$(free_port)"
    args=(--rls-port "$SVC_PORT" --http-port "$(free_port)" "$WORK/edge-limits.yaml")
    if [ -n "$REDIS_URL" ]; then args+=(redis "$REDIS_URL"); else args+=(memory); fi
    (pin "$SERVICE_CPUS" env RUST_LOG=warn "$bin" "${args[@]}" >"$WORK/$target.log" 2>&1) &
    SVC_PID=$!; PIDS+=("$SVC_PID")
    wait_port "$SVC_PORT"; sleep 0.5
    measure "$target" envoy
    stop_service
    TARGETS+=("$target")
  done
fi

if [ "$FLOOR" != none ] && [ "$API" != stream ]; then
  floor_args=(); [ -n "$REDIS_URL" ] && floor_args=(--redis "127.0.0.1:$REDIS_PORT")
  [ -n "$SERVICE_CPUS" ] && floor_args+=(--cpus "$SERVICE_CPUS")
  for rate in $RATES; do
    (pin "$LOAD_CPUS" "$FLOOR" "${floor_args[@]}" --rate "$rate" --duration "$DURATION" --json "$OUT/floor-$rate.json" >/dev/null)
  done
fi

{
  echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')." \
    "Core sets: service ${SERVICE_CPUS:-any}, load ${LOAD_CPUS:-any}, Redis ${REDIS_CPUS:-any}."
  echo "Load: loadtest, $API API for ratelimitd (ShouldRateLimit for the limitador pair), users uniform over $USERS," \
    "$CONNECTIONS HTTP/2 connections, $DURATION s per run; store $STORE. Closed loop: $CONCURRENCY callers."
  echo
  echo "| target | load | decisions/s | CPU µs per decision | of it system | context switches per decision | migrations per decision | p50 ms | p99 ms |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for target in "${TARGETS[@]}"; do
    for run in $RATES closed; do
      f="$OUT/$target-$run.json"
      [ -f "$f" ] || continue
      load="$run/s"; [ "$run" = closed ] && load="closed, $CONCURRENCY"
      awk -v t="$target" -v l="$load" -v d="$(field "$f" decisions_per_second)" -v c="$(field "$f" target_cpu_us_per_decision)" \
        -v k="$(field "$f" target_system_us_per_decision)" \
        -v s="$(field "$f" target_switches_per_decision)" -v m="$(field "$f" target_migrations_per_decision)" \
        -v p50="$(field "$f" p50_us)" -v p99="$(field "$f" p99_us)" \
        'BEGIN { printf "| %s | %s | %.0f | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f |\n", t, l, d, c, k, s, m, p50 / 1000, p99 / 1000 }'
    done
  done
  for rate in $RATES; do
    f="$OUT/floor-$rate.json"
    [ -f "$f" ] || continue
    awk -v l="$rate/s" -v d="$(field "$f" requests)" -v t="$DURATION" -v c="$(field "$f" cpu_us_per_request)" \
      -v k="$(field "$f" system_us_per_request)" \
      -v s="$(field "$f" switches_per_request)" -v m="$(field "$f" migrations_per_request)" \
      'BEGIN { printf "| floor (round trips only) | %s | %.0f | %.1f | %.1f | %.2f | %.2f | – | – |\n", l, d / t, c, k, s, m }'
  done
} > "$OUT/table.md"
cat "$OUT/table.md"
