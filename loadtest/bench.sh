#!/usr/bin/env bash
# The Performance table, in one go, each part pinned to its own cores:
#
#   scaling    the service on 1, 2, 4, 8 cores (SERVICE_SERIES): the Envoy
#              API on one hot key, in memory and with one Redis; Check
#              (unary) and CheckStream in memory
#   distinct   Check, users uniform over USERS, one Redis: decisions/s and
#              what Redis spends per decision (script µs from INFO
#              commandstats, Redis CPU from INFO cpu), per algorithm; then
#              the same users through CheckStream (CONNECTIONS streams x
#              BATCH in flight), which saturates Redis rather than the
#              service: what one Redis core decides ("saturated" rows)
#   cluster    the same two loads against a 3-primary Redis Cluster, a core
#              per primary, against the one Redis of `distinct`
#   latency    open loop, uniform users: Redis at LAT_REDIS_RATE/s, memory
#              at LAT_MEMORY_RATE/s (latency from each request's intended
#              send time, so queueing is not hidden)
#   peer       with LIMITADOR set: Kuadrant's limitador-server and
#              ratelimitd started as limitador-server, each with the same
#              command line and limits file (a counter per user), memory
#              and Redis, the Envoy API on one hot key, on the smallest and
#              the largest service core set
#
#   loadtest/bench.sh OUTDIR
#
# Writes OUTDIR/table.md (the machine, the core sets, every figure) and
# every run's raw JSON report. Needs bash, awk,
# taskset; no Python, no network (it runs from a bundled kit, see
# ../shared/BENCH.md).
#
# Binaries: KIT (a folder ../shared/bench/bundle made: its ratelimitd,
# loadtest, redis-server and redis-cli are the defaults then, each run
# through the kit's loader), RATELIMITD, LOADTEST (default
# target/release/…), REDIS_CMD, REDIS_CLI (default: redis-server and
# redis-cli from PATH), LIMITADOR (optional: a limitador-server
# built outside this repository, never vendored; in a KIT, bundle it under
# another name, e.g. limitador: ratelimitd answers to limitador-server).
# Core sets (taskset -c lists): REDIS_CPUS (one Redis; default 0),
# CLUSTER_CPUS (one per primary, space-separated; default "1 2 3"),
# SERVICE_SERIES (default "4 4-5 4-7 4-11"), LOAD_CPUS (default 12-15).
# Load: DURATION (s per run, 8), CONCURRENCY (256), CONNECTIONS (16),
# BATCH (in flight per stream, 256), USERS (1000000), LAT_REDIS_RATE
# (100000), LAT_MEMORY_RATE (200000). PARTS: which parts to run (default
# "scaling distinct cluster latency peer"; cluster runs the sliding window
# of distinct too, its baseline). The saturated runs give the store a
# deadline of SATURATED_TIMEOUT_MS (1000): a saturated Redis queues, and
# at the shipped 10 ms a share of decisions would be the failure policy's
# rather than Redis'. Every Redis row names the decisions that the failure
# policy answered during it, if any. ALGORITHMS: those of distinct
# (default "sliding_window token_bucket gcra").
set -euo pipefail
OUT="${1:?usage: loadtest/bench.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=loadtest/common.sh
source "$HERE/common.sh"
# KIT: one wrapper per bundled binary (KIT/run BIN, exec'd: the PID stays
# the binary's), taking the place of each default.
DEFAULTS="$HERE/../target/release"
if [ -n "${KIT:-}" ]; then
  KIT="$(cd "$KIT" && pwd)"; DEFAULTS="$WORK/kit"; mkdir -p "$DEFAULTS"
  for bin in "$KIT"/bin/*; do
    printf '#!/usr/bin/env bash\nexec %q %q "$@"\n' "$KIT/run" "${bin##*/}" >"$DEFAULTS/${bin##*/}"
    chmod +x "$DEFAULTS/${bin##*/}"
  done
  REDIS_CMD="${REDIS_CMD:-$DEFAULTS/redis-server}"
  REDIS_CLI="${REDIS_CLI:-$DEFAULTS/redis-cli}"
fi
RATELIMITD="${RATELIMITD:-$DEFAULTS/ratelimitd}"
LOADTEST="${LOADTEST:-$DEFAULTS/loadtest}"
REDIS_CLI="${REDIS_CLI:-redis-cli}"
REDIS_CPUS="${REDIS_CPUS:-0}"
CLUSTER_CPUS="${CLUSTER_CPUS:-1 2 3}"
SERVICE_SERIES="${SERVICE_SERIES:-4 4-5 4-7 4-11}"
LOAD_CPUS="${LOAD_CPUS:-12-15}"
DURATION="${DURATION:-8}"; CONCURRENCY="${CONCURRENCY:-256}"; CONNECTIONS="${CONNECTIONS:-16}"
BATCH="${BATCH:-256}"; USERS="${USERS:-1000000}"
LAT_REDIS_RATE="${LAT_REDIS_RATE:-100000}"; LAT_MEMORY_RATE="${LAT_MEMORY_RATE:-200000}"
SATURATED_TIMEOUT_MS="${SATURATED_TIMEOUT_MS:-1000}"
PARTS="${PARTS:-scaling distinct cluster latency peer}"
ALGORITHMS="${ALGORITHMS:-sliding_window token_bucket gcra}"

for bin in "$RATELIMITD" "$LOADTEST"; do
  [ -x "$bin" ] || { echo "bench: $bin not built (cargo build --release -p ratelimitd -p loadtest)" >&2; exit 1; }
done
part() { [[ " $PARTS " == *" $1 "* ]]; }
SERIES=($SERVICE_SERIES)
LARGEST="${SERIES[${#SERIES[@]}-1]}"
# The number of cores in a taskset list ("4-7,9" -> 5).
cores() { echo "$1" | tr ',' '\n' | awk -F- '{ n += ($2 == "" ? 1 : $2 - $1 + 1) } END { print n }'; }

# Rules: Envoy domain "edge" (a counter per user), and one native rule per
# algorithm, all far above what the load reaches: every decision is
# counted, none denied.
write_edge_config "$WORK/envoy"
cat > "$WORK/native.yaml" <<'YAML'
rules:
  - { rule_id: sliding, resource_path: /sliding_window, limit: 1000000000, window_seconds: 60 }
  - { rule_id: bucket, resource_path: /token_bucket, limit: 1000000000, window_seconds: 60, algorithm: token_bucket }
  - { rule_id: gcra, resource_path: /gcra, limit: 1000000000, window_seconds: 60, algorithm: gcra }
YAML

REDIS_PORT="$(free_port)"
start_redis "$REDIS_CPUS" "$REDIS_PORT"
CLUSTER_PORTS=()
start_cluster() {
  local cpus port seeds=()
  for cpus in $CLUSTER_CPUS; do
    port="$(free_port)"
    mkdir -p "$WORK/cluster-$port"
    start_redis "$cpus" "$port" --dir "$WORK/cluster-$port" --cluster-enabled yes --cluster-config-file nodes.conf \
      --cluster-port "$(free_port)"
    CLUSTER_PORTS+=("$port"); seeds+=("127.0.0.1:$port")
  done
  "$REDIS_CLI" --cluster create "${seeds[@]}" --cluster-replicas 0 --cluster-yes >"$WORK/cluster-create.log" 2>&1
  for _ in $(seq 200); do
    local ok=0
    for port in "${CLUSTER_PORTS[@]}"; do
      "$REDIS_CLI" -p "$port" cluster info | grep -q 'cluster_state:ok' && ok=$((ok + 1))
    done
    [ "$ok" = "${#CLUSTER_PORTS[@]}" ] && return 0
    sleep 0.05
  done
  echo "bench: the cluster never became healthy" >&2; exit 1
}
cluster_url() { local p u=""; for p in "${CLUSTER_PORTS[@]}"; do u="$u${u:+,}redis://127.0.0.1:$p"; done; echo "$u"; }

# service CORES [VAR=value...]: ratelimitd on CORES (start_service), given
# a moment to settle.
service() { local cpus="$1"; shift; start_service "$cpus" "$RATELIMITD" "$@"; sleep 0.3; }
load() { # label, then loadtest arguments; the report goes to OUT/label.json
  local label="$1"; shift
  (pin "$LOAD_CPUS" "$LOADTEST" --target "http://127.0.0.1:$SVC_PORT" --domain edge --connections "$CONNECTIONS" \
    --duration "$DURATION" --target-pid "$SVC_PID" --label "$label" --json "$OUT/$label.json" "$@" >"$OUT/$label.txt" 2>&1)
}
closed() { echo --concurrency "$CONCURRENCY"; }
# on_redis LABEL PORT... -- LOADTEST ARGS: the load against the Redis at
# the PORTs, emptied first (the generator is seeded, so an earlier run's
# keys would be met again), with Redis' statistics around it (LABEL.redis)
# and the decisions the failure policy answered meanwhile (LABEL.failed:
# the row names them).
on_redis() {
  local label="$1" ports=() port before failed; shift
  while [ "$1" != -- ]; do ports+=("$1"); shift; done; shift
  for port in "${ports[@]}"; do "$REDIS_CLI" -p "$port" flushall >/dev/null; done
  before="$(redis_stats "${ports[@]}")"; failed="$(failed_decisions "$SVC_HTTP_PORT")"
  load "$label" "$@"
  echo "$before $(redis_stats "${ports[@]}")" >"$OUT/$label.redis"
  echo $(($(failed_decisions "$SVC_HTTP_PORT") - failed)) >"$OUT/$label.failed"
}
# uniform PATH: the arguments of a closed loop of uniform users on PATH.
uniform() { echo --api check --path "$1" --keys "uniform:$USERS" --concurrency "$CONCURRENCY"; }
# saturated PATH: CheckStream over uniform users on PATH.
saturated() { echo --api stream --batch "$BATCH" --concurrency "$CONNECTIONS" --path "$1" --keys "uniform:$USERS"; }

if part scaling; then
  for cpus in "${SERIES[@]}"; do
    n="$(cores "$cpus")"
    service "$cpus"
    load "scale-$n-memory-envoy" --api envoy --keys hot $(closed)
    load "scale-$n-memory-check" --api check --path /sliding_window --keys hot $(closed)
    load "scale-$n-memory-stream" --api stream --batch "$BATCH" --path /sliding_window --keys hot --concurrency "$CONNECTIONS"
    stop_service
    service "$cpus" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT"
    load "scale-$n-redis-envoy" --api envoy --keys hot $(closed)
    stop_service
  done
fi

if part distinct || part cluster; then
  service "$LARGEST" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT"
  for alg in $ALGORITHMS; do
    on_redis "distinct-$alg" "$REDIS_PORT" -- $(uniform "/$alg")
  done
  stop_service
  service "$LARGEST" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT" RATELIMITD__REDIS__TIMEOUT_MS="$SATURATED_TIMEOUT_MS"
  for alg in $ALGORITHMS; do
    if part distinct || [ "$alg" = sliding_window ]; then
      on_redis "saturated-$alg" "$REDIS_PORT" -- $(saturated "/$alg")
    fi
  done
  stop_service
fi

if part cluster; then
  start_cluster
  service "$LARGEST" RATELIMITD__REDIS__URL="$(cluster_url)" RATELIMITD__REDIS__CLUSTER=true
  on_redis "cluster-sliding_window" "${CLUSTER_PORTS[@]}" -- $(uniform /sliding_window)
  stop_service
  service "$LARGEST" RATELIMITD__REDIS__URL="$(cluster_url)" RATELIMITD__REDIS__CLUSTER=true \
    RATELIMITD__REDIS__TIMEOUT_MS="$SATURATED_TIMEOUT_MS"
  on_redis "cluster-saturated-sliding_window" "${CLUSTER_PORTS[@]}" -- $(saturated /sliding_window)
  stop_service
fi

if part latency; then
  "$REDIS_CLI" -p "$REDIS_PORT" flushall >/dev/null
  service "$LARGEST" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT"
  load "latency-redis" --api check --path /sliding_window --keys "uniform:$USERS" --rate "$LAT_REDIS_RATE"
  stop_service
  service "$LARGEST"
  load "latency-memory" --api check --path /sliding_window --keys "uniform:$USERS" --rate "$LAT_MEMORY_RATE"
  stop_service
fi

if part peer && [ -n "${LIMITADOR:-}" ]; then
  write_edge_limits "$WORK/limits.yaml" plain
  # ratelimitd under the name limitador-server, which makes it read
  # limitador's command line: a link, or in a KIT the loader told the name.
  mkdir -p "$WORK/as"
  if [ -n "${KIT:-}" ]; then
    printf '#!/usr/bin/env bash\nexec %q --library-path %q --argv0 limitador-server %q "$@"\n' \
      "$KIT/lib/ld-linux-x86-64.so.2" "$KIT/lib" "$KIT/bin/ratelimitd" >"$WORK/as/limitador-server"
    chmod +x "$WORK/as/limitador-server"
  else
    ln -s "$(cd "$(dirname "$RATELIMITD")" && pwd)/$(basename "$RATELIMITD")" "$WORK/as/limitador-server"
  fi
  for cpus in "${SERIES[0]}" "$LARGEST"; do
    n="$(cores "$cpus")"
    for store in memory redis; do
      for target in limitador ratelimitd; do
        bin="$LIMITADOR"; [ "$target" = ratelimitd ] && bin="$WORK/as/limitador-server"
        SVC_PORT="$(free_port)"
        args=(--rls-port "$SVC_PORT" --http-port "$(free_port)" "$WORK/limits.yaml")
        if [ "$store" = redis ]; then
          args+=(redis "redis://127.0.0.1:$REDIS_PORT"); "$REDIS_CLI" -p "$REDIS_PORT" flushall >/dev/null
        else
          args+=(memory)
        fi
        (pin "$cpus" "$bin" "${args[@]}" >"$WORK/$target-$SVC_PORT.log" 2>&1) &
        SVC_PID=$!; PIDS+=("$SVC_PID")
        wait_port "$SVC_PORT"; sleep 0.5
        load "peer-$n-$store-$target" --api envoy --keys hot $(closed)
        stop_service
      done
    done
  done
fi

# The table.
{
  echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'). Core sets (taskset -c): Redis $REDIS_CPUS; cluster primaries $CLUSTER_CPUS (one each); service ${SERVICE_SERIES// / | }; load generator $LOAD_CPUS."
  echo "Load: loadtest, closed loop $CONCURRENCY callers over $CONNECTIONS HTTP/2 connections (a stream: $CONNECTIONS streams × $BATCH in flight), $DURATION s per run; distinct keys: users uniform over $USERS. One run each. Cells: decisions/s (service CPU µs per decision)."
  echo
  cell() { [ -f "$OUT/$1.json" ] && awk -v d="$(field "$OUT/$1.json" decisions_per_second)" -v c="$(field "$OUT/$1.json" target_cpu_us_per_decision)" 'BEGIN { printf "%.0fk (%.2f µs)", d / 1000, c }' || echo "not run"; }
  if part scaling; then
    echo "| service cores | Envoy API, memory | Envoy API, Redis | Check (unary), memory | CheckStream, memory |"
    echo "|---|---|---|---|---|"
    for cpus in "${SERIES[@]}"; do
      n="$(cores "$cpus")"
      echo "| $n ($cpus) | $(cell "scale-$n-memory-envoy") | $(cell "scale-$n-redis-envoy") | $(cell "scale-$n-memory-check") | $(cell "scale-$n-memory-stream") |"
    done
    echo
  fi
  if part peer && [ -n "${LIMITADOR:-}" ]; then
    # decisions/s of ratelimitd over limitador's, and limitador's CPU per decision over ratelimitd's.
    ratio() {
      [ -f "$OUT/$1.json" ] && [ -f "$OUT/$2.json" ] || { echo "not run"; return; }
      awk -v a="$(field "$OUT/$1.json" decisions_per_second)" -v b="$(field "$OUT/$2.json" decisions_per_second)" \
        -v ca="$(field "$OUT/$1.json" target_cpu_us_per_decision)" -v cb="$(field "$OUT/$2.json" target_cpu_us_per_decision)" \
        'BEGIN { printf "%.2fx, %.2fx", b / a, ca / cb }'
    }
    echo "Same limits file and command line (limitador-server [--rls-port, --http-port] limits.yaml memory | redis URL), Envoy API, one hot key; ratelimitd counts in its limitador mode (windows from the first hit)."
    echo
    echo "| service cores | store | limitador-server | ratelimitd as limitador-server | decisions/s ratio, CPU per decision ratio |"
    echo "|---|---|---|---|---|"
    for cpus in "${SERIES[0]}" "$LARGEST"; do
      n="$(cores "$cpus")"
      for store in memory redis; do
        echo "| $n ($cpus) | $store | $(cell "peer-$n-$store-limitador") | $(cell "peer-$n-$store-ratelimitd") | $(ratio "peer-$n-$store-limitador" "peer-$n-$store-ratelimitd") |"
      done
    done
    echo
  fi
  redis_row() { # label: decisions/s, Redis script µs and CPU µs per decision, calls per decision, p99
    local j="$OUT/$1.json" r="$OUT/$1.redis"
    [ -f "$j" ] && [ -f "$r" ] || { echo "| $1 | not run | | | | |"; return; }
    read -r c0 u0 p0 c1 u1 p1 <"$r"
    local label="$1" failed=0
    [ -f "$OUT/$1.failed" ] && failed="$(cat "$OUT/$1.failed")"
    [ "$failed" != 0 ] && label="$label ($failed by the failure policy)"
    awk -v l="$label" -v d="$(field "$j" decisions_per_second)" -v n="$(field "$j" decisions)" -v p99="$(field "$j" p99_us)" \
      -v calls="$((c1 - c0))" -v usec="$((u1 - u0))" -v cpu="$((p1 - p0))" -v s="$(field "$j" target_cpu_us_per_decision)" \
      'BEGIN { printf "| %s | %.0fk (%.2f µs) | %.2f | %.2f | %.3f | %.2f |\n", l, d / 1000, s, usec / n, cpu * 1000 / n, calls / n, p99 / 1000 }'
  }
  if part distinct || part cluster; then
    echo "| distinct keys, service on $LARGEST | decisions/s (service CPU) | Redis script µs per decision | Redis CPU µs per decision | script calls per decision | p99 ms |"
    echo "|---|---|---|---|---|---|"
    for alg in $ALGORITHMS; do part distinct && redis_row "distinct-$alg"; done
    part cluster && redis_row "cluster-sliding_window"
    for alg in $ALGORITHMS; do part distinct && redis_row "saturated-$alg"; done
    part cluster && redis_row "cluster-saturated-sliding_window"
    echo
  fi
  if part latency; then
    echo "| open loop, uniform users | decisions/s | p50 ms | p99 ms | p99.9 ms | errors |"
    echo "|---|---|---|---|---|---|"
    for store in redis memory; do
      j="$OUT/latency-$store.json"
      [ -f "$j" ] || continue
      awk -v s="$store" -v d="$(field "$j" decisions_per_second)" -v a="$(field "$j" p50_us)" -v b="$(field "$j" p99_us)" -v c="$(field "$j" p99.9_us)" \
        -v e="$(grep -o '"errors":{[^}]*}' "$j" | cut -d: -f2-)" 'BEGIN { printf "| %s | %.0f | %.3f | %.3f | %.3f | %s |\n", s, d, a / 1000, b / 1000, c / 1000, e }'
    done
    echo
  fi
  true
} >"$OUT/table.md"
cat "$OUT/table.md"
