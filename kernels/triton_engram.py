"""Engram's gated add in one pass (reference.engram_gate_ref, Engram.forward after its wkv GEMM).

    engram_gate(x, key, value, w, eps, token_mask) -> [T, hc, d] bf16
        per token t and hc copy c: h = x[t, c] (fp32), k = key[t, c], gate = sigmoid(signed sqrt of
        sum(h * w[c] * k) * rstd(h) * rstd(k) / sqrt(d)), 0 where token_mask[t] is False;
        out = bf16(h + gate * value[t]).

Replaces ~20 torch kernels over [T, hc, d] fp32 temporaries (at batch 64 and d 5120: 5 MB each) by one
program per (token, copy) that reads its rows twice (the second pass from cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def engram_gate_kernel(x_ptr, key_ptr, val_ptr, w_ptr, mask_ptr, out_ptr, d, eps, scale, stride_key, stride_val,
                       HC: tl.constexpr, BD: tl.constexpr, HAS_MASK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    x_row = x_ptr + (t * HC + c) * d
    k_row = key_ptr + t * stride_key + c * d
    hh = tl.zeros((BD,), tl.float32)
    kk = tl.zeros((BD,), tl.float32)
    hk = tl.zeros((BD,), tl.float32)
    for s in range(0, d, BD):
        cols = s + tl.arange(0, BD)
        m = cols < d
        h = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        k = tl.load(k_row + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * d + cols, mask=m, other=0.0)
        hh += h * h
        kk += k * k
        hk += h * w * k
    rstd = tl.math.rsqrt(tl.sum(hh, 0) / d + eps) * tl.math.rsqrt(tl.sum(kk, 0) / d + eps)
    dot = tl.sum(hk, 0) * rstd * scale
    mag = tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6))
    sgn = tl.where(dot < 0, -mag, mag)
    gate = 1.0 / (1.0 + tl.exp(-sgn))
    if HAS_MASK:
        gate = tl.where(tl.load(mask_ptr + t) != 0, gate, 0.0)
    for s in range(0, d, BD):
        cols = s + tl.arange(0, BD)
        m = cols < d
        h = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        v = tl.load(val_ptr + t * stride_val + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + (t * HC + c) * d + cols, (h + gate * v).to(out_ptr.dtype.element_ty), mask=m)


def engram_gate(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, w: torch.Tensor, eps: float,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hc, d] bf16, key [T, hc*d] and value [T, d] (views of the wkv output: row strides kept),
    w [hc, d] fp32 (q_weight * k_weight), token_mask [T] bool or None -> [T, hc, d] in x's dtype."""
    T, hc, d = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if T:
        assert key.stride(-1) == 1 and value.stride(-1) == 1
        mask = token_mask.to(torch.int8).contiguous() if token_mask is not None else x
        engram_gate_kernel[(T, hc)](x, key, value, w.float().contiguous(), mask, out, d, float(eps), float(d) ** -0.5,
                                    key.stride(0), value.stride(0), HC=hc, BD=min(1024, triton.next_power_of_2(d)),
                                    HAS_MASK=token_mask is not None, num_warps=4)
    return out
