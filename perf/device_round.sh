#!/bin/bash
# One device call's worth of steps, each under its own time limit, logs under $OUT (what comes back):
#   bash perf/device_round.sh perf/next_round.steps
# A steps file holds one step a line, "SECONDS command ..." ('#' comments); a step past its limit is
# killed and the round goes on, so one slow benchmark cannot cost the rest of the call.
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
  timeout "$limit" bash -c "$cmd" < /dev/null > "$OUT/step-$n.log" 2>&1
  echo "--- rc=$? in $(( $(date +%s) - t0 )) s"
  grep -vE "Warning|warn_once|^\s*$" "$OUT/step-$n.log" | tail -"${TAIL:-40}"
done < "$STEPS"
