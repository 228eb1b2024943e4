# Shared by the benchmark scripts (sourced, not run): a work directory
# removed on exit, the PIDs of what they started (killed on exit), a free
# loopback port, waiting until something listens on one, running a command
# on a core set, and the Envoy configuration the loads run against.
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

wait_port() { for _ in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "$0: nothing on port $1" >&2; exit 1; }

# Envoy-format rules in directory $1: domain "edge", a counter per user, far
# above what any load reaches (every decision is counted, none denied).
write_edge_config() {
  mkdir -p "$1"
  cat > "$1/edge.yaml" <<'YAML'
domain: edge
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 1000000000 }
YAML
}
