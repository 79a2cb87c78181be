"""Shared helpers of the kernel tests (imported by name: pytest puts this folder on sys.path)."""

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_under_interpreter(script: str, timeout: int = 600, args: tuple = (), **env_extra: str) -> None:
    """Run a test file's __main__ checks (with args) in a subprocess with TRITON_INTERPRET=1 (read at Triton's
    import, so not in this process) and env_extra set, the repository on its path; fail with the tail of its
    output."""
    import pytest
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(script).resolve().parents[2]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand_fp8_weight(n: int, k: int, device, seed: int = 0):
    """A checkpoint-style FP8 weight: e4m3 [n, k] + E8M0 bytes [n/32, k/32] (pow2 per 32x32 tile)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02 * torch.exp(torch.randn(n // 32, 1, k // 32, 1, generator=g)).expand(
        n // 32, 32, k // 32, 32).reshape(n, k)
    t = w.view(n // 32, 32, k // 32, 32)
    amax = t.abs().amax((1, 3), keepdim=True).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax / 448))
    q = (t / 2 ** e).to(torch.float8_e4m3fn).view(n, k)
    return q.to(device), (e.view(n // 32, k // 32) + 127).to(torch.uint8).to(device)


def w8a16_exact_case(g, m, n, k, rows, e8m0, seed, device="cpu"):
    """Integer-valued W8A16 operands: dequantized weights v in [-15, 15] stored as e4m3 v / 2^p with pow2
    scales 2^p, p in 3..9 (small v at p = 9 are e4m3 subnormals), activations in [-4, 4]. Products and
    partial sums are fp32 integers below 2^24, exact in any order: a kernel with exact products and fp32
    accumulation returns bf16(x @ v^T) bit for bit. -> x, w, s (E8M0 bytes or f32), float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(3, 10, (g, n // rows, k // 32), generator=gen)
    v = torch.randint(-15, 16, (g, n, k), generator=gen).float()
    scale = torch.exp2(p.float()).repeat_interleave(rows, 1).repeat_interleave(32, 2)
    w = (v / scale).to(torch.float8_e4m3fn)
    assert torch.equal(w.float() * scale, v)
    s = (p + 127).to(torch.uint8) if e8m0 else torch.exp2(p.float())
    x = torch.randint(-4, 5, (g, m, k), generator=gen).bfloat16().to(device)
    ref = torch.einsum("gmk,gnk->gmn", x.double(), v.to(device).double())
    return x, w.to(device), s.to(device), ref


def w4a16_exact_case(g, m, n, k, seed, device="cpu"):
    """Integer-scaled W4A16 operands: packed MXFP4 bytes drawn over every byte value, E8M0 block bytes in
    124..128 (2^-3..2^1; a few blocks byte 0, which decodes to 0) and activations in [-4, 4]. Products are
    multiples of 2^-4 and every partial sum stays below 2^20: exact in fp32 in any order, so a kernel with
    exact products and fp32 accumulation returns bf16(x @ w^T) bit for bit. -> x, the weight as the kernels
    read it (triton_gemm.fp4_kernel_weight: packed bytes, scale bytes), float64 reference
    (reference.dequant_fp4_ref's weights, from the release layout)."""
    from deepinfer.kernels.reference import dequant_fp4_ref
    from deepinfer.kernels.triton_gemm import fp4_kernel_weight
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (g, n, k // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(124, 129, (g, n, k // 32), generator=gen).to(torch.uint8)
    scale[torch.rand(scale.shape, generator=gen) < 0.05] = 0
    w = torch.stack([dequant_fp4_ref(packed[i], scale[i]) for i in range(g)])
    x = torch.randint(-4, 5, (g, m, k), generator=gen).bfloat16().to(device)
    ref = torch.einsum("gmk,gnk->gmn", x.double(), w.to(device).double())
    packed_k, scale_k = fp4_kernel_weight(packed, scale)
    return x, packed_k.to(device), scale_k.to(device), ref
