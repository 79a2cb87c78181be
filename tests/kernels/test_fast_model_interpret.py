"""The whole model with the fast paths bound, on a CPU through Triton's interpreter (a subprocess:
TRITON_INTERPRET and DEEPINFER_KERNELS are read at import), the index keys bf16 and packed. About 70 s."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_fast_model_under_interpreter(fixture_checkpoint):
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    script = Path(__file__).with_name("fast_model_smoke.py")
    r = subprocess.run([sys.executable, str(script), str(fixture_checkpoint)], env=env, capture_output=True,
                       text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
