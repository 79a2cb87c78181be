#!/bin/bash
# Builds what a device call carries besides the tree (all ignored by git, listed in .git/info/exclude):
#   .carry/gpu-kernels.tar.xz, .carry/gpu-serving.tar.xz   ../shared/tools/gpu-carry's two packs
#   .carry/gpu-slim.tar.xz     gpu-kernels without tilelang / z3 / tvm-ffi: DeepGEMM and FlashMLA only (~8 MB)
#   .carry/xdist.tar.xz        pytest-xdist + execnet, unpacked wheels (pytest -n 4 on the device)
#   .carry/pydantic.tar.xz     pydantic and its four wheels (xgrammar imports it: the engine's GPU tests)
#   .carry/tvm-ffi.tar.xz      apache-tvm-ffi alone, out of gpu-kernels (xgrammar's other import)
#   .shared                    ../shared/fixtures and the tools the GPU tests call (make-fixture, check-parity)
# Usage, from the checkout's root: bash perf/device_carries.sh   (then, e.g., CARRIES="gpu-slim gpu-serving
# xdist" bash perf/device_round.sh perf/roundN.steps with carry [".shared", ".carry/gpu-slim.tar.xz", ...]).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${SHARED:-../shared}
mkdir -p .git/info .carry
for p in /.carry/ /.shared/ /.ab/ /.gpu/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
[ -f .carry/gpu-kernels.tar.xz ] && [ -f .carry/gpu-serving.tar.xz ] || "$shared/tools/gpu-carry" all
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -f .carry/gpu-slim.tar.xz ]; then
  mkdir -p "$work/all" "$work/slim"
  tar -xJf .carry/gpu-kernels.tar.xz -C "$work/all"
  mv "$work/all/vllm" "$work/slim/"
  XZ_OPT=-T0 tar -C "$work/slim" -cJf .carry/gpu-slim.tar.xz .
fi
wheels() {   # wheels() NAME PACKAGE...: the device's Python 3.12 wheels, unpacked into .carry/NAME.tar.xz
  local name=$1; shift
  [ -f ".carry/$name.tar.xz" ] && return
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$work/whl-$name" "$@"
  for w in "$work/whl-$name"/*.whl; do python3 -m zipfile -e "$w" "$work/$name"; done
  rm -rf "$work/$name"/*.dist-info/RECORD
  XZ_OPT=-T0 tar -C "$work/$name" -cJf ".carry/$name.tar.xz" .
}
wheels xdist pytest-xdist execnet
wheels pydantic pydantic pydantic-core annotated-types typing-inspection typing-extensions
if [ ! -f .carry/tvm-ffi.tar.xz ]; then
  mkdir -p "$work/tvm"
  tar -xJf .carry/gpu-kernels.tar.xz -C "$work/tvm" --wildcards './tvm_ffi*' './apache_tvm_ffi*'
  XZ_OPT=-T0 tar -C "$work/tvm" -cJf .carry/tvm-ffi.tar.xz .
fi
mkdir -p .shared/tools
cp -r "$shared/fixtures" .shared/
cp "$shared"/tools/{make-fixture,check-parity,prompt_texts.json} .shared/tools/
du -sh .carry/*.tar.xz .shared
