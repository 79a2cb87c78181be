#!/usr/bin/env bash
# Creates .venv with everything the tests and the server need, on a fresh machine.
# torch is installed explicitly first: a plain `torch` requirement would drag in a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.setup-done
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup-venv.sh ]; then
  exit 0
fi
[ -x .venv/bin/python ] || $PY -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[serve,test]"
touch "$stamp"
