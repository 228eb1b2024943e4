#!/usr/bin/env bash
# Counts, per decision, what a ratelimitd build costs under one load:
# user-space instructions (callgrind over the running service, collected
# only while the measured load runs) and system calls by kind (perf's
# syscall tracepoints; no hardware counters needed). Counts are steady
# where wall-clock time on a small or shared machine is not: use them to
# compare two builds or two settings, one change at a time.
#
#   loadtest/count.sh RATELIMITD_CMD LOADTEST_CMD [loadtest args...]
#   e.g. loadtest/count.sh target/release/ratelimitd target/release/loadtest \
#          --api stream --concurrency 1 --batch 256 --connections 1
#
# COUNT (ir syscalls: what to count; redis-ir: Redis' instructions per
# decision instead, below), DURATION (s, 5), SERVICE_CPUS (0), LOAD_CPUS
# (1), LOG_LEVEL (the service's RUST_LOG: info, the shipped default),
# SERVICE_ENV (more VAR=value for the service), KEEP (a directory to keep
# callgrind's output in, for callgrind_annotate). One rule per algorithm,
# far above the load, so every decision is counted: /api/v1/playback (the
# sliding window, loadtest's default path), /token_bucket, /gcra; and the
# Envoy domain edge (--api envoy). GLOBAL=1 adds /global (global: true) and
# makes edge's limit global: limits shared by regions when the service is
# configured with `region` and `global.*` (RATELIMITD_CMD="ratelimitd
# --config FILE"). LIMITADOR_LIMITS=plain|cel serves edge from limitador's limits
# (rules.limitador_path) instead of Envoy rules.
#
# COUNT=redis-ir runs one redis-server ($REDIS_CMD, default redis-server;
# REDIS_CPUS, default 0) under callgrind and the service on it, and counts
# Redis' instructions (the script, the commands, the protocol) per
# decision while the load runs, with the script calls per decision: the
# steady measure of the script's cost per key (use --keys uniform:N).
# Redis is emptied after the warm-up, so every key is new at its first
# decision. Under callgrind Redis is the bottleneck, so its batches are
# large; compare two scripts under the same load. Needs valgrind (ir,
# redis-ir) and perf (syscalls).
set -euo pipefail

RATELIMITD_CMD="$1"; LOADTEST_CMD="$2"; shift 2
LOAD_ARGS=("$@")
COUNT="${COUNT:-ir syscalls}"; DURATION="${DURATION:-5}"
SERVICE_CPUS="${SERVICE_CPUS:-0}"; LOAD_CPUS="${LOAD_CPUS:-1}"; LOG_LEVEL="${LOG_LEVEL:-info}"
# shellcheck source=loadtest/common.sh
source "$(dirname "$0")/common.sh"

cat > "$WORK/native.yaml" <<'YAML'
rules:
  - { rule_id: playback, resource_path: /api/v1/playback, limit: 1000000000, window_seconds: 60 }
  - { rule_id: bucket, resource_path: /token_bucket, limit: 1000000000, window_seconds: 60, algorithm: token_bucket }
  - { rule_id: gcra, resource_path: /gcra, limit: 1000000000, window_seconds: 60, algorithm: gcra }
YAML
if [ -n "${GLOBAL:-}" ]; then
  echo "  - { rule_id: global, resource_path: /global, limit: 1000000000, window_seconds: 60, global: true }" >> "$WORK/native.yaml"
fi
# --api envoy: domain edge, a counter per user; LIMITADOR_LIMITS=plain or cel
# serves it from limitador's limits instead (a variable per user, and with
# cel a condition on the user too: what a CEL condition costs).
if [ -n "${LIMITADOR_LIMITS:-}" ]; then
  write_edge_limits "$WORK/limits.yaml" "$LIMITADOR_LIMITS"
else
  write_edge_config "$WORK/envoy"
fi

# start [PREFIX...]: the service (start_service; under PREFIX, e.g. valgrind).
# shellcheck disable=SC2086
start() { start_service "$SERVICE_CPUS" "$RATELIMITD_CMD" ${SERVICE_ENV:-} "$@"; }

