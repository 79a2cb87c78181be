"""The Triton kernels' logic on the CPU (Triton's interpreter, in a subprocess so the
TRITON_INTERPRET switch does not leak into other tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("interpret_checks.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
