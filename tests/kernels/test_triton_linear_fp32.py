"""kernels/triton_linear_fp32.py: the split-K bf16 x bf16 -> fp32 GEMM behind linear_fp32 (router,
compressor). CPU: the kernel through Triton's interpreter (linear_fp32_checks.py, in one subprocess:
TRITON_INTERPRET is read at import), one test per check, and the CPU path's bits. GPU: the router's
real sizes against float64 and cuBLAS, exact on integers, batch invariant, and the dispatch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

CHECKS = ("float64", "exact", "batch_invariant", "dispatch")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    env.pop("DEEPINFER_BATCH_INVARIANT", None)
    script = Path(__file__).with_name("linear_fp32_checks.py")
    r = subprocess.run([sys.executable, str(script), *CHECKS], env=env, capture_output=True, text=True, timeout=600)
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            results[d["check"]] = d
    return dict(results, _log=r.stdout[-2000:] + r.stderr[-4000:])


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted(interpreted, check):
    d = interpreted.get(check)
    assert d is not None, interpreted["_log"]
    assert d["ok"], d.get("error")


def test_cpu_path_unchanged():
    """Without the interpreter a CPU call is the fp32 matmul it always was, bit for bit."""
    from deepinfer.model import layers
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 5, 256, generator=g).to(dt)
        w = torch.randn(384, 256, generator=g).to(dt)
        assert torch.equal(layers.linear_fp32(x, w), torch.nn.functional.linear(x.float(), w.float()))


def test_config_ignores_m_and_fills_the_gpu():
    """Two waves of CTAs where K allows (N tiles x splits vs 132 SMs), no empty split, whole K blocks."""
    from deepinfer.kernels.triton_linear_fp32 import linear_fp32_config
    cpu = torch.device("cpu")
    for n, k in ((384, 5120), (512, 5120), (1, 5376), (4096, 5120), (8192, 5120), (384, 1280)):
        cfg = linear_fp32_config(n, k, cpu)
        nkb = k // cfg["BK"]
        per = -(-nkb // cfg["SPLIT_K"])
        assert k % cfg["BK"] == 0 and (cfg["SPLIT_K"] - 1) * per < nkb, (n, k, cfg)
        ctas = -(-n // cfg["BN"]) * cfg["SPLIT_K"]
        assert ctas >= 2 * 132 or cfg["SPLIT_K"] == nkb, (n, k, cfg, ctas)
        assert ctas <= 6 * 132, (n, k, cfg, ctas)
    assert linear_fp32_config(384, 5120, cpu)["SPLIT_K"] == 40


# ---- GPU: the router's sizes -------------------------------------------------------------------------

ROUTER_N, ROUTER_K = 384, 5120


def _fp32_bound(x, w):
    return (x.shape[-1] - 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_router_gpu_float64(m):
    from deepinfer.kernels.triton_linear_fp32 import linear_fp32
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, ROUTER_K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(ROUTER_N, ROUTER_K, device="cuda", generator=g) * 0.02).bfloat16()
    y = linear_fp32(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, ROUTER_N)
    ref = x.double() @ w.double().T
    err = (y.double() - ref).abs()
    assert (err <= _fp32_bound(x, w)).all(), err.max().item()
    lib = torch.mm(x, w.t(), out_dtype=torch.float32)                         # what the router ran before
    assert (y - lib).abs().max() <= 2 * _fp32_bound(x, w).max(), (y - lib).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_router_gpu_exact_on_integers(m):
    from deepinfer.kernels.triton_linear_fp32 import linear_fp32, linear_fp32_partials
    g = torch.Generator(device="cuda").manual_seed(100 + m)
    x = torch.randint(-8, 9, (m, ROUTER_K), device="cuda", generator=g).bfloat16()
    w = torch.randint(-8, 9, (ROUTER_N, ROUTER_K), device="cuda", generator=g).bfloat16()
    ref = x.double() @ w.double().T
    assert torch.equal(linear_fp32(x, w).double(), ref)
    assert torch.equal(linear_fp32_partials(x, w).double().sum(0), ref)
    assert torch.equal(linear_fp32(x, w, dict(SPLIT_K=1)).double(), ref)


@pytest.mark.gpu
def test_router_gpu_batch_invariant():
    """Row i alone equals row i of M = 16 / 64 / 128 bit for bit (and rows follow a permutation)."""
    from deepinfer.kernels.triton_linear_fp32 import linear_fp32
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(300, ROUTER_K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(ROUTER_N, ROUTER_K, device="cuda", generator=g) * 0.02).bfloat16()
    y128 = linear_fp32(x[:128], w)
    for m in (16, 64):
        assert torch.equal(linear_fp32(x[:m], w), y128[:m]), m
    for i in (0, 1, 15, 37, 63, 64, 127):
        assert torch.equal(linear_fp32(x[i:i + 1], w), y128[i:i + 1]), i
    perm = torch.randperm(128, device="cuda", generator=g)
    assert torch.equal(linear_fp32(x[:128][perm], w), y128[perm])
    assert torch.equal(linear_fp32(x, w)[:128], y128)                        # 300 rows: three launches


@pytest.mark.gpu
def test_gpu_dispatch(monkeypatch):
    """In batch-invariant mode linear_fp32 takes the Triton GEMM for the router, and cuBLAS for the LM
    head (N = vocab); the values agree with float64 within the fp32 bound. (The default mode keeps
    cuBLAS: faster on the H200.)"""
    from deepinfer.kernels import select, triton_linear_fp32 as tlf
    from deepinfer.model import layers
    if not select.use_fast(torch.empty(1, device="cuda")):
        pytest.skip("fast paths off on this GPU")
    calls = []
    real = tlf.linear_fp32
    monkeypatch.setattr(tlf, "linear_fp32", lambda x, w, *a, **k: (calls.append(w.shape[0]), real(x, w, *a, **k))[1])
    monkeypatch.setattr(select, "_batch_invariant", lambda: True)
    x = torch.randn(200, ROUTER_K, device="cuda").bfloat16()
    w = (torch.randn(ROUTER_N, ROUTER_K, device="cuda") * 0.02).bfloat16()
    for m in (1, 64, 128):
        calls.clear()
        y = layers.linear_fp32(x[:m], w)
        assert calls == [ROUTER_N], m
        assert ((y.double() - x[:m].double() @ w.double().T).abs() <= _fp32_bound(x[:m], w)).all()
    calls.clear()
    head = torch.randn(129280, ROUTER_K, device="cuda").bfloat16()
    layers.linear_fp32(x[:64], head)                                          # the LM head: cuBLAS
    assert calls == []
