"""The exact FP8 -> bf16 weight dequant and select's dense bf16 prefill path (dequant_checks.py), under
Triton's interpreter on the CPU and on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).with_name("dequant_checks.py")


def test_dequant_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    r = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
def test_dequant_on_gpu():
    sys.path.insert(0, str(SCRIPT.parent))
    import dequant_checks
    assert dequant_checks.main() == 0
