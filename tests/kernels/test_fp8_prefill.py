"""The FP8 x FP8 prefill GEMMs (kernels/triton_fp8_prefill.py): exact on ternary data and within one
bf16 ulp on random data, dense and grouped contiguous, on the GPU and under Triton's interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).with_name("fp8_prefill_checks.py")


def test_fp8_prefill_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")   # CPU tensors take the fast paths
    r = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_fp8_variants_under_interpreter():
    """Every FP8 x FP8 variant exact on ternary data, and select's table choice, on the CPU (~15 s)."""
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    r = subprocess.run([sys.executable, str(SCRIPT), "variants"], env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
def test_fp8_prefill_on_gpu():
    sys.path.insert(0, str(SCRIPT.parent))
    import fp8_prefill_checks
    assert fp8_prefill_checks.main() == 0


VARIANT_NAMES = ("seq", "blocks", "blocks_bm64", "blocks_bn256", "lag_blocks", "lag_blocks_bm64", "lag2_blocks_bn64", "tma_blocks",
                 "tma_lag_blocks")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_fp8_variant_exact_on_gpu(variant):
    """Each FP8 x FP8 variant (kernels/triton_fp8_variants.py) gives the reference's bits on ternary data:
    32x32-tile, per-(row, 32) and per-row weight scales, decode and prefill-sized shapes."""
    sys.path.insert(0, str(SCRIPT.parent))
    import fp8_prefill_checks
    fp8_prefill_checks.check_exact_variants("cuda", [variant])
