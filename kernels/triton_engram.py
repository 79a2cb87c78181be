"""Engram's gated add in one pass (reference.engram_gate_ref, Engram.forward after its wkv GEMM).

    engram_gate(x, key, value, w, eps, token_mask) -> [T, hc, d] bf16
        per token t and hc copy c: h = x[t, c] (fp32), k = key[t, c], gate = sigmoid(signed sqrt of
        sum(h * w[c] * k) * rstd(h) * rstd(k) / sqrt(d)), 0 where token_mask[t] is False;
        out = bf16(h + gate * value[t]).

Replaces ~20 torch kernels over [T, hc, d] fp32 temporaries (at batch 64 and d 5120: 5 MB each) by one
program per (token, copy) that reads its rows twice (the second pass from cache).

    ngram_hash(input_ids, cu_seqlens, history, token_mask, token_map, multipliers, primes, offsets,
               pad_id, dead) -> [T, Le, (n-1) * H] int64     (reference.ngram_hash_ref)
        one program per token: its sequence by a search of cu_seqlens, the n-gram's compressed ids
        read from the chunk or its history, the rolling XOR of their products, mod each head's prime
    engram_rows(weight, scale, ids) -> [*ids.shape, D] bf16     (reference.engram_rows_ref)
        the looked-up e4m3 rows times their E8M0 scales

The hash was ~40 torch launches a step (each a few microseconds in a decode graph, for a few hundred
integers), the lookup six a layer; both are integer-exact / bit-exact against their references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter


@triton.jit
def engram_gate_kernel(x_ptr, key_ptr, val_ptr, w_ptr, mask_ptr, out_ptr, d, eps, scale, stride_key, stride_val,
                       HC: tl.constexpr, BD: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
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
                                    HAS_MASK=token_mask is not None, num_warps=4, **pdl_args())
    return out


@triton.jit
def ngram_hash_kernel(ids_ptr, cu_ptr, hist_ptr, mask_ptr, map_ptr, mult_ptr, primes_ptr, off_ptr, out_ptr,
                      B, hist_stride, pad_id, dead,
                      NG: tl.constexpr, LE: tl.constexpr, H: tl.constexpr, BLOCK_B: tl.constexpr,
                      BLOCK_LE: tl.constexpr, BLOCK_H: tl.constexpr, HAS_MASK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    bs = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_ptr + 1 + bs, mask=bs < B, other=0)
    b = tl.sum(((ends <= t) & (bs < B)).to(tl.int32), 0)                 # t's sequence
    local = t - tl.load(cu_ptr + b)
    le = tl.arange(0, BLOCK_LE)
    hd = tl.arange(0, BLOCK_H)
    lm = le < LE
    tile_ok = lm[:, None] & (hd[None, :] < H)
    cols = (NG - 1) * H
    rolling = tl.zeros((BLOCK_LE,), tl.int64)
    blocked = local < 0                                                   # False
    for s in tl.static_range(NG):
        j = local - s                                                     # >= 0: in the chunk; else history
        fresh = j >= 0
        tok = tl.load(ids_ptr + t - s, mask=fresh, other=0)
        src = tl.load(map_ptr + tok, mask=fresh, other=0)
        if HAS_MASK:
            src = tl.where(tl.load(mask_ptr + t - s, mask=fresh, other=1) != 0, src, dead)
        hv = tl.load(hist_ptr + b * hist_stride + (NG - 1) + j, mask=~fresh, other=0)
        hmapped = tl.load(map_ptr + hv, mask=(~fresh) & (hv >= 0), other=0)
        src = tl.where(fresh, src, tl.where(hv >= 0, hmapped, hv))
        blocked = blocked | (src < 0)
        tok_s = tl.where(blocked, pad_id, src).to(tl.int64)
        rolling = rolling ^ (tok_s * tl.load(mult_ptr + le * NG + s, mask=lm, other=0))
        if s > 0:
            col = (s - 1) * H + hd[None, :]
            p = tl.load(primes_ptr + (le[:, None] * (NG - 1) + (s - 1)) * H + hd[None, :], mask=tile_ok, other=1)
            o = tl.load(off_ptr + le[:, None] * cols + col, mask=tile_ok, other=0)
            tl.store(out_ptr + (t * LE + le[:, None]) * cols + col, rolling[:, None] % p + o, mask=tile_ok)


def ngram_hash(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, history: torch.Tensor,
               token_mask: torch.Tensor | None, token_map: torch.Tensor, multipliers: torch.Tensor,
               primes: torch.Tensor, offsets: torch.Tensor, pad_id: int, dead: int) -> torch.Tensor:
    """reference.ngram_hash_ref's arguments and integers (every tensor on the ids' device, int64)."""
    T, B = input_ids.numel(), history.shape[0]
    le, ng = multipliers.shape
    heads = primes.shape[-1]
    out = torch.empty(T, le, (ng - 1) * heads, dtype=torch.int64, device=input_ids.device)
    if T == 0:
        return out
    assert history.shape[1] == ng - 1 and history.stride(1) == 1, (tuple(history.shape), ng)
    mask = token_mask.view(torch.uint8) if token_mask is not None else input_ids    # bytes: read as != 0
    ngram_hash_kernel[(T,)](input_ids.contiguous(), cu_seqlens.contiguous(), history, mask.contiguous(),
                            token_map, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out,
                            B, history.stride(0), int(pad_id), int(dead),
                            NG=ng, LE=le, H=heads, BLOCK_B=triton.next_power_of_2(max(B, 1)),
                            BLOCK_LE=triton.next_power_of_2(le), BLOCK_H=triton.next_power_of_2(heads),
                            HAS_MASK=token_mask is not None, num_warps=1)
    return out


@triton.jit
def engram_rows_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, N, COLS, stride_r, stride_c, D,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < N
    row = tl.load(ids_ptr + (r // COLS) * stride_r + (r % COLS) * stride_c, mask=rm, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = rm[:, None] & (d[None, :] < D)
    b = tl.load(w_ptr + row[:, None] * D + d[None, :], mask=m, other=0)
    e = tl.load(s_ptr + row[:, None] * (D // 32) + d[None, :] // 32, mask=m, other=127).to(tl.int32) & 0xFF
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (e << 23).to(tl.float32, bitcast=True)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + d[None, :], v.to(tl.bfloat16), mask=m)


def engram_rows(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight [R, D] e4m3, scale [R, D/32] E8M0 bytes, ids [...] (a [T, cols] view keeps its strides) ->
    [..., D] bf16."""
    R, D = weight.shape
    assert D % 32 == 0 and scale.shape == (R, D // 32), (tuple(weight.shape), tuple(scale.shape))
    out = torch.empty(*ids.shape, D, dtype=torch.bfloat16, device=weight.device)
    n = ids.numel()
    if n == 0:
        return out
    if ids.dim() != 2:
        ids = ids.reshape(-1, 1)
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(16, 4096 // block_d))
    engram_rows_kernel[(triton.cdiv(n, block_r),)](weight.view(torch.uint8), scale.view(torch.uint8), ids, out, n,
                                                   ids.shape[1], ids.stride(0), ids.stride(1), D,
                                                   BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4, **pdl_args())
    return out
