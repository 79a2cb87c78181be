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


@pytest.mark.gpu
def test_tilelang_fp8_exact_on_gpu():
    """The TileLang per-32 GEMM (kernels/tilelang_fp8.py, where tilelang imports) gives the reference's bits
    on ternary data, M not a multiple of its tile, decode and prefill sizes."""
    import torch
    from deepinfer.kernels.tilelang_fp8 import available, tilelang_fp8_gemm
    if not available():
        pytest.skip("tilelang not importable")
    sys.path.insert(0, str(SCRIPT.parent))
    from fp8_prefill_checks import e8m0, pow2, ref_gemm, ternary
    gen = torch.Generator().manual_seed(6)
    for m, n, k in ((5, 128, 64), (64, 4608, 5120), (300, 1792, 5120), (1000, 1024, 1280)):
        a = ternary((m, k), gen, "cuda").to(torch.float8_e4m3fn)
        sa = pow2((m, k // 32), -3, 3, gen, "cuda")
        b = ternary((n, k), gen, "cuda").to(torch.float8_e4m3fn)
        sb = e8m0((n // 32, k // 32), gen, "cuda")
        y = tilelang_fp8_gemm(a, sa, b, sb)
        r = ref_gemm(a.float(), sa, b, sb)
        assert torch.equal(y, r), (m, n, k, (y.float() - r.float()).abs().max())
