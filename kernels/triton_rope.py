"""Triton RoPE (reference: kernels/reference.py `rope_ref`).

    rope(x, cis, inverse)   x [T, ..., D], cis [T, rd/2] complex64 -> a new [T, ..., D] in x's dtype:
                            the first D - rd dims copied, the last rd dims (adjacent pairs as complex
                            numbers) multiplied by cis (by conj(cis) when inverse), in fp32
    rope(..., inplace=True) the same values written into x's last rd dims (x contiguous): the other
                            D - rd dims are neither read nor written (attention's q and output at 512
                            dims with 64 rotated: 1/8 of the copy's traffic)

Dataflow: one program per (BLOCK_T tokens, BLOCK_H heads) copies the D - rd leading dims and loads the
rope part as [BLOCK_T, BLOCK_H, rd/2, 2] (each token's cis row once), splits it into (re, im), rotates
it with the reference's complex product, joins, casts and stores. Bit-exact against rope_ref on each device:
NOTE: torch's complex64 multiply rounds differently per device. CUDA (nvcc contracts c10::complex's
operator*): re = fma(a, c, -(b*d)), im = fma(a, d, b*c), measured on the H200. CPU (AVX mul + hsub):
re = a*c - b*d, im = a*d + b*c, each product rounded. FMA picks the form (x.is_cuda); the kernel
is launched without FMA contraction so the unfused form stays unfused.

Packed form (bf16 in place, `rope_pairs_kernel`): each (re, im) pair is one 32-bit word, loaded as int32
and split by shifts (a bf16's fp32 value is its bits << 16, exactly), so a (token, head) row's rope dims are
contiguous words the loads vectorize, with no split / join of a pair axis; the same fp32 arithmetic and
the same round-to-nearest-even to bf16, so the same bits. The split form measured ~0.2 of copy bandwidth
on the in-place q at 8k tokens (H200, 2026-12-03).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .reference import rope_ref  # noqa: F401  (the reference this follows)


@triton.jit
def _rotate(a, b, c, s, FMA: tl.constexpr):
    """(a + ib)(c + is) in fp32, rounded as torch's complex multiply rounds on the device (module docstring)."""
    if FMA:                                                                      # torch on CUDA
        re = tl.fma(a, c, -(b * s))
        im = tl.fma(a, s, b * c)
    else:                                                                        # torch on CPU
        re = a * c - b * s
        im = a * s + b * c
    return re, im


@triton.jit
def rope_kernel(x_ptr, cis_ptr, y_ptr, T, H, sx_t, sx_h, sc_t,
                D: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr, FMA: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                COPY_NOPE: tl.constexpr = True):
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (ts[:, None] < T) & (hs[None, :] < H)                                 # [BLOCK_T, BLOCK_H]
    t64 = ts.to(tl.int64)[:, None]
    h64 = hs.to(tl.int64)[None, :]
    src = x_ptr + t64 * sx_t + h64 * sx_h                                       # [BLOCK_T, BLOCK_H]
    dst = y_ptr + (t64 * H + h64) * D
    if NOPE > 0 and COPY_NOPE:                                                  # pass-through dims
        cols = tl.arange(0, BLOCK_NOPE)[None, None, :]
        m = ok[:, :, None] & (cols < NOPE)
        tl.store(dst[:, :, None] + cols, tl.load(src[:, :, None] + cols, mask=m), mask=m)
    i = tl.arange(0, HALF)[None, :]
    crow = cis_ptr + t64 * sc_t                                                 # [BLOCK_T, 1]: once per token
    tm = ts[:, None] < T
    c = tl.load(crow + 2 * i, mask=tm, other=0.0)[:, None, :]                   # [BLOCK_T, 1, HALF] fp32
    s = tl.load(crow + 2 * i + 1, mask=tm, other=0.0)[:, None, :]
    if INVERSE:
        s = -s
    pair = tl.arange(0, HALF)[:, None] * 2 + tl.arange(0, 2)[None, :]            # [HALF, 2]
    offs = NOPE + pair[None, None, :, :]                                         # [1, 1, HALF, 2]
    m4 = ok[:, :, None, None]
    z = tl.load(src[:, :, None, None] + offs, mask=m4, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H, HALF, 2]
    a, b = tl.split(z)                                                           # [BLOCK_T, BLOCK_H, HALF]
    # (two stride-2 loads instead of split measured 2.7x slower on the H200, 2026-12-03: bench_rope.py)
    re, im = _rotate(a, b, c, s, FMA)
    out = tl.join(re, im)                                                        # [BLOCK_T, BLOCK_H, HALF, 2]
    tl.store(dst[:, :, None, None] + offs, out.to(y_ptr.dtype.element_ty), mask=m4)


