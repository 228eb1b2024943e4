#!/usr/bin/env bash
# What the overload layer and the denial cache are for, measured: one hot
# key offered far above its limit against one Redis, three ways, side by
# side in one run:
#   exact    every decision is a Redis script call (no directive, cache off)
#   cache    the denial cache on (repeats of a denial answered locally)
#   layered  an overload directive in front and the cache behind
# each under an open-loop load of RATE/s (default 10x LIMIT) and a
# closed-loop load of CONCURRENCY callers (as fast as the service answers).
# Prints a markdown table: decisions/s and admitted/s (loadtest), Redis
# commands/s and Redis CPU ms per second (INFO stats/cpu deltas), Redis
# script calls/s (INFO commandstats), and the service's
# ratelimitd_store_calls_saved_total; then "decisions per Redis CPU
# second" of the exact run, the most one Redis core could serve with
# exact counting alone, against the layered run's decisions/s.
#
#   loadtest/overload.sh "SERVICE_CMD" "LOADTEST_CMD" OUTDIR
#   e.g. loadtest/overload.sh target/release/ratelimitd target/release/loadtest /tmp/ov
#
# LIMIT (1000/s; the rule's limit, window 1 s, and the directive's rate
# unless OVERLOAD_RATE is set), RATE (10 x LIMIT), CONCURRENCY (64),
# DURATION (10 s), REDIS_CMD (redis-server), SERVICE_CPUS/LOAD_CPUS/
# REDIS_CPUS (taskset -c core sets; unset: no pinning).
set -euo pipefail

SERVICE_CMD="$1"; LOADTEST_CMD="$2"; OUT="$3"
LIMIT="${LIMIT:-1000}"; OVERLOAD_RATE="${OVERLOAD_RATE:-$LIMIT}"; RATE="${RATE:-$((LIMIT * 10))}"
CONCURRENCY="${CONCURRENCY:-64}"; DURATION="${DURATION:-10}"; REDIS_CMD="${REDIS_CMD:-redis-server}"
mkdir -p "$OUT"
# shellcheck source=loadtest/common.sh
source "$(dirname "$0")/common.sh"

REDIS_PORT="$(free_port)"
start_redis "${REDIS_CPUS:-}" "$REDIS_PORT"
rcli() { redis-cli -p "$REDIS_PORT" "$@" | tr -d '\r'; }
stat() { rcli info "$1" | awk -F: -v k="$2" '$1 == k { print $2 }'; }
redis_cpu() { awk -v u="$(stat cpu used_cpu_user)" -v s="$(stat cpu used_cpu_sys)" 'BEGIN { print u + s }'; }

rules() { # variant → the rule file
  local overload=""
  [ "$1" = layered ] && overload=", overload: { rate_per_second: $OVERLOAD_RATE }"
  printf 'rules:\n  - { rule_id: hot, resource_path: /api/v1/playback, limit: %s, window_seconds: 1%s }\n' \
    "$LIMIT" "$overload" > "$WORK/rules-$1.yaml"
}

ROWS="$WORK/rows.tsv"
one() { # variant, load (open|closed)
  local variant="$1" load="$2" label="$1-$2"
  rules "$variant"
  local cache=true; [ "$variant" = exact ] && cache=false
  rcli flushall >/dev/null; rcli config resetstat >/dev/null
  start_service "${SERVICE_CPUS:-}" "$SERVICE_CMD" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT" \
    RATELIMITD__RULES__PATH="$WORK/rules-$variant.yaml" RATELIMITD__DENIAL_CACHE__ENABLED="$cache"
  local port="$SVC_PORT" http="$SVC_HTTP_PORT" pid="$SVC_PID"
  sleep 1.2 # the feed's first exchange
  local shape=(--concurrency "$CONCURRENCY")
  [ "$load" = open ] && shape=(--rate "$RATE")
  local commands0 cpu0 commands1 cpu1
  commands0="$(stat stats total_commands_processed)"; cpu0="$(redis_cpu)"
  # shellcheck disable=SC2086
  (pin "${LOAD_CPUS:-}" $LOADTEST_CMD --target "http://127.0.0.1:$port" --api check --keys hot \
    "${shape[@]}" --duration "$DURATION" --target-pid "$pid" --label "$label" --json "$OUT/$label.json" \
    >"$OUT/$label.txt" 2>&1)
  commands1="$(stat stats total_commands_processed)"; cpu1="$(redis_cpu)"
  local scripts saved
  scripts="$(rcli info commandstats | awk -F'[=,:]' '/^cmdstat_(evalsha|eval|fcall):/ { n += $3 } END { print n + 0 }')"
  saved="$(curl -s "127.0.0.1:$http/metrics" | awk '/^ratelimitd_store_calls_saved_total/ { n += $2 } END { print n + 0 }')"
  stop_service
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$OUT/$label.json" "$((commands1 - commands0))" \
    "$(awk -v a="$cpu1" -v b="$cpu0" 'BEGIN { print a - b }')" "$scripts" "$saved" "$DURATION" >> "$ROWS"
}

for load in open closed; do
  for variant in exact cache layered; do one "$variant" "$load"; done
done

python3 - "$ROWS" "$LIMIT" "$OVERLOAD_RATE" "$RATE" "$CONCURRENCY" "$DURATION" <<'PY'
import json, sys
rows, limit, orate, rate, conc, dur = sys.argv[1:]
print(f"One hot key, rule limit {limit}/s (window 1 s), overload directive {orate}/s; "
      f"open loop {rate}/s and closed loop {conc} callers, {dur} s each, one Redis.\n")
print("| run | decisions/s | admitted/s | Redis commands/s | Redis CPU ms/s | script calls/s | store calls saved/s |")
print("|---|---|---|---|---|---|---|")
seen = {}
for line in open(rows):
    label, path, commands, cpu, scripts, saved, seconds = line.rstrip("\n").split("\t")
    r = json.load(open(path)); s = r["seconds"]; span = float(seconds)
    seen[label] = (r["decisions_per_second"], float(cpu), r["decisions"])
    print(f"| {label} | {r['decisions_per_second']:.0f} | {r['allowed'] / s:.0f} | {int(commands) / span:.0f} "
          f"| {float(cpu) * 1000 / span:.0f} | {int(scripts) / span:.0f} | {int(saved) / span:.0f} |")
if "exact-closed" in seen and "layered-closed" in seen:
    dps, cpu, decisions = seen["exact-closed"]
    ceiling = decisions / cpu if cpu > 0 else float("inf")
    print(f"\nExact counting alone: {ceiling:.0f} decisions per Redis CPU second (the one-Redis ceiling); "
          f"layered closed loop: {seen['layered-closed'][0]:.0f} decisions/s.")
PY
