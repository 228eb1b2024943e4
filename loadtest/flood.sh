#!/usr/bin/env bash
# A flood against one Redis, and what it does to everyone else: FLOODERS
# closed-loop callers (a connection each, all of tenant `flood`) send
# CheckBatch calls of 1,024 distinct 200-byte users on a rule far above the
# load, while a victim (no tenant) calls every 10 ms on a rule of 2 a
# minute and an attacker batches its own key on that rule (loadtest
# --victim). Run side by side, at the production Redis deadline, with
#   connection: each connection's share of the store's in-flight work
#               (grpc.max_store_calls_per_connection, default 256);
#   tenant:     that and, with a tenant table naming `flood`, each tenant's
#               share (grpc.max_store_calls_per_tenant, TENANT_SHARE);
#   none:       neither.
# Prints loadtest's reports: decisions/s of the flood, then what the victim
# and the attacker got (admitted against the limit of 2, answers not made
# by the shared store, the victim's latency). The tenant share differs from
# the connection share once the flood has more connections than
# TENANT_SHARE / 256 (FLOODERS=16).
#
#   loadtest/flood.sh "SERVICE_CMD" "LOADTEST_CMD" OUTDIR
#   e.g. loadtest/flood.sh target/release/ratelimitd target/release/loadtest /tmp/flood
#
# FLOODERS (4), TENANT_SHARE (1024), DURATION (10 s), REDIS_CMD
# (redis-server), SERVICE_CPUS / LOAD_CPUS / REDIS_CPUS (taskset -c core
# sets; unset: no pinning).
set -euo pipefail

SERVICE_CMD="$1"; LOADTEST_CMD="$2"; OUT="$3"
FLOODERS="${FLOODERS:-4}"; DURATION="${DURATION:-10}"; TENANT_SHARE="${TENANT_SHARE:-1024}"
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

cat > "$WORK/tenants.yaml" <<'YAML'
tenants:
  - { name: flood }
YAML

for label in connection tenant none; do
  case "$label" in
    connection) shares=(RATELIMITD__GRPC__MAX_STORE_CALLS_PER_CONNECTION=256) ;;
    tenant) shares=(RATELIMITD__GRPC__MAX_STORE_CALLS_PER_CONNECTION=256
      RATELIMITD__GRPC__MAX_STORE_CALLS_PER_TENANT="$TENANT_SHARE"
      RATELIMITD__OVERLOAD__TENANTS_PATH="$WORK/tenants.yaml") ;;
    none) shares=(RATELIMITD__GRPC__MAX_STORE_CALLS_PER_CONNECTION=0) ;;
  esac
  redis-cli -p "$REDIS_PORT" flushall >/dev/null
  start_service "${SERVICE_CPUS:-}" "$SERVICE_CMD" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT" \
    "${shares[@]}"
  # shellcheck disable=SC2086
  (pin "${LOAD_CPUS:-}" $LOADTEST_CMD --target "http://127.0.0.1:$SVC_PORT" --api batch --batch 1024 \
    --keys distinct:200 --tenant flood --path /flood --concurrency "$FLOODERS" --connections "$FLOODERS" \
    --duration "$DURATION" --target-pid "$SVC_PID" --victim /victim --label "$label" \
    --json "$OUT/$label.json" >"$OUT/$label.txt" 2>&1) || { cat "$OUT/$label.txt" >&2; exit 1; }
  stop_service
  echo "== shares: $label (${shares[*]})"
  cat "$OUT/$label.txt"
done
