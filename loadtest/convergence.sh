#!/usr/bin/env bash
# The overload layer across instances, measured from outside: INSTANCES
# services on one Redis, one bucket limited to TARGET/s, offered OFFERED/s
# (open loop, split evenly over the instances) for HIGH_S seconds, then
# LOW/s for LOW_S seconds; then OFFERED/s again with Redis frozen
# (SIGSTOP) for CUT_S seconds in the middle of CUT_RUN_S. Every 0.5 s the
# script scrapes each instance's /metrics and sums, over the instances,
# what reached the layer and what it let through
# (ratelimitd_overload_requests_total) into a timeline; it prints the
# timeline and:
#   settle    the first time after which every 0.5 s sample of the admitted
#             rate lies within +-5% of TARGET (until the load falls)
#   mean      the admitted rate from 2 s after the start to the fall
#   recover   the time after the fall until nothing is dropped any more
#   cut       the drop share before, during and after the frozen Redis,
#             and the largest directive age seen
# The rule's exact limit is far above the load: only the overload layer
# refuses anything.
#
#   loadtest/convergence.sh "SERVICE_CMD" "LOADTEST_CMD" OUTDIR
#
# TARGET (10000), OFFERED (3 x TARGET), LOW (TARGET / 2), INSTANCES (3),
# HIGH_S (8), LOW_S (5), CUT_S (10), CUT_RUN_S (CUT_S + 8), REDIS_CMD
# (redis-server), SERVICE_CPUS/LOAD_CPUS/REDIS_CPUS (taskset -c core sets
# for every instance, every generator and Redis; unset: no pinning).
set -euo pipefail

SERVICE_CMD="$1"; LOADTEST_CMD="$2"; OUT="$3"
TARGET="${TARGET:-10000}"; OFFERED="${OFFERED:-$((TARGET * 3))}"; LOW="${LOW:-$((TARGET / 2))}"
INSTANCES="${INSTANCES:-3}"; HIGH_S="${HIGH_S:-8}"; LOW_S="${LOW_S:-5}"
CUT_S="${CUT_S:-10}"; CUT_RUN_S="${CUT_RUN_S:-$((CUT_S + 8))}"; REDIS_CMD="${REDIS_CMD:-redis-server}"
mkdir -p "$OUT"
# shellcheck source=loadtest/common.sh
source "$(dirname "$0")/common.sh"

REDIS_PORT="$(free_port)"
start_redis "${REDIS_CPUS:-}" "$REDIS_PORT"

cat > "$WORK/rules.yaml" <<YAML
rules:
  - { rule_id: hot, resource_path: /api/v1/playback, limit: 1000000000, window_seconds: 60,
      overload: { rate_per_second: $TARGET } }
YAML

GRPC=(); HTTP=()
for i in $(seq "$INSTANCES"); do
  start_service "${SERVICE_CPUS:-}" "$SERVICE_CMD" RATELIMITD__REDIS__URL="redis://127.0.0.1:$REDIS_PORT" \
    RATELIMITD__RULES__PATH="$WORK/rules.yaml"
  GRPC+=("$SVC_PORT"); HTTP+=("$SVC_HTTP_PORT")
done
sleep 1.2 # every feed has made its first exchange

load() { # total rate/s, seconds: one open-loop generator per instance, in the background
  local per=$(( $1 / INSTANCES )) i=0
  for port in "${GRPC[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    (pin "${LOAD_CPUS:-}" $LOADTEST_CMD --target "http://127.0.0.1:$port" --api check --keys uniform:100000 \
      --rate "$per" --duration "$2" --connections 2 --label "load-$1-$i" --json "$OUT/load-$1-$i.json" \
      >"$OUT/load-$1-$i.txt" 2>&1) &
  done
}

# One line per scrape: seconds since the start, then per instance offered,
# dropped, and the largest directive age.
SAMPLES="$OUT/samples.tsv"; : > "$SAMPLES"
START="$(date +%s.%N)"
scrape() {
  local line now
  now="$(date +%s.%N)"
  line="$(awk -v a="$now" -v b="$START" 'BEGIN { printf "%.3f", a - b }')"
  for http in "${HTTP[@]}"; do
    line+="$(curl -s --max-time 0.4 "127.0.0.1:$http/metrics" | awk '
      /^ratelimitd_overload_requests_total/ && /result="offered"/ { o += $2 }
      /^ratelimitd_overload_requests_total/ && /result="dropped"/ { d += $2 }
      /^ratelimitd_overload_directive_age_seconds/ { if ($2 > age) age = $2 }
      END { printf "\t%d\t%d\t%.1f", o, d, age }')"
  done
  echo "$line" >> "$SAMPLES"
}
sample_for() { # seconds
  local until; until="$(awk -v s="$START" -v n="$(date +%s.%N)" -v d="$1" 'BEGIN { print n - s + d }')"
  while awk -v s="$START" -v n="$(date +%s.%N)" -v u="$until" 'BEGIN { exit !(n - s < u) }'; do
    scrape; sleep 0.5
  done
}
mark() { echo "$1 $(awk -v s="$START" -v n="$(date +%s.%N)" 'BEGIN { printf "%.3f", n - s }')" >> "$OUT/marks"; }
: > "$OUT/marks"

