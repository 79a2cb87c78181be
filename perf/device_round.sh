#!/bin/bash
# One device call's worth of steps, each under its own time limit, logs under $OUT (what comes back):
#   bash perf/device_round.sh perf/next_round.steps
# A steps file holds one step a line, "SECONDS command ..." ('#' comments); a step past its limit is
# killed and the round goes on, so one slow benchmark cannot cost the rest of the call. Every step's log
# goes into one $OUT/round.log (what comes back is at most 8 files: leave those to the benchmarks' JSON / PNG).
set -u
STEPS=${1:?usage: device_round.sh STEPS_FILE}
. "$(dirname "$0")/device_env.sh"
OUT=${OUT:-/tmp/device-round}
mkdir -p "$OUT"
t0=$(date +%s)
n=0
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  n=$((n + 1))
  limit=${line%% *}
  cmd=${line#* }
  echo "=== step $n [$(( $(date +%s) - t0 )) s] (limit $limit s): $cmd"
  log=$(mktemp)
  timeout "$limit" bash -c "$cmd" < /dev/null > "$log" 2>&1
  echo "--- rc=$? in $(( $(date +%s) - t0 )) s"
  { echo "=== step $n: $cmd"; grep -vE "Warning|warn_once|warnings.warn|^\s*$" "$log"; } >> "$OUT/round.log"
  grep -vE "Warning|warn_once|^\s*$" "$log" | tail -"${TAIL:-40}"
  rm -f "$log"
done < "$STEPS"
