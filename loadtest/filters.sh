#!/usr/bin/env bash
# What a rate limit filter costs through one Envoy, side by side in one run:
# no filter, ShouldRateLimit (envoy.filters.http.ratelimit, a call to
# ratelimitd per request) and the Rate Limit Quota Service
# (envoy.filters.http.rate_limit_quota, Envoy deciding against the share
# ratelimitd assigns it). The same Envoy (one listener per mode), the same
# upstream (a direct response on a fourth listener of that Envoy), one hot
# key far below its limit (every request admitted), h2load closed loop.
# Rounds alternate the modes; prints a markdown table of the medians:
# admitted requests per second, the ratio to no filter, and the CPU time
# per admitted request of ratelimitd and of Envoy (/proc/PID/stat). The
# h2load reports go to OUTDIR.
#
#   loadtest/filters.sh SERVICE_CMD ENVOY_CMD OUTDIR
#   e.g. loadtest/filters.sh target/release/ratelimitd envoy /tmp/filters
#
# DURATION (s, 8), ROUNDS (3), CLIENTS (16), STREAMS (16 per client),
# ENVOY_THREADS (Envoy's --concurrency, 1); core sets (taskset -c, default
# none): SERVICE_CPUS, ENVOY_CPUS, LOAD_CPUS, REDIS_CPUS. REDIS_CMD: how to
# start redis-server for the service's counters (unset: the memory store).
set -euo pipefail

SVC_CMD="$1"; ENVOY_CMD="$2"; OUT="$3"
DURATION="${DURATION:-8}"; ROUNDS="${ROUNDS:-3}"; CLIENTS="${CLIENTS:-16}"; STREAMS="${STREAMS:-16}"
ENVOY_THREADS="${ENVOY_THREADS:-1}"
mkdir -p "$OUT"
# shellcheck source=loadtest/common.sh
source "$(dirname "$0")/common.sh"
command -v h2load >/dev/null || { echo "$0: h2load (nghttp2-client) is needed" >&2; exit 1; }

# One bucket (RLQS) and one descriptor (ShouldRateLimit): route=chat, far
# above the load.
mkdir -p "$WORK/envoy"
cat > "$WORK/envoy/edge.yaml" <<'YAML'
domain: edge
descriptors:
  - key: route
    value: chat
    rate_limit: { unit: second, requests_per_unit: 4000000000 }
YAML
cat > "$WORK/native.yaml" <<'YAML'
rules:
  - { rule_id: unused, resource_path: /unused, limit: 1, window_seconds: 1 }
YAML

SETTINGS=()
if [ -n "${REDIS_CMD:-}" ]; then
  REDIS_PORT="$(free_port)"
  start_redis "${REDIS_CPUS:-}" "$REDIS_PORT"
  SETTINGS+=(RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT")
fi
start_service "${SERVICE_CPUS:-}" "$SVC_CMD" "${SETTINGS[@]}"

UPSTREAM="$(free_port)"; NONE="$(free_port)"; RLS="$(free_port)"; RLQS="$(free_port)"; ADMIN="$(free_port)"
# listener NAME PORT FILTERS ACTION: one HTTP listener, every path answered
# by ACTION (its lines indented for the route).
listener() {
  cat <<YAML
    - name: $1
      address: { socket_address: { address: 127.0.0.1, port_value: $2 } }
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: $1
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: { prefix: "/" }
$4
                http_filters:
$3
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
YAML
}
RLS_FILTER='                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: edge
                      failure_mode_deny: true
                      timeout: 1s
                      rate_limit_service:
                        grpc_service: { envoy_grpc: { cluster_name: ratelimitd } }
                        transport_api_version: V3'
TO_UPSTREAM='                          route:
                            cluster: upstream'
RLS_ROUTE="$TO_UPSTREAM"'
                            rate_limits:
                              - actions:
                                  - generic_key: { descriptor_key: route, descriptor_value: chat }'
RLQS_FILTER='                  - name: envoy.filters.http.rate_limit_quota
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
                      rlqs_server: { envoy_grpc: { cluster_name: ratelimitd } }
                      domain: edge
                      bucket_matchers:
                        on_no_match:
                          action:
                            name: rate_limit_quota
                            typed_config:
                              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                              bucket_id_builder:
                                bucket_id_builder:
                                  route: { string_value: chat }
                              reporting_interval: 1s
                              no_assignment_behavior:
                                fallback_rate_limit: { blanket_rule: DENY_ALL }
                              expired_assignment_behavior:
                                fallback_rate_limit: { blanket_rule: DENY_ALL }'
{
  echo "static_resources:"
  echo "  listeners:"
  listener upstream "$UPSTREAM" "" '                          direct_response: { status: 200, body: { inline_string: "ok" } }'
  listener none "$NONE" "" "$TO_UPSTREAM"
  listener rls "$RLS" "$RLS_FILTER" "$RLS_ROUTE"
  listener rlqs "$RLQS" "$RLQS_FILTER" "$TO_UPSTREAM"
  cat <<YAML
  clusters:
    - name: upstream
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: upstream
        endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $UPSTREAM } } } } ] } ]
    - name: ratelimitd
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: { http2_protocol_options: {} }
      load_assignment:
        cluster_name: ratelimitd
        endpoints: [ { lb_endpoints: [ { endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $SVC_PORT } } } } ] } ]
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: $ADMIN } }
YAML
} > "$WORK/envoy.yaml"
# shellcheck disable=SC2086
(pin "${ENVOY_CPUS:-}" $ENVOY_CMD -c "$WORK/envoy.yaml" --concurrency "$ENVOY_THREADS" --disable-hot-restart \
  --base-id "$((RANDOM + 1000))" --log-level warn >"$WORK/envoy.log" 2>&1) &
