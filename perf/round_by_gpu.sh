#!/bin/bash
# One device call that runs the steps owed to the GPU it lands on: perf/roundN.steps on an H200,
# perf/roundN_h100.steps (where one exists) on an H100:  bash perf/round_by_gpu.sh N
N=${1:?usage: round_by_gpu.sh N}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
steps=perf/round$N.steps
case "$name" in *H200*) ;; *) [ -f "perf/round${N}_h100.steps" ] && steps=perf/round${N}_h100.steps ;; esac
echo "GPU: $name -> $steps"
exec bash "$(dirname "$0")/device_round.sh" "$steps"
