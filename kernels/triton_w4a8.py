"""W4A8: the masked MoE GEMM on FP4 stacks with FP8 activations (opt-in: DEEPINFER_W4A8=1, select.py).

    w4a8_masked_moe_gemm(a, sa_t, packed_k, scale, masked_m, expected_m)   a [G, C, K] e4m3 slab with its
                                 scales transposed sa_t [K/32, >= G C] (moe_dispatch(fp8=True): the exact inputs
                                 of cuda_fp8_decode.fp8_masked_moe_gemm), an FP4 stack (fp4_layout.fp4_kernel_weight:
                                 packed_k [G, N, K/2] uint8, scale [G, N, K/32] E8M0 bytes) -> [G, C, N] bf16, rows
                                 past masked_m[g] unset; masked_m [G] int32 on the device, no host read (CUDA-graph
                                 capturable); expected_m a host-side guess of the tokens an expert (the token tile)
    w4a8_row_bases(packed_k, scale)   -> (E int32 [G, N], reason): each row's base exponent byte (once per stack)
    w4a8_decline_reason(packed_k, scale, device=None)   None where the kernel takes the stack, else the rule it
                                 breaks (the row rule's verdict cached per weight tensor: one pass over the stack)
    w4a8_stack(packed_k, scale)  the cached per-stack E (or None) and reason
    decode_fp4_e4m3_ref(...)     the decode in torch (tests): e2m1 nibble + LUT -> e4m3 byte
    D_MIN, D_MAX                 the admissible relative block exponents (normals only: -5..6)

Arithmetic (the release GEMM's values, as fp8_masked_moe_gemm_ref): per row n choose a base exponent byte E_n; a
block (n, 32-slice s) with E8M0 byte k_ns has relative exponent d = k_ns - E_n, and each of its weights
w = e2m1 * 2^(k_ns - 127) becomes the e4m3 value e2m1 * 2^d (exact while d is in [D_MIN, D_MAX]: below) times
2^(E_n - 127), moved out of the sum. Per 32-wide K slice one FP8 MMA (k32) of those e4m3 weights with the
e4m3 activations, times the token's scale (promoted into the fp32 accumulator per slice: one FFMA per
accumulator element, 0.5 a weight at a 16-token tile), and the row's 2^(E_n - 127) in the epilogue, bf16 out.

The d range (e4m3fn: bias 7, normals 2^-6 .. 448 = 1.75 * 2^8, subnormals m * 2^-9): the e2m1 magnitudes
{0.5, 1, 1.5, 2, 3, 4, 6} times 2^d are all e4m3 normals iff 0.5 * 2^d >= 2^-6 (d >= -5) and 6 * 2^d =
1.5 * 2^(d + 2) has exponent <= 8 (d <= 6: 384; d = 7 gives 768 > 448). With subnormals the low end would be
d >= -8 (0.5 * 2^-8 = 2^-9, 1.5 * 2^-8 = 3 * 2^-9: multiples of 2^-9), but a normal code is the d = 0 code
plus 8 d in each byte (one IMAD builds a block's table), so the kernel keeps to normals: d in [-5, 6], a
row's block exponents spanning <= 11 binades (real experts: 2^-8..2^-14, span <= 7). E_n = max_s k_ns - 6 (the
largest block at the top, d = 6). Blocks whose nibbles are all +-0 (fp4_kernel_weight maps byte-0 blocks to
byte 1 with zero nibbles) take no part in the rule: their table's entry 0 is 0 at any d. A stack with any row
outside the rule, or a row base below fp32's normals (E_n < 1), is declined (the caller keeps W4A16).

The decode (inline PTX, _W4A8_ASM; the interpreter twin _fp4_e4m3_ref in plain tl ops): the block's 8-byte
lookup table T (e4m3 codes of the eight e2m1 magnitudes at d) is two int32 built per (row, slice) from the
scale byte: T_lo = k * 0x08080800 + R_lo(E), T_hi = k * 0x08080808 + R_hi(E) (byte 0, magnitude 0, stays 0).
One 32-bit word w of packed bytes (8 nibbles) -> two registers of four e4m3:
    m = w & 0x77777777; a = prmt(T, m); b = prmt(T, m >> 16)     the eight magnitudes (nibble order)
    lo = prmt(a, b, 0x6420) | ((w << 4) & 0x80808080)            the low nibbles' e4m3 + their signs
    hi = prmt(a, b, 0x7531) | (w & 0x80808080)                   the high nibbles'
9 SASS instructions per 8 weights (W4A16's asm: 18).

Layouts (no shuffle): the FP8 wgmma k32 A fragment gives a thread (c = lane % 4), per row, k 4c..4c+3 (one
register) and 16+4c..16+4c+3 (another). fp4_kernel_layout stores, per k16 slice, byte j = k[j] | k[j+8] << 4,
so a 32-slice is 16 bytes and byte b holds physical k p(b, h) = 16 (b // 8) + b % 8 + 8 h (h: nibble). Thread c
reads word c (bytes 4c..4c+3) of the row's 16: the asm's lo register is logical k 4c..4c+3 (b = 4c + i,
h = 0), its hi register logical 16 + 4c + i (h = 1): logical k = 16 h + b. The K order inside a slice is
then a permutation applied to the activations instead: logical k = 16 h + b reads physical p(b, h), i.e.
the slice's 8-byte chunks 1 and 2 swapped (x loaded from columns [0..7, 16..23, 8..15, 24..31]): 8-byte
contiguous loads, and the dot's sum over the slice is the same set of products. The FP4 stack itself is
unchanged (the one copy W4A16 and the prefill kernel read).
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from .tensor_version import tensor_version

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
D_MIN, D_MAX = -5, 6            # relative block exponents whose e2m1 magnitudes are all e4m3 normals
# e4m3 codes of the e2m1 magnitudes 0, 0.5, 1, 1.5 / 2, 3, 4, 6 at d = 0 (bytes 0..3 / 4..7 of the table)
LUT_LO0, LUT_HI0 = 0x3C383000, 0x4C484440
LUT_LO_STEP, LUT_HI_STEP = 0x08080800, 0x08080808        # + 8 d in the exponent field of each nonzero entry
_LO0, _HI0, _LO_STEP, _HI_STEP = (tl.constexpr(v) for v in (LUT_LO0, LUT_HI0, LUT_LO_STEP, LUT_HI_STEP))


# ------------------------------------------------------------------------------------------------ decode
_W4A8_ASM = tl.constexpr("""
{
.reg .b32 m, mh, a, b, s;
and.b32 m, $2, 0x77777777;
shr.b32 mh, m, 16;
prmt.b32 a, $3, $7, m;
prmt.b32 b, $3, $7, mh;
shl.b32 s, $2, 4;
and.b32 s, s, 0x80808080;
prmt.b32 $0, a, b, 0x6420;
or.b32 $0, $0, s;
and.b32 s, $2, 0x80808080;
prmt.b32 $1, a, b, 0x7531;
or.b32 $1, $1, s;
}
""")


@triton.jit
def _fp4_e4m3(w, tlo, thi):
    """w uint8 (packed e2m1 pairs, four consecutive bytes a register), tlo / thi int32 (the block's table,
    broadcast to w's shape) -> (lo, hi) e4m3: the low and the high nibble of each byte."""
    return tl.inline_asm_elementwise(asm=_W4A8_ASM, constraints="=r,=r,r,r,r,r,r,r,r,r,r", args=[w, tlo, thi],
                                     dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)


@triton.jit
def _e4m3_code_f32(code):
    """e4m3 byte (int32) -> its value in fp32 (the bit placement s << 31 | em << 20 is the value * 2^-120,
    subnormals included), times 2^120."""
    bits = ((code & 0x80) << 24) | ((code & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36


@triton.jit
def _fp4_e4m3_ref(w, tlo, thi):
    """_fp4_e4m3 in plain tl ops (interpreter): the same table lookup per nibble, as fp32 values."""
    u = w.to(tl.int32) & 0xFF
    return _nibble_e4m3_ref(u & 0xF, tlo, thi), _nibble_e4m3_ref(u >> 4, tlo, thi)


@triton.jit
def _nibble_e4m3_ref(n, tlo, thi):
    mag = n & 7
    tab = tl.where(mag < 4, tlo >> (8 * (mag & 3)), thi >> (8 * (mag & 3))) & 0xFF
    return _e4m3_code_f32(tab | ((n & 8) << 4))


@triton.jit
def w4a8_masked_kernel(a_ptr, sa_ptr, w_ptr, s_ptr, e_ptr, c_ptr, mm_ptr,
                       C, N, K, SA_LD, SPLIT_K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr,
                       OUT_F32: tl.constexpr, UPCAST: tl.constexpr = False):
    """a [G, C, K] e4m3, sa [K/32, SA_LD] f32 (column g C + t), w [G, N, K/2] uint8 in fp4_kernel_layout,
    s [G, N, K/32] E8M0 bytes, e [G, N] int32 row base bytes, mm [G] int32. Swapped tiles: acc [BN, BM]
    (weight rows on the wgmma's M side). Grid (N/BN, C/BM, G*SPLIT_K). OUT_F32: c is the split-K workspace
    [SPLIT_K, G, C, N] f32 (row scale applied), else c is [G, C, N] bf16. UPCAST: the interpreter's fp32 twin."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    m_lim = tl.load(mm_ptr + g)
    if pid_m * BM >= m_lim:
        return
    nkb = K // BK
    per = tl.cdiv(nkb, SPLIT_K)
    kb0 = split * per
    kb1 = tl.minimum(kb0 + per, nkb)
    g64 = g.to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < m_lim
    n_ok = rn < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    # the row's table offsets: T = k * STEP + (T0 - E * STEP)
    e_row = tl.load(e_ptr + g64 * N + rn, mask=n_ok, other=127)
    r_lo = (e_row * (-_LO_STEP) + _LO0)[:, None]
    r_hi = (e_row * (-_HI_STEP) + _HI0)[:, None]
    # logical k = 16 h + b of a slice reads physical 16 (b // 8) + b % 8 + 8 h: 8-byte chunks 1 and 2 swapped
    r32 = tl.arange(0, 32)
    xk = (r32 % 8) + 8 * ((r32 // 8) % 2) * 2 + 8 * (r32 // 16)
    a_ptrs = a_ptr + (g64 * C + rm[:, None].to(tl.int64)) * K + xk[None, :]
    sa_ptrs = sa_ptr + g64 * C + rm
    w_ptrs = w_ptr + (g64 * N + rn[:, None].to(tl.int64)) * (K // 2) + tl.arange(0, 16)[None, :]
    if BK == 128:
        # a row's four scale bytes of a K step as one int32 word (K % 128 == 0: 4-byte aligned rows): a 4-byte
        # copy the pipeliner takes (single bytes it cannot: they were plain loads, each a memory latency)
        sw_ptrs = s_ptr.to(tl.pointer_type(tl.int32)) + (g64 * N + rn.to(tl.int64)) * (K // 128)
    else:
        s_ptrs = s_ptr + (g64 * N + rn.to(tl.int64)) * (K // 32)
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        if BK == 128:
            word = tl.load(sw_ptrs + kb, mask=n_ok, other=0)
        for j in tl.static_range(BK // 32):
            ks = kb * (BK // 32) + j                                          # the 32-slice
            x = tl.load(a_ptrs + ks * 32, mask=m_ok[:, None], other=0.0)       # [BM, 32] e4m3 (permuted)
            w = tl.load(w_ptrs + ks * 16, mask=n_ok[:, None], other=0)        # [BN, 16] packed bytes
            if BK == 128:
                kbyte = ((word >> (8 * j)) & 0xFF)[:, None]
            else:
                kbyte = tl.load(s_ptrs + ks, mask=n_ok, other=0).to(tl.int32)[:, None]
            sa = tl.load(sa_ptrs + ks.to(tl.int64) * SA_LD, mask=m_ok, other=0.0)
            tlo = tl.broadcast_to(kbyte * _LO_STEP + r_lo, (BN, 16))
            thi = tl.broadcast_to(kbyte * _HI_STEP + r_hi, (BN, 16))
            if UPCAST:
                lo, hi = _fp4_e4m3_ref(w, tlo, thi)
                x = x.to(tl.float32)
            else:
                lo, hi = _fp4_e4m3(w, tlo, thi)
            wd = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, 32))   # logical k = 16 h + b
            acc += tl.dot(wd, tl.trans(x)) * sa[None, :]
    rs = (e_row.to(tl.int32) << 23).to(tl.float32, bitcast=True)     # 2^(E - 127) (E >= 1: an fp32 normal)
    acc = acc * rs[:, None]
    c_ptrs = rm[None, :].to(tl.int64) * N + rn[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if OUT_F32:
        tl.store(c_ptr + (split.to(tl.int64) * (tl.num_programs(2) // SPLIT_K) + g64) * C * N + c_ptrs, acc, mask=mask)
    else:
        tl.store(c_ptr + g64 * C * N + c_ptrs, acc.to(tl.bfloat16), mask=mask)


# ------------------------------------------------------------------------------------------------ host side
def _block_bytes(scale: torch.Tensor, packed_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 bytes int32 [.., N, K/32], whether the block holds a nonzero magnitude [.., N, K/32])."""
    u = packed_k.view(torch.uint8)
    live = ((u & 0x77) != 0).reshape(*u.shape[:-1], -1, 16).any(-1)
    return scale.view(torch.uint8).to(torch.int32), live


def w4a8_row_bases(packed_k: torch.Tensor, scale: torch.Tensor, chunk: int = 4
                   ) -> tuple[torch.Tensor | None, str | None]:
    """(E int32 [G, N]: each row's base exponent byte, max over its live blocks of k - D_MAX (127 for a row
    with none), None) where every live block's d = k - E is in [D_MIN, D_MAX] and E >= 1, else (None, the rule
    broken, with the first offending row). A pass over the stack (chunks of `chunk` experts)."""
    G = packed_k.shape[0]
    bases = []
    for g0 in range(0, G, chunk):
        k, live = _block_bytes(scale[g0:g0 + chunk], packed_k[g0:g0 + chunk])
        hi = torch.where(live, k, torch.full_like(k, -1)).amax(-1)
        lo = torch.where(live, k, torch.full_like(k, 1 << 20)).amin(-1)
        any_live = hi >= 0
        e = torch.where(any_live, hi - D_MAX, torch.full_like(hi, 127))
        bad = any_live & ((lo - e < D_MIN) | (e < 1))
        if bool(bad.any()):
            idx = bad.nonzero()[0].tolist()
            gi, n = g0 + idx[0], idx[1]
            return None, (f"each row's live block scales within {D_MAX - D_MIN} binades of its largest (e4m3 normals; "
                          f"expert {gi} row {n}: E8M0 bytes {int(lo[tuple(idx)])}..{int(hi[tuple(idx)])})")
        bases.append(e)
    return (torch.cat(bases) if bases else torch.empty(0, packed_k.shape[1], dtype=torch.int32,
                                                        device=packed_k.device)).to(torch.int32).contiguous(), None


_STACKS: dict[int, tuple] = {}      # id(scale) -> (weakref to scale, weakref to packed, versions, E, reason)


def w4a8_stack(packed_k: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """w4a8_row_bases of this stack, computed once per (weight, scale) tensor pair (in-place writes recompute)."""
    key = id(scale)
    ver = (tensor_version(packed_k), tensor_version(scale), packed_k.data_ptr(), scale.data_ptr())
    hit = _STACKS.get(key)
    if hit is None or hit[0]() is not scale or hit[1]() is not packed_k or hit[2] != ver:
        bases, reason = w4a8_row_bases(packed_k, scale)
        hit = _STACKS[key] = (weakref.ref(scale), weakref.ref(packed_k), ver, bases, reason)
    return hit[3], hit[4]


def _shape_reason(packed_k: torch.Tensor, scale: torch.Tensor) -> str | None:
    if packed_k.dim() != 3 or packed_k.dtype != torch.uint8 or not packed_k.is_contiguous():
        return "a contiguous uint8 FP4 stack [G, N, K/2] (fp4_kernel_layout)"
    g, n, k2 = packed_k.shape
    if k2 % 16:
        return "K a multiple of 32"
    if scale.shape != (g, n, k2 // 16) or scale.element_size() != 1 or not scale.is_contiguous():
        return "E8M0 scale bytes [G, N, K/32], contiguous"
    return None


def w4a8_decline_reason(packed_k: torch.Tensor, scale: torch.Tensor, device=None) -> str | None:
    """None where w4a8_masked_moe_gemm takes this FP4 stack, else the rule it breaks: an SM90 GPU (FP8 wgmma;
    device None: not checked), the stack's shape and dtype, and the d range of every row (w4a8_stack)."""
    if device is not None and device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(idx)[0] != 9:
            return "an SM90 GPU (FP8 wgmma with A from registers)"
    elif device is not None and not INTERPRET:
        return "a CUDA device (or the Triton interpreter)"
    reason = _shape_reason(packed_k, scale)
    if reason is not None:
        return reason
    return w4a8_stack(packed_k, scale)[1]


def w4a8_config(expected_m: int, n: int, k: int, groups: int, device) -> dict:
    """Swapped tiles: 128 weight rows (two m64 wgmmas a warpgroup: the per-slice wgmma fence, arrive / wait
    and descriptors shared by twice the weights; sm_90a K loop 3.6 SASS instructions a weight against 5.0 at
    BN 64), BK 128 where K allows, a token tile of the next power of two of expected_m (16..64; 8 warps at
    64 tokens; a busier expert takes more tiles), split-K where the (N, G) grid leaves SMs idle."""
    bk = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)
    bm = min(64, max(16, triton.next_power_of_2(max(1, expected_m))))     # 128 tokens spill (255 registers)
    bn = 128
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    tiles = triton.cdiv(n, bn) * groups
    split = 1
    if tiles < 2 * sms:
        split = max(1, min(2 * sms // tiles, (k // bk) // 4, 16))
    return dict(BM=bm, BN=bn, BK=bk, SPLIT_K=split, NUM_STAGES=3, num_warps=8 if bm >= 64 else 4)


def w4a8_masked_moe_gemm(a: torch.Tensor, sa_t: torch.Tensor, packed_k: torch.Tensor, scale: torch.Tensor,
                         masked_m: torch.Tensor, expected_m: int, out: torch.Tensor | None = None,
                         cfg_override: dict | None = None, partials: bool = False) -> torch.Tensor:
    """a [G, C, K] e4m3 (expert g's tokens in rows 0..masked_m[g]-1), sa_t [K/32, >= G C] f32 (column g C + t),
    packed_k [G, N, K/2] uint8 in fp4_kernel_layout, scale [G, N, K/32] E8M0 bytes (fp4_kernel_weight's), masked_m
    [G] int32 on the device -> [G, C, N] bf16, rows past masked_m[g] unset (zero after a split-K reduce). Raises
    where w4a8_decline_reason does not return None (the d rule is checked once per stack and cached).
    partials: return the fp32 split-K workspace [SPLIT_K, G, C, N] (tests)."""
    from .triton_gemm import splitk_reduce_kernel
    G, C, k = a.shape
    n = packed_k.shape[1]
    assert packed_k.shape[0] == G and packed_k.shape[2] * 2 == k and a.dtype == torch.float8_e4m3fn, \
        (tuple(a.shape), tuple(packed_k.shape))
    reason = _shape_reason(packed_k, scale)
    bases = None
    if reason is None:
        bases, reason = w4a8_stack(packed_k, scale)
    if reason is not None:
        raise ValueError(f"w4a8_masked_moe_gemm needs {reason}: w {tuple(packed_k.shape)}")
    assert masked_m.dtype == torch.int32 and masked_m.numel() == G and masked_m.is_contiguous()
    assert sa_t.dim() == 2 and sa_t.shape[0] == k // 32 and sa_t.shape[1] >= G * C and sa_t.dtype == torch.float32 \
        and sa_t.stride(1) == 1, (tuple(sa_t.shape), G, C)
    cfg = w4a8_config(expected_m, n, k, G, a.device)
    cfg.update(cfg_override or {})
    split = cfg["SPLIT_K"]
    c = out if out is not None else torch.empty(G, C, n, dtype=torch.bfloat16, device=a.device)
    if G == 0 or C == 0 or n == 0:
        return c
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(C, cfg["BM"]), G * split)
    kw = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"],
              UPCAST=INTERPRET)
    args = (a.contiguous(), sa_t, packed_k, scale.view(torch.uint8), bases)
    if split == 1 and not partials:
        w4a8_masked_kernel[grid](*args, c, masked_m, C, n, k, sa_t.stride(0), 1, OUT_F32=False, **kw)
        return c
    ws = torch.zeros(split, G, C, n, dtype=torch.float32, device=a.device)
    w4a8_masked_kernel[grid](*args, ws, masked_m, C, n, k, sa_t.stride(0), split, OUT_F32=True, **kw)
    if partials:
        return ws
    total = G * C * n
    splitk_reduce_kernel[(triton.cdiv(total, 1024),)](ws, c, split, total, C, n, G, BLOCK=1024, num_warps=4)
    return c


# ------------------------------------------------------------------------------------------------ reference
def decode_fp4_e4m3_ref(nibble: torch.Tensor, kbyte: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The kernel's decode in torch: e2m1 nibbles (int) with their block's E8M0 byte and row base E -> e4m3
    bytes (uint8): table entry of the magnitude at d = k - E, sign bit 3 -> 7."""
    k, e = kbyte.to(torch.int64), e.to(torch.int64)
    lo = (k * LUT_LO_STEP + LUT_LO0 - e * LUT_LO_STEP) & 0xFFFFFFFF
    hi = (k * LUT_HI_STEP + LUT_HI0 - e * LUT_HI_STEP) & 0xFFFFFFFF
    n = nibble.to(torch.int64)
    mag = n & 7
    tab = torch.where(mag < 4, lo >> (8 * (mag & 3)), hi >> (8 * (mag & 3))) & 0xFF
    return (tab | ((n & 8) << 4)).to(torch.uint8)
