#!/usr/bin/env bash
# A/B benchmark of two ratelimitd builds under the same load, in one run:
# before/after a change. Check and ShouldRateLimit, the in-memory store and
# (with REDIS_CMD set) one Redis; runs alternate A, B, A, B… so drift hits
# both. Prints a markdown table (decisions/s and the service's CPU time per
# decision, median of the rounds) and the B/A ratios; raw JSON reports go
# to OUTDIR.
#
#   loadtest/ab.sh "A_CMD" "B_CMD" "LOADTEST_CMD" OUTDIR
#   e.g. loadtest/ab.sh ".kit/run ratelimitd-base" ".kit/run ratelimitd" ".kit/run loadtest" "$OUT"
#
# SERVICE_CPUS (default 2-5), LOAD_CPUS (6-15), REDIS_CPUS (0): core sets
# (taskset -c). DURATION (s, 8), ROUNDS (3), CONCURRENCY (256),
# CONNECTIONS (16), KEYS (hot), APIS ("check envoy"; also batch, stream),
# LOG_LEVEL (the services' RUST_LOG: warn; info is the shipped default). REDIS_CMD: how to
# start redis-server (unset: memory only); MEMORY=0 skips the memory store.
set -euo pipefail

A_CMD="$1"; B_CMD="$2"; LOADTEST_CMD="$3"; OUT="$4"
SERVICE_CPUS="${SERVICE_CPUS:-2-5}"; LOAD_CPUS="${LOAD_CPUS:-6-15}"; REDIS_CPUS="${REDIS_CPUS:-0}"
DURATION="${DURATION:-8}"; ROUNDS="${ROUNDS:-3}"; CONCURRENCY="${CONCURRENCY:-256}"
LOG_LEVEL="${LOG_LEVEL:-warn}"
CONNECTIONS="${CONNECTIONS:-16}"; KEYS="${KEYS:-hot}"; APIS="${APIS:-check envoy}"
mkdir -p "$OUT"
# shellcheck source=loadtest/common.sh
source "$(dirname "$0")/common.sh"

# Limits far above what the load reaches: every decision is counted, none denied.
write_edge_config "$WORK/envoy"
cat > "$WORK/native.yaml" <<'YAML'
rules:
  - { rule_id: playback, resource_path: /api/v1/playback, limit: 1000000000, window_seconds: 60 }
YAML

STORES=()
[ "${MEMORY:-1}" = 0 ] || STORES+=(memory)
REDIS_URL=""
if [ -n "${REDIS_CMD:-}" ]; then
  REDIS_PORT="$(free_port)"
  start_redis "$REDIS_CPUS" "$REDIS_PORT"
  REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  STORES+=(redis)
fi

one() { # label, command, api, store
  local label="$1" cmd="$2" api="$3" store="$4" extra=()
  [ "$store" = redis ] && extra+=(RATELIMITD__REDIS__URL="$REDIS_URL")
  start_service "$SERVICE_CPUS" "$cmd" "${extra[@]}"
  sleep 0.3
  # shellcheck disable=SC2086
  taskset -c "$LOAD_CPUS" $LOADTEST_CMD --target "http://127.0.0.1:$SVC_PORT" --api "$api" --domain edge \
    --keys "$KEYS" --concurrency "$CONCURRENCY" --connections "$CONNECTIONS" --duration "$DURATION" \
    --target-pid "$SVC_PID" --label "$label" --json "$OUT/$label.json" >/dev/null 2>&1
  stop_service
}

for round in $(seq "$ROUNDS"); do
  for store in "${STORES[@]}"; do
    for api in $APIS; do
      one "a-$api-$store-$round" "$A_CMD" "$api" "$store"
      one "b-$api-$store-$round" "$B_CMD" "$api" "$store"
    done
  done
done

command -v python3 >/dev/null || { echo "ab: no python3 here; the JSON reports are in $OUT" >&2; exit 0; }
python3 - "$OUT" "$ROUNDS" "$SERVICE_CPUS" "$LOAD_CPUS" "$CONCURRENCY" "$CONNECTIONS" "$KEYS" "$DURATION" "${STORES[*]}" "$APIS" <<'PY'
import json, statistics, sys
out, rounds, svc, load, conc, conns, keys, dur, stores, apis = sys.argv[1:]
rounds = int(rounds)
print(f"A/B, alternating runs: service on cores {svc}, loadtest on {load}, {conc} callers over {conns} connections, keys {keys}, {dur} s per run, median of {rounds} rounds.\n")
print("B/A per round: each B run against the A run just before it (drift cancels); the table shows the median and the range.\n")
print("| API | store | A decisions/s | B decisions/s | B/A decisions/s (min–max) | A CPU µs/decision | B CPU µs/decision | B/A CPU (min–max) |")
print("|---|---|---|---|---|---|---|---|")
for store in stores.split():
    for api in apis.split():
        runs = lambda side, key: [json.load(open(f"{out}/{side}-{api}-{store}-{r}.json"))[key] for r in range(1, rounds + 1)]
        ad, bd = runs("a", "decisions_per_second"), runs("b", "decisions_per_second")
        ac, bc = runs("a", "target_cpu_us_per_decision"), runs("b", "target_cpu_us_per_decision")
        rd = [b / a for a, b in zip(ad, bd)]
        rc = [b / a for a, b in zip(ac, bc)]
        med = statistics.median
        print(f"| {api} | {store} | {med(ad):.0f} | {med(bd):.0f} | {med(rd):.3f} ({min(rd):.2f}–{max(rd):.2f}) | {med(ac):.2f} | {med(bc):.2f} | {med(rc):.3f} ({min(rc):.2f}–{max(rc):.2f}) |")
PY