mark high; load "$OFFERED" "$HIGH_S"; sample_for "$HIGH_S"
mark low; load "$LOW" "$LOW_S"; sample_for "$LOW_S"
sleep 1
mark cut_load; load "$OFFERED" "$CUT_RUN_S"; sample_for 4
mark cut; kill -STOP "$REDIS_PID"; sample_for "$CUT_S"
mark uncut; kill -CONT "$REDIS_PID"; sample_for "$((CUT_RUN_S - 4 - CUT_S))"
mark end
sleep 1

python3 - "$SAMPLES" "$OUT/marks" "$TARGET" "$OFFERED" "$LOW" "$INSTANCES" "$CUT_S" <<'PY'
import sys
samples, marks, target, offered, low, n, cut_s = sys.argv[1:]
target, offered, low = float(target), float(offered), float(low)
m = {k: float(v) for k, v in (l.split() for l in open(marks))}
rows = []
for line in open(samples):
    f = line.split("\t"); t = float(f[0]); vals = f[1:]
    o = sum(int(vals[i]) for i in range(0, len(vals), 3))
    d = sum(int(vals[i]) for i in range(1, len(vals), 3))
    age = max(float(vals[i]) for i in range(2, len(vals), 3))
    rows.append((t, o, d, age))
series = []  # (t at the interval's end, offered/s, admitted/s, drop share, age)
for (t0, o0, d0, _), (t1, o1, d1, age) in zip(rows, rows[1:]):
    dt = t1 - t0
    if dt <= 0: continue
    off, drop = (o1 - o0) / dt, (d1 - d0) / dt
    series.append((t1, off, off - drop, drop / off if off else 0.0, age))
print(f"{n} instances, one Redis, bucket {target:.0f}/s; offered {offered:.0f}/s from {m['high']:.1f} s, "
      f"{low:.0f}/s from {m['low']:.1f} s; Redis frozen {cut_s} s from {m['cut']:.1f} s.\n")
print("t (s) | offered/s | admitted/s | drop share | directive age (s)")
for t, off, adm, share, age in series:
    print(f"{t:6.2f} | {off:8.0f} | {adm:8.0f} | {share:5.3f} | {age:.1f}")
high = [s for s in series if m["high"] < s[0] <= m["low"]]
settled = None
for i, s in enumerate(high):
    if all(abs(x[2] - target) <= 0.05 * target for x in high[i:] if x[0] < m["low"] - 0.01):
        settled = s[0] - m["high"]; break
steady = [s for s in high if s[0] - m["high"] >= 2.5]
mean = sum(s[2] for s in steady) / len(steady) if steady else float("nan")
print()
print(f"settle: within +-5% of {target:.0f}/s from {settled:.2f} s on" if settled is not None else "settle: never within +-5%")
print(f"mean admitted 2 s after the start until the fall: {mean:.0f}/s ({(mean / target - 1) * 100:+.1f}%)")
lows = [s for s in series if m["low"] < s[0] <= m["cut_load"]]
rec = next((s[0] - m["low"] for s in lows if s[3] < 0.01), None)
print(f"recover: nothing dropped {rec:.2f} s after the fall" if rec is not None else "recover: still dropping")
before = [s[3] for s in series if m["cut_load"] + 2 < s[0] <= m["cut"]]
during = [s[3] for s in series if m["cut"] + 0.5 < s[0] <= m["uncut"]]
after = [s[3] for s in series if m["uncut"] + 1 < s[0] <= m["end"]]
avg = lambda xs: sum(xs) / len(xs) if xs else float("nan")
ages = [s[4] for s in series if m["cut"] < s[0] <= m["uncut"] + 0.5]
print(f"cut: drop share {avg(before):.3f} before, {avg(during):.3f} during (min {min(during, default=float('nan')):.3f}, "
      f"max {max(during, default=float('nan')):.3f}), {avg(after):.3f} after; largest directive age {max(ages, default=0):.1f} s")
PY
