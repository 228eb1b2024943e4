# Shared by the benchmark scripts (sourced, not run): a work directory
# removed on exit, the PIDs of what they started (killed on exit), a free
# loopback port, waiting until something listens on one, running a command
# on a core set, starting Redis and reading its script statistics, starting
# the service, reading a field of a JSON report, and the Envoy
# configuration the loads run against.
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() {
  if command -v python3 >/dev/null; then
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
    return
  fi
  # No Python (a bare benchmark machine): a random high port nothing answers on.
  local port
  while :; do
    port=$((20000 + RANDOM % 40000))
    (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null || { echo "$port"; return; }
  done
}
# pin CORES COMMAND...: exec COMMAND, on the core set CORES (taskset -c)
# when it is not empty. Run it in a subshell: `(pin "$CPUS" cmd …) &`.
pin() {
  local cpus="$1"; shift
  if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}

# start_redis CORES PORT [ARGS...]: a redis-server ($REDIS_CMD, default
# redis-server) on 127.0.0.1:PORT without persistence, on the core set
# CORES, logged to $WORK/redis-PORT.log; returns once it listens. Its PID
# is in REDIS_PID (and PIDS).
start_redis() {
  local cpus="$1" port="$2"; shift 2
  # shellcheck disable=SC2086
  (pin "$cpus" ${REDIS_CMD:-redis-server} --port "$port" --bind 127.0.0.1 --save "" --appendonly no "$@" >"$WORK/redis-$port.log" 2>&1) &
  REDIS_PID=$!
  PIDS+=("$REDIS_PID")
  wait_port "$port"
}

# redis_stats PORT...: "calls usec cpu_ms" of the script (EVALSHA) summed
# over the Redis on those ports ($REDIS_CLI, default redis-cli).
redis_stats() {
  local port
  for port in "$@"; do
    "${REDIS_CLI:-redis-cli}" -p "$port" info commandstats | tr -d '\r' | grep '^cmdstat_evalsha:' | sed 's/.*calls=\([0-9]*\),usec=\([0-9]*\),.*/\1 \2/' || echo "0 0"
    "${REDIS_CLI:-redis-cli}" -p "$port" info cpu | tr -d '\r' | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "cpu %.0f\n", s * 1000 }'
  done | awk '/^cpu/ { cpu += $2; next } { calls += $1; usec += $2 } END { print calls + 0, usec + 0, cpu + 0 }'
}

# failed_decisions HTTP_PORT: the decisions the service's failure policy
# has answered so far (its /metrics, read with bash alone: a bare
# benchmark machine has no curl).
failed_decisions() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1"
    printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    awk '/^ratelimitd_decisions_total\{.*reason="FAIL_/ { s += $NF } END { print s + 0 }' <&3
  )
}

# start_service CORES CMD [ARGS...]: ratelimitd (CMD, one or more words)
# serving on free loopback ports, on the core set CORES, with the
# benchmarks' settings: rules $WORK/native.yaml (and Envoy rules
# $WORK/envoy when that directory exists, limitador's limits
# $WORK/limits.yaml when that file does), no shedding, its dead-letter
# file and spool in $WORK, RUST_LOG $LOG_LEVEL (warn). ARGS go to `env`
# before CMD: VAR=value ones win over these settings, other words run CMD
# (valgrind …). Sets SVC_PORT (gRPC), SVC_HTTP_PORT and SVC_PID (the
# service's own: pin and env exec into it; also in PIDS); logs to
# $WORK/service-$SVC_PORT.log; returns once it listens, else shows the log
# and exits.
start_service() {
  local cpus="$1" cmd="$2"; shift 2
  SVC_PORT="$(free_port)"; SVC_HTTP_PORT="$(free_port)"
  local settings=(RATELIMITD__GRPC__LISTEN="127.0.0.1:$SVC_PORT" RATELIMITD__HTTP__LISTEN="127.0.0.1:$SVC_HTTP_PORT"
    RATELIMITD__RULES__PATH="$WORK/native.yaml" RATELIMITD__SHED__MODE=off
    RATELIMITD__DLQ__FILE="$WORK/dlq-$SVC_PORT.jsonl" RATELIMITD__DLQ__SPOOL_DIR="$WORK/spool-$SVC_PORT"
    RUST_LOG="${LOG_LEVEL:-warn}")
  if [ -d "$WORK/envoy" ]; then settings+=(RATELIMITD__RULES__ENVOY_PATH="$WORK/envoy"); fi
  if [ -f "$WORK/limits.yaml" ]; then settings+=(RATELIMITD__RULES__LIMITADOR_PATH="$WORK/limits.yaml"); fi
  # shellcheck disable=SC2086
  (pin "$cpus" env "${settings[@]}" "$@" $cmd serve >"$WORK/service-$SVC_PORT.log" 2>&1) &
  SVC_PID=$!
  PIDS+=("$SVC_PID")
  (wait_port "$SVC_PORT") || { cat "$WORK/service-$SVC_PORT.log" >&2; exit 1; }
}
# stop_service [PID]: stops the service (SVC_PID by default) and waits for it.
stop_service() { local pid="${1:-$SVC_PID}"; kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }

# field FILE NAME: a field of a one-line JSON report (the first occurrence of its name).
field() { grep -o "\"$2\":[^,}]*" "$1" | head -1 | cut -d: -f2; }

wait_port() { for _ in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "$0: nothing on port $1" >&2; exit 1; }

# limitador's limits in file $1: namespace "edge", a counter per user
# (variable descriptors[0].user), far above any load; $2 = cel adds a CEL
# condition on the user, as Kuadrant writes them (true for every loadtest
# user).
write_edge_limits() {
  local conditions="[]"
  if [ "$2" = cel ]; then conditions="[\"descriptors[0]['user'] != 'anonymous'\"]"; fi
  cat > "$1" <<YAML
- namespace: edge
  max_value: 1000000000
  seconds: 60
  conditions: $conditions
  variables: ["descriptors[0].user"]
YAML
}

# Envoy-format rules in directory $1: domain "edge", a counter per user, far
# above what any load reaches (every decision is counted, none denied);
# with GLOBAL=1 the limit is global (docs/global-limits.md).
write_edge_config() {
  mkdir -p "$1"
  local global=""
  if [ -n "${GLOBAL:-}" ]; then global=", global: true"; fi
  cat > "$1/edge.yaml" <<YAML
domain: edge
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 1000000000$global }
YAML
}