ENVOY_PID=$!
PIDS+=("$ENVOY_PID")
(wait_port "$RLQS") || { cat "$WORK/envoy.log" >&2; exit 1; }

# cpu_ms PID: the process's user and system CPU time so far (ms).
cpu_ms() { awk -v tick="$(getconf CLK_TCK)" '{ printf "%d\n", ($14 + $15) * 1000 / tick }' "/proc/$1/stat"; }
port_of() { case "$1" in none) echo "$NONE" ;; rls) echo "$RLS" ;; rlqs) echo "$RLQS" ;; esac; }
# load MODE SECONDS REPORT: h2load against the mode's listener.
load() {
  (pin "${LOAD_CPUS:-}" h2load -D "$2" -c "$CLIENTS" -m "$STREAMS" "http://127.0.0.1:$(port_of "$1")/") >"$3" 2>&1
}
MODES=(none rls rlqs)
# Warm-up (unmeasured): connections made, the RLQS bucket assigned.
for mode in "${MODES[@]}"; do load "$mode" 2 "$OUT/warmup-$mode.txt"; done
for round in $(seq "$ROUNDS"); do
  for mode in "${MODES[@]}"; do
    report="$OUT/$mode-$round.txt"
    svc0="$(cpu_ms "$SVC_PID")"; envoy0="$(cpu_ms "$ENVOY_PID")"
    load "$mode" "$DURATION" "$report"
    svc1="$(cpu_ms "$SVC_PID")"; envoy1="$(cpu_ms "$ENVOY_PID")"
    ok="$(grep -o 'status codes: [0-9]* 2xx' "$report" | awk '{ print $3 }')"
    other="$(grep -o '2xx, [0-9]* 3xx, [0-9]* 4xx, [0-9]* 5xx' "$report" | awk '{ print $2 + $4 + $6 }')"
    echo "$mode $round $ok $other $((svc1 - svc0)) $((envoy1 - envoy0))" >>"$OUT/rounds.txt"
  done
done

# median MODE COLUMN: the median over the rounds of an awk expression of
# the columns (ok=$3, other=$4, svc_ms=$5, envoy_ms=$6).
median() {
  awk -v m="$1" '$1 == m { print '"$2"' }' "$OUT/rounds.txt" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
base="$(median none "\$3 / $DURATION")"
echo "| mode | admitted/s | vs no filter | not 2xx | ratelimitd CPU per request (µs) | Envoy CPU per request (µs) |"
echo "|---|---|---|---|---|---|"
for mode in "${MODES[@]}"; do
  rps="$(median "$mode" "\$3 / $DURATION")"
  awk -v mode="$mode" -v rps="$rps" -v base="$base" -v other="$(median "$mode" '$4')" \
    -v svc="$(median "$mode" '$5 * 1000 / ($3 > 0 ? $3 : 1)')" -v envoy="$(median "$mode" '$6 * 1000 / ($3 > 0 ? $3 : 1)')" \
    'BEGIN { printf "| %s | %.0f | %.3f | %d | %.2f | %.2f |\n", mode, rps, rps / base, other, svc, envoy }'
done
