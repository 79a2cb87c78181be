#!/bin/bash
# One device call's worth of H200 work (perf/H200_NOTES.md "Device command"): the GPU tests of the
# fast paths, then the model decode benchmark on the full-width-ep8 checkpoint, logs under $OUT.
#   [KERNEL_BENCH="bench_kernels.py args"] bash perf/h200_suite.sh "TEST FILES" [BENCH ARGS...]
# The checkpoint (11.8 GB, ~3 min of CPU) is built in the background while the tests run.
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/deepinfer-full-width-ep8}
TESTS=${1:-}
shift || true
if [ ! -f "$CKPT/model.safetensors.index.json" ]; then
  python -m deepinfer.cli.make_checkpoint --preset full-width-ep8 --out "$CKPT" > "$OUT/ckpt.log" 2>&1 &
  BUILD=$!
else
  BUILD=
fi
if [ -n "$TESTS" ]; then
  timeout "${TEST_LIMIT:-240}" python -m pytest -m gpu $TESTS -v -rfE -n "${TEST_WORKERS:-6}" -p no:cacheprovider \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
if [ -n "${KERNEL_BENCH:-}" ]; then        # e.g. "--only variants --variants v3": while the checkpoint builds
  timeout "${KERNEL_LIMIT:-150}" python perf/bench_kernels.py $KERNEL_BENCH > "$OUT/kernels.log" 2>&1
  echo "kernel bench rc=$?"
  grep -E "^W8A16|rows kernel|^   sweep|failed" "$OUT/kernels.log" | tail -40
fi
[ -n "$BUILD" ] && wait "$BUILD"
tail -1 "$OUT/ckpt.log" 2>/dev/null
timeout "${BENCH_LIMIT:-220}" python perf/bench_model_decode.py --checkpoint "$CKPT" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -vE "Warning|warn" "$OUT/bench.log" | tail -45
