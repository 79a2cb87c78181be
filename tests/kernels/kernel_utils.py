"""Shared helpers of the kernel tests (imported by name: pytest puts this folder on sys.path)."""

import torch


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
