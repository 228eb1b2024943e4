#!/usr/bin/env bash
# A flood against one Redis, and what it does to everyone else: FLOODERS
# closed-loop callers (a connection each) send CheckBatch calls of 1,024
# distinct 200-byte users on a rule far above the load, while a victim
# calls every 10 ms on a rule of 2 a minute and an attacker batches its own
# key on that rule (loadtest --victim). Run twice side by side, with each
# connection's share of the store's in-flight work on
# (grpc.max_store_calls_per_connection, default 256) and off (0), at the
# production Redis deadline. Prints loadtest's reports: decisions/s of the
# flood, then what the victim and the attacker got (admitted against the
# limit of 2, answers not made by the shared store, the victim's latency).
#
#   loadtest/flood.sh "SERVICE_CMD" "LOADTEST_CMD" OUTDIR
#   e.g. loadtest/flood.sh target/release/ratelimitd target/release/loadtest /tmp/flood
#
# FLOODERS (4), DURATION (10 s), REDIS_CMD (redis-server), SERVICE_CPUS /
# LOAD_CPUS / REDIS_CPUS (taskset -c core sets; unset: no pinning).
set -euo pipefail

SERVICE_CMD="$1"; LOADTEST_CMD="$2"; OUT="$3"
FLOODERS="${FLOODERS:-4}"; DURATION="${DURATION:-10}"
mkdir -p "$OUT"
# shellcheck source=loadtest/common.sh
source "$(dirname "$0")/common.sh"

cat > "$WORK/native.yaml" <<'YAML'
rules:
  - { rule_id: flood, resource_path: /flood, limit: 100000000, window_seconds: 3600 }
  - { rule_id: victim, resource_path: /victim, limit: 2, window_seconds: 60 }
YAML

REDIS_PORT="$(free_port)"
start_redis "${REDIS_CPUS:-}" "$REDIS_PORT"

for share in 256 0; do
  label="share-$share"
  redis-cli -p "$REDIS_PORT" flushall >/dev/null
  start_service "${SERVICE_CPUS:-}" "$SERVICE_CMD" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT" \
    RATELIMITD__GRPC__MAX_STORE_CALLS_PER_CONNECTION="$share"
  # shellcheck disable=SC2086
  (pin "${LOAD_CPUS:-}" $LOADTEST_CMD --target "http://127.0.0.1:$SVC_PORT" --api batch --batch 1024 \
    --keys distinct:200 --path /flood --concurrency "$FLOODERS" --connections "$FLOODERS" \
    --duration "$DURATION" --target-pid "$SVC_PID" --victim /victim --label "$label" \
    --json "$OUT/$label.json" >"$OUT/$label.txt" 2>&1) || { cat "$OUT/$label.txt" >&2; exit 1; }
  stop_service
  echo "== grpc.max_store_calls_per_connection = $share"
  cat "$OUT/$label.txt"
done
