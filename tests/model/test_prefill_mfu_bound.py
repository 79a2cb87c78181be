"""perf/bench_model_prefill.py's linear-MFU bound: which profiled kernels count as linear GEMMs, as the exact
path's weight dequant or as the rest, and the bound that follows with every GEMM at the FP8 peak."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))


def test_kernels_sorted_into_linear_dequant_and_the_rest():
    from bench_model_prefill import linear_mfu_bound
    rows = [dict(name="_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm", us=100e3),
            dict(name="nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", us=50e3),
            dict(name="w8a16_pairs_kernel", us=10e3),
            dict(name="dequant_fp4_kernel", us=40e3),
            dict(name="void legacy::sm90::prefill::sparse_fwd::sparse_attn_fwd_kernel<", us=30e3),
            dict(name="hc_post_kernel", us=20e3),
            dict(name="moe_combine_kernel", us=10e3)]
    b = linear_mfu_bound(rows, flops=2e14, fp8_peak=1e15)          # 200 ms of linear work at the peak
    assert b["linear_ms"] == pytest.approx(160) and b["dequant_ms"] == pytest.approx(40)
    assert b["other_ms"] == pytest.approx(60)
    assert b["linear_at_fp8_peak_ms"] == pytest.approx(200) == b["other_ms_for_half"]
    assert b["bound"] == pytest.approx(200 / 260) and b["bound_with_dequant"] == pytest.approx(200 / 300)


def test_the_bound_reaches_one_half_exactly_when_the_rest_equals_the_linears_at_peak():
    from bench_model_prefill import linear_mfu_bound
    b = linear_mfu_bound([dict(name="rms_norm_kernel", us=123e3)], flops=1.23e14, fp8_peak=1e15)
    assert b["bound"] == pytest.approx(0.5) and b["linear_ms"] == 0 and b["dequant_ms"] == 0
