#!/bin/bash
# Source from the root of the tree carried to the device machine (perf/H200_NOTES.md "Reproduce"):
#   CARRIES="gpu-kernels xgr slim-tok" . perf/device_env.sh
# Unpacks each .carry/<name>.tar.xz (next to the tree, or inside it) into /tmp/site, puts it and the
# tree on PYTHONPATH, points DEEPINFER_SHARED at the carried fixtures and links the packages the
# editable install maps (deepinfer.kernels / .recipe / .ensemble).
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
mkdir -p /tmp/site
for d in ../.carry .carry; do
  for a in ${CARRIES:-gpu-kernels}; do
    [ -f "$d/$a.tar.xz" ] && [ ! -f "/tmp/site/.unpacked-$a" ] && tar -xJf "$d/$a.tar.xz" -C /tmp/site && touch "/tmp/site/.unpacked-$a"
  done
done
for s in ../.shared .shared; do [ -d "$s/fixtures" ] && export DEEPINFER_SHARED=$(cd "$s" && pwd) && break; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for p in kernels recipe ensemble; do ln -sfn "../$p" "deepinfer/$p"; done