# load SECONDS [JSON]: the load against the service; the JSON report.
load() {
  # shellcheck disable=SC2086
  (pin "$LOAD_CPUS" $LOADTEST_CMD --target "http://127.0.0.1:$SVC_PORT" --duration "$1" --json "${2:-$WORK/warm.json}" \
    "${LOAD_ARGS[@]}") \
    >"$WORK/load.log" 2>&1 || { cat "$WORK/load.log" >&2; exit 1; }
}
decisions() { grep -o '"decisions":[0-9]*' "$1" | head -1 | cut -d: -f2; }

if [[ " $COUNT " == *" ir "* ]]; then
  start valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/callgrind.out"
  load 2 # connections and first allocations, not counted
  callgrind_control -i on "$SVC_PID" >/dev/null 2>&1
  load "$DURATION" "$WORK/ir.json"
  callgrind_control -i off "$SVC_PID" >/dev/null 2>&1
  stop_service
  n="$(decisions "$WORK/ir.json")"
  ir="$(grep -h '^totals:' "$WORK"/callgrind.out* | awk '{ s += $2 } END { print s }')"
  echo "instructions per decision: $((ir / n)) ($ir over $n decisions)"
  if [ -n "${KEEP:-}" ]; then cp "$WORK"/callgrind.out* "$KEEP"/; fi
fi

if [[ " $COUNT " == *" syscalls "* ]]; then
  start
  load 1
  events="raw_syscalls:sys_enter"
  for s in writev write sendmsg recvfrom read epoll_wait futex; do events+=",syscalls:sys_enter_$s"; done
  perf stat -x, -e "$events" -p "$SVC_PID" -o "$WORK/perf.txt" &
  perf_pid=$!
  load "$DURATION" "$WORK/sys.json"
  kill -INT "$perf_pid"; wait "$perf_pid" || true
  stop_service
  n="$(decisions "$WORK/sys.json")"
  echo "system calls per decision ($n decisions):"
  grep -v '^#' "$WORK/perf.txt" | grep . | awk -F, -v n="$n" '{ sub(/^(raw_)?syscalls:sys_enter_?/, "", $3); printf "  %-12s %.3f\n", ($3 == "" ? "all" : $3), $1 / n }'
fi

if [[ " $COUNT " == *" redis-ir "* ]]; then
  port="$(free_port)"
  REDIS_CMD="valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=$WORK/redis.out ${REDIS_CMD:-redis-server}" \
    start_redis "${REDIS_CPUS:-0}" "$port"
  redis_pid="$REDIS_PID"
  # A store call's deadline far past callgrind's pace: every decision is
  # Redis' (checked below), none a failure policy's.
  start RATELIMITD__REDIS__URL="redis://127.0.0.1:$port" RATELIMITD__REDIS__TIMEOUT_MS=30000
  load 2
  # The measured load replays the warm-up's keys (the generator is seeded):
  # without this, how many of them already exist would depend on how many
  # decisions the warm-up made, and so would the count.
  "${REDIS_CLI:-redis-cli}" -p "$port" flushall >/dev/null
  calls() { redis_stats "$port" | cut -d' ' -f1; }
  before="$(calls)"
  callgrind_control -i on "$redis_pid" >/dev/null 2>&1
  load "$DURATION" "$WORK/redis.json"
  callgrind_control -i off "$redis_pid" >/dev/null 2>&1
  after="$(calls)"
  failed="$(failed_decisions "$SVC_HTTP_PORT")"
  stop_service
  if [ "$failed" != 0 ]; then echo "$0: $failed decisions answered by the failure policy: not Redis' count" >&2; exit 1; fi
  kill "$redis_pid"; wait "$redis_pid" 2>/dev/null || true
  n="$(decisions "$WORK/redis.json")"
  ir="$(grep -h '^totals:' "$WORK"/redis.out* | awk '{ s += $2 } END { print s }')"
  echo "Redis instructions per decision: $((ir / n)) ($ir over $n decisions; $(awk -v c=$((after - before)) -v n="$n" 'BEGIN { printf "%.4f", c / n }') script calls per decision)"
  if [ -n "${KEEP:-}" ]; then cp "$WORK"/redis.out* "$KEEP"/; fi
fi
