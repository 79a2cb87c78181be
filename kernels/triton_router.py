"""The MoE router after its GEMM in one Triton launch (reference: reference.py `router_topk_ref`, the
rule of deepinfer/model/moe.py `Gate.forward`).

    router_topk(logits [T, E] fp32, bias [E], topk, temp, route_scale, norm, bias_alt [E] | None,
                alt_mask [T] bool | None) -> (weights [T, topk] fp32, indices [T, topk] int64)
        scores = sqrt(softplus(logits / temp)); picks = the topk largest scores + bias (bias_alt on
        the rows where alt_mask), by descending value, ties to the lowest id; weights = scores at the
        picks, / (w0 + w1 + ... + 1e-20) when norm and topk > 1, * route_scale

Replaces ~10 torch launches (div, softplus, sqrt, where, add, topk, gather, sum, div, mul). Dataflow:
one program per token, the row in registers (BLOCK = next pow2 of E, masked). Each value v = score +
bias becomes one int64 key (order(v) << 32 | 2^31 - 1 - id), order = bits ^ ((bits >> 31) &
0x7FFFFFFF) as in triton_topk: distinct keys, larger for a larger value and, among equal values, for
the lower id. topk max-reductions then give the picks in output order; each pick's score comes out
with it, so the weights are summed in that order, w0 first.

Same rounding points as torch's CUDA ops, so the same bits (tests/kernels/test_triton_router.py):
    / temp        torch's CUDA divides by a CPU scalar as a * fl(1 / temp) (BinaryDivTrueKernel.cu), its
                  CPU truly: the kernel follows its tensors' device (RECIP), so it equals the reference
                  on both (the interpreter runs CPU tensors)
    softplus      x > 20 ? x : log1pf(expf(x)): libdevice, what torch's softplus_kernel calls, with
                  libdevice's FTZ reflection off (torch's kernels keep denormals: exp(x < -87))
    sqrt, / sum   sqrt.rn, div.rn (Triton's sqrt and / are approximate)
MANUAL (the CPU interpreter, where libdevice does not run): exp and log1p in fp64, each rounded to
fp32 (correctly rounded expf / log1pf in practice), so there the weights can differ from torch's CPU
softplus (SLEEF, <= 1 ulp per function) by a few ulp (more where exp is a denormal); everything after
the softplus is exact (tests/kernels/interpret_checks.py check_router_topk).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import pdl_args, pdl_enter
from .reference import router_topk_ref  # noqa: F401

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_WIDTH = 4096            # experts per row in registers (the model has <= 384)
MAX_TOPK = 32               # the pick loop is unrolled
KEY_PAD = tl.constexpr(-(1 << 63))   # below every entry's key: padding and taken picks


@triton.jit
def _softplus(x, MANUAL: tl.constexpr):
    """torch's softplus (beta 1, threshold 20) in fp32."""
    if MANUAL:
        e = tl.exp(x.to(tl.float64)).to(tl.float32).to(tl.float64)
        u = 1.0 + e
        # log1p(e) = log(u) * e / (u - 1), u = fl(1 + e): a few fp64 ulps for any e >= 0 (Goldberg)
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0))).to(tl.float32)
    else:
        sp = libdevice.log1p(libdevice.exp(x))
    return tl.where(x > 20.0, x, sp)


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, bias_alt_ptr, mask_ptr, w_ptr, idx_ptr, E, stride_l, temp,
                       route_scale, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_ALT: tl.constexpr, NORM: tl.constexpr, RECIP: tl.constexpr, MANUAL: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program t: row t's scores, its K picks by descending (value, -id), their weights -> w[t, :K],
    idx[t, :K]. RECIP: temp holds fl(1 / temp), multiplied (torch's CUDA); else divided (its CPU)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, BLOCK)
    valid = ids < E
    x = tl.load(logits_ptr + t * stride_l + ids, mask=valid, other=0.0)
    if RECIP:
        x = x * temp
    else:
        x = tl.math.div_rn(x, temp)
    s = tl.sqrt_rn(_softplus(x, MANUAL))                                    # scores [BLOCK]
    b = tl.load(bias_ptr + ids, mask=valid, other=0.0).to(tl.float32)
    if HAS_ALT:
        b_alt = tl.load(bias_alt_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        b = tl.where(tl.load(mask_ptr + t) != 0, b_alt, b)
    bits = (s + b).to(tl.int32, bitcast=True)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)                           # monotone in the float value
    key = (order.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    key = tl.where(valid, key, KEY_PAD)
    kk = tl.arange(0, KP)
    wv = tl.zeros((KP,), dtype=tl.float32)
    iv = tl.zeros((KP,), dtype=tl.int64)
    for j in tl.static_range(K):
        top = tl.max(key, axis=0)
        pick = 0x7FFFFFFF - (top & 0x7FFFFFFF)
        hit = ids == pick
        w = tl.max(tl.where(hit, s, float("-inf")), axis=0)                # scores[pick], exactly
        key = tl.where(hit, KEY_PAD, key)
        if j == 0:
            total = w
        else:
            total = total + w                                             # w0 + w1 + ..., in pick order
        wv = tl.where(kk == j, w, wv)
        iv = tl.where(kk == j, pick, iv)
    if NORM:
        wv = tl.math.div_rn(wv, total + 1e-20)
    wv = wv * route_scale
    out = t * K + kk
    tl.store(w_ptr + out, wv, mask=kk < K)
    tl.store(idx_ptr + out, iv, mask=kk < K)


@functools.lru_cache(maxsize=None)
def _f32_recip(temp: float) -> float:
    """fl32(1 / fl32(temp)): the factor torch's CUDA division by a Python scalar multiplies by."""
    return (torch.tensor(1.0) / torch.tensor(temp, dtype=torch.float32)).item()


def router_topk(logits: torch.Tensor, bias: torch.Tensor, topk: int, temp: float, route_scale: float,
                norm: bool, bias_alt: torch.Tensor | None = None, alt_mask: torch.Tensor | None = None, *,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (the gate GEMM, before / temp), bias / bias_alt [E], alt_mask [T] bool ->
    (weights [T, topk] fp32, indices [T, topk] int64), reference.router_topk_ref bit for bit.
    num_warps: a benchmark override."""
    assert logits.dim() == 2 and logits.dtype == torch.float32, (logits.shape, logits.dtype)
    T, E = logits.shape
    assert 0 < topk <= min(E, MAX_TOPK) and E <= MAX_WIDTH, (topk, E)
    assert bias.shape == (E,), (bias.shape, E)
    has_alt = alt_mask is not None
    if has_alt:
        assert bias_alt is not None and bias_alt.shape == (E,) and alt_mask.shape == (T,), (bias_alt, alt_mask.shape)
        assert alt_mask.dtype == torch.bool
    weights = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    indices = torch.empty(T, topk, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, indices
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bias = bias.contiguous()
    recip = logits.is_cuda
    block = triton.next_power_of_2(E)
    # libdevice without FTZ (denormal exp as torch); the interpreter takes no compile options
    opts = {} if INTERPRET else dict(enable_reflect_ftz=False)
    router_topk_kernel[(T,)](
        logits, bias, bias_alt.contiguous() if has_alt else bias,
        alt_mask.contiguous().view(torch.uint8) if has_alt else bias, weights, indices, E, logits.stride(0),
        _f32_recip(float(temp)) if recip else float(temp), float(route_scale), K=topk,
        KP=triton.next_power_of_2(topk), BLOCK=block, HAS_ALT=has_alt, NORM=bool(norm) and topk > 1,
        RECIP=recip, MANUAL=INTERPRET, num_warps=num_warps or max(1, min(8, block // 128)), **opts, **pdl_args())
    return weights, indices