@triton.jit
def rope_pairs_kernel(w_ptr, cis_ptr, R, H, sw_t, sw_h, sc_t,
                      WOFF: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr, FMA: tl.constexpr,
                      BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """w_ptr: x viewed as int32 words (one bf16 (re, im) pair each); a program rotates BLOCK_R (token, head)
    rows of R = T * H, words WOFF .. WOFF + HALF of each row, in place."""
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (r < R)[:, None]
    t64 = (r // H).to(tl.int64)[:, None]
    h64 = (r % H).to(tl.int64)[:, None]
    i = tl.arange(0, HALF)[None, :]
    ptr = w_ptr + t64 * sw_t + h64 * sw_h + WOFF + i                            # [BLOCK_R, HALF]
    word = tl.load(ptr, mask=ok, other=0)
    a = (word << 16).to(tl.float32, bitcast=True)                               # the pair's first bf16
    b = (word & -65536).to(tl.float32, bitcast=True)                            # its second
    c = tl.load(cis_ptr + t64 * sc_t + 2 * i, mask=ok, other=0.0)
    s = tl.load(cis_ptr + t64 * sc_t + 2 * i + 1, mask=ok, other=0.0)
    if INVERSE:
        s = -s
    re, im = _rotate(a, b, c, s, FMA)
    lo = re.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
    hi = im.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    tl.store(ptr, lo | hi, mask=ok)


# rows a program of the packed form: 32 rows of 32 words (attention's 64 rope dims) = 4 KB each way
PAIRS_ROWS = 32
PACKED = True           # False: the split form for every call (perf/bench_rope.py compares the two)


def _pairs_ok(x3: torch.Tensor, half: int) -> bool:
    """The packed form's rules: bf16, rows of whole words (even strides and dims), a 4-byte aligned base."""
    return (PACKED and x3.dtype == torch.bfloat16 and x3.shape[-1] % 2 == 0 and x3.stride(0) % 2 == 0
            and x3.stride(1) % 2 == 0 and x3.data_ptr() % 4 == 0)


# (tokens, heads) a program: up to HEADS heads of ROWS // heads tokens (one [T, 512] kv row a program
# was 8,192 programs of 64 values). TILE pins one (perf/bench_rope.py sweeps them).
ROWS, HEADS = 16, 16
TILE: tuple[int, int] | None = None


def _tile(H: int) -> tuple[int, int]:
    if TILE is not None:
        return TILE[0], min(TILE[1], triton.next_power_of_2(H))
    bh = min(triton.next_power_of_2(H), HEADS)
    return max(1, ROWS // bh), bh


def rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False, inplace: bool = False) -> torch.Tensor:
    """x [T, ..., D] (last dim contiguous; other strides free), cis [T, rd/2] complex64 (rd/2 a power
    of two) -> new contiguous tensor of x's shape and dtype; inplace (x contiguous): x itself, its last
    rd dims rotated."""
    T, D = x.shape[0], x.shape[-1]
    if x.numel() == 0:           # no rows (a YOCO step whose kept rows skip this op): nothing to launch
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    half = cis.shape[-1]
    assert cis.dim() == 2 and cis.shape[0] == T and 2 * half <= D and half == triton.next_power_of_2(half)
    x3 = x.reshape(T, -1, D) if x.dim() != 3 else x                             # [T, H, D]
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    cis = cis.resolve_conj()
    cr = torch.view_as_real(cis if cis.stride(-1) == 1 else cis.contiguous())  # [T, rd/2, 2] fp32
    H = x3.shape[1]
    inplace = inplace and x.is_contiguous()
    y = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return y
    nope = D - 2 * half
    if inplace and _pairs_ok(x3, half):
        w = x3.view(torch.int32)                                                # [T, H, D / 2] words
        R = T * H
        rope_pairs_kernel[(triton.cdiv(R, PAIRS_ROWS),)](
            w, cr, R, H, w.stride(0), w.stride(1), cr.stride(0), WOFF=nope // 2, HALF=half, INVERSE=inverse,
            FMA=x.is_cuda, BLOCK_R=PAIRS_ROWS, num_warps=4, enable_fp_fusion=False, **pdl_args())
        return y
    bt, bh = _tile(H)
    rope_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
        x3, cr, y, T, H, x3.stride(0), x3.stride(1), cr.stride(0), D=D, NOPE=nope, HALF=half, INVERSE=inverse,
        FMA=x.is_cuda, BLOCK_T=bt, BLOCK_H=bh, COPY_NOPE=not inplace, BLOCK_NOPE=triton.next_power_of_2(max(nope, 1)),
        num_warps=4, enable_fp_fusion=False)
    return y
