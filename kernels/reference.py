"""Plain-torch references of the V4.1 kernels (DeepSeek-V4.1-Flash `inference/kernel.py` semantics).

Every op here runs on any device and is the ground truth the fast paths are tested against:

    act_quant_ref        FP8 e4m3 fake-quantization, blocks of 32, power-of-two (ue8m0) scales
    act_quant_fp8_ref    the same rounding returned as (e4m3 values, fp32 pow2 scales) for the FP8
                         GEMMs (triton_quant.act_quant_fp8; block 128 feeds DeepGEMM)
    fp4_quant_ref        FP4 e2m1 fake-quantization: block 16 with e4m3 scales (compressed KV),
                         block 32 with power-of-two scales (indexer q / k)
    dequant_fp8_ref      FP8 weight [N, K] + E8M0 scale per 32x32 block -> exact float values
    dequant_fp4_ref      I8-packed e2m1 weight [N, K/2] + E8M0 scale per 32 along K -> exact values
    e8m0_to_float        raw E8M0 bytes -> 2^(b - 127)
    sparse_attn_ref      sink attention over gathered rows, online softmax in blocks of 64
    index_scores_paged_ref  lightning-indexer scores of a batch, each query against its sequence's keys
    topk_ids_ref         ids of each row's k largest, ties to the lowest id (one integer key per entry)
    index_topk_ref       the indexer's picks: top-k ids ascending, -1 where unreachable (-inf, >= lens)
    topk_block_mask_ref  the candidate blocks' top-k as an entry mask (two-level top-k, level one)
    candidate_blocks_ref level one from the scores: block maxima, the newest entry's block pinned, then that mask
    window_pool_ref      the step's window lists as rows of the ring and the fresh rows (int32)
    block_rows_ref       cache pool rows of (sequence, entry) pairs through the block tables
    carry_write_ref      the ratio > 1 compressor's carry ring: the step's rows written to their ring rows
    compress_members_ref the ratio > 1 compressor's member rows: the step's rows or the carry ring's
    compress_pool_ref    the ratio > 1 compressor's latents: its members' softmax-weighted sum, RMS-normed
    router_topk_ref      the MoE gate after its GEMM: sqrt(softplus(logits / temp)), biased top-k, weights
    moe_route_ref        the masked MoE's pair -> slab row map (stable by expert) and per-expert counts
    moe_dispatch_ref     act_quant of each token into its pairs' slab rows
    moe_swiglu_quant_ref clamped SwiGLU x routing weight, bf16, act_quant, at the pairs' rows
    moe_combine_ref      per-token fp32 sum of the routed rows (ascending expert id) + the shared expert
    hc_split_sinkhorn_ref  mHC pre / post / comb coefficients (Sinkhorn ending on a column pass)
    rope_ref             rotary embedding on adjacent pairs (optionally inverse)
    rope_freqs_ref       YaRN-blended rotary frequencies
    norm_rope_quant_ref  the attention's KV row: rms_norm_ref, rope_ref, act_quant_ref
    linear_fp32_ref      x @ w^T in fp32 arithmetic, fp32 out (bf16 operands on CUDA: torch.mm out_dtype)
    ngram_hash_ref       Engram's n-gram hash ids of a batch's new tokens (look-back into each chunk's history)
    engram_rows_ref      Engram table rows (e4m3 + E8M0 per 32) dequantized to bf16
    engram_gate_ref      Engram's gated add after its wkv GEMM

Fake-quantized values are returned in the input dtype; every quantized value x * 2^k with a 3-bit
(e4m3) or 1-bit (e2m1) mantissa is exact in bf16, so nothing is lost by storing them as bf16.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
_INV448 = 1.0 / 448.0
_INV6 = 1.0 / 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROW_TILE = 128          # sparse_attn_ref's query rows per piece


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for positive fp32 t, from the float bits (exponent + 1 when the mantissa is
    non-zero): no log2/exp2 rounding can move a power of two to the next one."""
    bits = t.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def act_quant_ref(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 round trip along the last dim: s = 2^ceil(log2(max(amax, 1e-4) / 448)), e4m3(x / s) * s."""
    g = x.float().unflatten(-1, (-1, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * torch.tensor(_INV448))
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2).to(x.dtype)


def act_quant_fp8_ref(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant_ref's rounding as (e4m3 [M, K], fp32 pow2 scales [M, K/block]), M = prod(leading
    dims): the reference of triton_quant.act_quant_fp8. q * s equals act_quant_ref(x, block) exactly."""
    g = x.reshape(-1, x.shape[-1]).float().unflatten(-1, (-1, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * torch.tensor(_INV448))
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (|v| <= 6), ties to the even code: grid steps 0.5 below 2, 1 below 4, else 2."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_quant_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP4 round trip along the last dim. block 16: scale = e4m3(max(amax, 6*2^-9) / 6) (compressed
    KV); block 32: scale = 2^ceil(log2(max(amax, 6*2^-126) / 6)) (indexer q and keys)."""
    g = x.float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True)
    if block == 16:
        s = (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
    else:
        s = pow2_ceil(amax.clamp_min(6 * 2**-126) * torch.tensor(_INV6))
    return (e2m1_round((g / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2).to(x.dtype)


def fp4_rows_width(d: int) -> int:
    """Bytes of one packed FP4 row of d values (fp4_pack_rows_ref): d / 2 code bytes and d / 32 E8M0 scale
    bytes, padded to 16 so every row starts 16-byte aligned (d 128: 80 bytes against 256 in bf16)."""
    assert d % 32 == 0, d
    return -(-(d // 2 + d // 32) // 16) * 16


def fp4_rows_dim(width: int) -> int:
    """The d of fp4_rows_width(d) == width (17 bytes a 32 values, so each d has its own width)."""
    d = next((32 * k for k in range(1, width + 1) if fp4_rows_width(32 * k) >= width), 0)
    assert d and fp4_rows_width(d) == width, f"{width} bytes is no packed FP4 row's width"
    return d


def fp4_pack_rows_ref(r: torch.Tensor) -> torch.Tensor:
    """r [..., d] values on the FP4 grid of fp4_quant_ref(block 32) (a power-of-two scale a 32-block) ->
    uint8 [..., fp4_rows_width(d)]: byte j holds the e2m1 codes of values 2j (low nibble) and 2j + 1,
    byte d / 2 + b the E8M0 exponent of block b's scale s = 2^ceil(log2(max(|r|max, 6 * 2^-126) / 6))
    (from the values: every r / s is on the grid, so fp4_unpack_rows_ref returns r exactly, signed zeros
    included). The indexer's keys live in the cache pool in this form."""
    d = r.shape[-1]
    g = r.float().unflatten(-1, (-1, 32))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(6 * 2**-126) * torch.tensor(_INV6))
    a = (g / s).abs()
    code = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4)).to(torch.uint8)
    code = (code | (torch.signbit(g).to(torch.uint8) << 3)).flatten(-2)
    out = torch.zeros(*r.shape[:-1], fp4_rows_width(d), dtype=torch.uint8, device=r.device)
    out[..., : d // 2] = code[..., 0::2] | (code[..., 1::2] << 4)
    out[..., d // 2: d // 2 + d // 32] = ((s.squeeze(-1).view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return out


def fp4_unpack_rows_ref(p: torch.Tensor, d: int) -> torch.Tensor:
    """fp4_pack_rows_ref's rows [..., fp4_rows_width(d)] uint8 -> the values [..., d] bf16 (exact): the
    release's MXFP4 layout, so dequant_fp4_ref decodes it."""
    rows = p.reshape(-1, p.shape[-1])
    v = dequant_fp4_ref(rows[:, : d // 2], rows[:, d // 2: d // 2 + d // 32])
    return v.bfloat16().reshape(*p.shape[:-1], d)


def e8m0_to_float(raw: torch.Tensor) -> torch.Tensor:
    """Raw E8M0 bytes (uint8 / int8 / float8_e8m0fnu storage) -> float32 2^(b - 127)."""
    b = raw.view(torch.uint8).to(torch.int32)
    return (b << 23).view(torch.float32)


def dequant_fp8_ref(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """[N, K] e4m3 with one E8M0 scale per block x block tile -> float32 [N, K] (exact)."""
    n, k = w.shape
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.view(torch.float8_e4m3fn).float() * s


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0..15 -> float32 (E2M1_GRID, bit 3 the sign), decoded arithmetically on the codes'
    device: no host-made table, so it can run inside a CUDA graph capture (a table copied to the GPU cannot)."""
    c = code.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1 + 0.5 * m))
    return torch.where(c >= 8, -mag, mag)


def dequant_fp4_ref(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """[N, K/2] bytes of e2m1 pairs (element 2j in the low nibble) + E8M0 per 32 along K -> [N, K]."""
    u = packed.view(torch.uint8)
    w = torch.stack([e2m1_values(u & 15), e2m1_values(u >> 4)], -1).flatten(-2)
    return w * e8m0_to_float(scale).repeat_interleave(block, 1)


def linear_fp32_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in fp32 arithmetic -> [..., N] fp32. On CUDA with bf16 operands a bf16
    GEMM with fp32 accumulation and output: bf16 products are exact in fp32, so it is the fp32 GEMM's
    math without an fp32 copy of the weight per call (the head's would be 2.6 GB at full width)."""
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16:
        # the output's last size named: a step with no logits rows (a prompt chunk that ends no prompt)
        # has x [0, K], and view(0, -1) is ambiguous
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x.float(), w.float())


def rope_freqs_ref(dim: int, num_pos: int, original_seq_len: int, base: float, factor: float,
                   beta_fast: float, beta_slow: float, device=None) -> torch.Tensor:
    """complex64 [num_pos, dim/2]. With original_seq_len > 0, YaRN: wavelengths beyond the training
    context are divided by `factor`, with a linear ramp between the beta_fast and beta_slow dims.
    No attention-scale (mscale) factor: V4.1 has none."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(num_pos), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def rope_ref(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cis.shape[-1] dims of x (adjacent pairs as complex numbers), out of place.
    x: [T, ..., D]; cis: [T, rd/2] complex64 (one row per leading index)."""
    rd = 2 * cis.shape[-1]
    if inverse:
        cis = cis.conj()
    c = cis.view(cis.shape[0], *([1] * (x.dim() - 2)), cis.shape[-1])
    z = torch.view_as_complex(x[..., -rd:].float().contiguous().unflatten(-1, (-1, 2)))
    rot = torch.view_as_real(z * c).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rot], dim=-1)


def hc_split_sinkhorn_ref(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                          iters: int, eps: float):
    """mixes [..., (2+hc)*hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc].

    comb: row softmax + eps, then a column normalization, then (iters - 1) x (row, column); so it
    ends on a column normalization and its rows do not sum exactly to one."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idxs: torch.Tensor,
                    scale: float, block: int = 64) -> torch.Tensor:
    """Sink attention of each query over its own list of kv rows (K = V = the same latent).

    q: [n, H, D] bf16; kv: [M, D] bf16; sink: [H] fp32; idxs: [n, L] int (-1 = nothing).
    Mirrors the kernel's rounding points: scores in fp32, the list walked in blocks of `block`
    with an online softmax; each block's probabilities exp(s - m_running) are rounded to bf16 for
    the P.V product while the denominator sums them in fp32; the sink adds exp(sink - m) to the
    denominator only. Returns [n, H, D] in q's dtype.
    """
    n, H, D = q.shape
    L = idxs.shape[1]
    if L == 0:
        return torch.zeros_like(q)
    if n > 2 * ROW_TILE:   # rows are independent: tiles keep the gathered rows in cache (a 2048-row
        # prefill: 107 ms in one piece, 36 ms in tiles of 128 on one CPU thread; same bits)
        return torch.cat([sparse_attn_ref(q[i:i + ROW_TILE], kv, sink, idxs[i:i + ROW_TILE], scale, block)
                          for i in range(0, n, ROW_TILE)])
    pad = -L % block
    if pad:
        idxs = torch.nn.functional.pad(idxs, (0, pad), value=-1)
    nb = idxs.shape[1] // block
    valid = idxs >= 0                                                   # [n, Lp]
    rows = kv[idxs.clamp_min(0).long()].float()                         # [n, Lp, D]
    s = torch.einsum("nhd,nld->nhl", q.float(), rows) * scale          # [n, H, Lp]
    s = s.masked_fill(~valid[:, None, :], -math.inf).view(n, H, nb, block)
    m_blk = s.amax(-1).cummax(-1).values                                # running max after each block
    m_safe = m_blk.clamp_min(-1e30)
    p = torch.exp(s - m_safe[..., None])                                # [n, H, nb, block] fp32
    m_fin = m_safe[..., -1:]                                            # [n, H, 1]
    carry = torch.exp(m_safe - m_fin)                                   # rescale of each block's sums
    den = (p.sum(-1) * carry).sum(-1) + torch.exp(sink.float()[None, :] - m_fin[..., 0])
    pb = p.to(torch.bfloat16).float()
    pv = torch.einsum("nhbl,nbld->nhbd", pb, rows.view(n, nb, block, D))
    out = (pv * carry[..., None]).sum(2) / den[..., None]
    return out.to(q.dtype)


def index_scores_paged_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, seq_of: torch.Tensor,
                           row_in_seq: torch.Tensor, max_q: int, lens: torch.Tensor) -> torch.Tensor:
    """Indexer scores of a batch: query t (of sequence seq_of[t]) against that sequence's keys.

    q [T, IH, ID], w [T, IH], keys [B, E, ID] (sequence b's entries 0..E-1), lens [T] -> [T, E]
    bf16: sum_h relu(q_h . k) * w_h with bf16 rounding after the product, the weighting and the head
    sum; entries e >= lens[t] are -inf. The queries are laid out per sequence ([B, max_q], row
    row_in_seq[t]) so each sequence is one product against its own keys."""
    T, IH, ID = q.shape
    B, E, _ = keys.shape
    if T == B * max_q:        # every sequence has max_q rows (a prefill, a decode batch): a view
        s = torch.einsum("bqhd,bed->bqhe", q.view(B, max_q, IH, ID).float(), keys.float()).flatten(0, 1)
    else:
        qp = q.new_zeros(B, max_q, IH, ID)
        qp[seq_of, row_in_seq] = q
        s = torch.einsum("bqhd,bed->bqhe", qp.float(), keys.float())[seq_of, row_in_seq]
    s = s.to(torch.bfloat16)
    s = s.relu() * w.unsqueeze(-1)
    s = s.float().sum(1).to(torch.bfloat16)                                # [T, E]
    return s.masked_fill(torch.arange(E, device=s.device) >= lens[:, None], -math.inf)


def moe_route_ref(indices: torch.Tensor, n_experts: int, contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, K] -> (counts [E] int32, slot [T*K] int64): pair p = t*K + k goes to row
    slot[p] = e * T + rank of the [E, T, d] slab, rank = its place in a stable sort by expert:

        e_sorted   0  0  0 | 2 | 5  5 ...      order: the pair at each sorted position
        start      counts' exclusive cumsum: start[0] = 0, start[2] = 3, start[5] = 4
        rank       position - start[e_sorted] = 0 1 2 | 0 | 0 1
    No host read (scatter_add, not bincount). contiguous: slot[p] = the pair's sorted position itself
    (start[e] + rank: the row of a slab that holds the pairs sorted by expert, no padding). A pick outside
    [0, E) is dropped (an expert-parallel rank's picks of other ranks' experts): slot -1, counted nowhere."""
    T = indices.shape[0]
    flat = indices.flatten()
    dropped = (flat < 0) | (flat >= n_experts)
    flat = torch.where(dropped, n_experts, flat)                      # sorted after every real pick
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    counts = torch.zeros(n_experts + 1, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    rank = torch.arange(flat.numel(), device=flat.device) - (counts.cumsum(0) - counts)[e_sorted]
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel(), device=flat.device) if contiguous else e_sorted * T + rank
    return counts[:n_experts], slot.masked_fill_(dropped, -1)


def moe_dispatch_ref(x: torch.Tensor, slot: torch.Tensor, K: int, n_experts: int) -> torch.Tensor:
    """x [T, d] -> xp [E, T, d] with row slot[p] = act_quant(x)[p // K] (other rows unset; a dropped pick,
    slot -1, writes nothing)."""
    T, d = x.shape
    xp = x.new_empty(n_experts * T + 1, d)                    # + one row the dropped picks land on
    xp[_slab_rows(slot, n_experts * T)] = act_quant_ref(x)[torch.arange(T * K, device=x.device) // K]
    return xp[:n_experts * T].view(n_experts, T, d)


def _slab_rows(slot: torch.Tensor, rows: int) -> torch.Tensor:
    """slot with a dropped pick's -1 sent to row `rows` (one past the slab: no boolean mask, no host read)."""
    return torch.where(slot >= 0, slot, rows)


def _swiglu_rows_ref(gu: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, limit: float,
                     inter: int) -> torch.Tensor:
    """[T*K, inter] in gu's dtype: each pair's clamped SwiGLU in fp32 times its routing weight, rounded
    (a dropped pick's row, slot -1, is garbage: the callers store only live rows)."""
    g = gu.reshape(-1, 2 * inter)[slot.clamp(min=0)].float()                  # [T*K, 2 inter]
    gate, up = g[:, :inter], g[:, inter:]
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return (weights.flatten()[:, None] * (torch.nn.functional.silu(gate) * up)).to(gu.dtype)


def moe_swiglu_quant_ref(gu: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, limit: float,
                         inter: int) -> torch.Tensor:
    """gu [E, T, 2 inter] -> hp [E, T, inter]: at each pair's row, the clamped SwiGLU in fp32 times
    the routing weight, to bf16, then act_quant (Expert.forward's rounding points; rows unset elsewhere)."""
    E, T, _ = gu.shape
    hp = gu.new_empty(E * T + 1, inter)
    hp[_slab_rows(slot, E * T)] = act_quant_ref(_swiglu_rows_ref(gu, slot, weights, limit, inter))
    return hp[:E * T].view(E, T, inter)


def slab_scales_ld(n_experts: int, T: int) -> int:
    """Columns of an [E, T, .] slab's transposed scales: E T rounded up to 4 (TMA's 16-byte row stride)."""
    return max(4, -(-n_experts * T // 4) * 4)


def _fp8_slab_ref(rows: torch.Tensor, slot: torch.Tensor, E: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [P, n] (unrounded) -> (e4m3 slab [E, T, n] with act_quant_fp8(rows)[p] at row slot[p], its scales
    transposed [n / 32, slab_scales_ld(E, T)] at column slot[p]; zero elsewhere; slot -1: dropped)."""
    n = rows.shape[-1]
    q, s = act_quant_fp8_ref(rows)
    at = _slab_rows(slot, E * T)
    xq = torch.zeros(E * T + 1, n, dtype=torch.float8_e4m3fn, device=rows.device)
    xq[at] = q
    ld = slab_scales_ld(E, T)
    sa = torch.zeros(n // 32, max(ld, E * T + 1), dtype=torch.float32, device=rows.device)
    sa[:, at] = s.T
    return xq[:E * T].view(E, T, n), sa[:, :ld].contiguous()


def moe_dispatch_fp8_ref(x: torch.Tensor, slot: torch.Tensor, K: int, n_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_dispatch_ref's rows as (e4m3 [E, T, d], scales transposed [d / 32, slab_scales_ld(E, T)]): the
    input of fp8_masked_moe_gemm_ref; q * s at each pair's row equals moe_dispatch_ref's."""
    T = x.shape[0]
    return _fp8_slab_ref(x[torch.arange(T * K, device=x.device) // K], slot, n_experts, T)


def moe_swiglu_quant_fp8_ref(gu: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, limit: float,
                             inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_swiglu_quant_ref's rows in the same FP8 form as moe_dispatch_fp8_ref."""
    E, T, _ = gu.shape
    return _fp8_slab_ref(_swiglu_rows_ref(gu, slot, weights, limit, inter), slot, E, T)


def fp8_masked_moe_gemm_ref(a: torch.Tensor, sa_t: torch.Tensor, w: torch.Tensor, w_rows: torch.Tensor,
                            masked_m: torch.Tensor) -> torch.Tensor:
    """The masked MoE GEMM on FP8 operands: a [G, C, K] e4m3 with scales transposed sa_t [K/32, >= G C], w
    [G, N, K] e4m3 with one scale a row w_rows [G, N, 1] -> [G, C, N] bf16, the dequantized operands' fp32
    product (the same batched matmul as the W8A16 reference on those values); rows past masked_m[g] zero."""
    G, C, K = a.shape
    s = sa_t[:, :G * C].T.reshape(G, C, K // 32).repeat_interleave(32, dim=-1)
    x = a.float() * s
    wd = w.float() * w_rows.reshape(G, -1, 1).float()
    out = torch.bmm(x, wd.transpose(1, 2)).to(torch.bfloat16)
    live = torch.arange(C, device=a.device)[None, :] < masked_m.to(a.device).long()[:, None]
    return torch.where(live[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def swiglu_quant_ref(gu: torch.Tensor, limit: float, inter: int) -> torch.Tensor:
    """gu [T, 2 inter] -> [T, inter]: the clamped SwiGLU in fp32, to bf16, then act_quant (the shared
    expert's rounding points up to w2's own act_quant, which leaves FP8-rounded rows unchanged)."""
    g = gu.float()
    gate, up = g[:, :inter], g[:, inter:]
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return act_quant_ref((torch.nn.functional.silu(gate) * up).to(gu.dtype))


def moe_combine_ref(out: torch.Tensor, slot: torch.Tensor, indices: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """out [E, T, d] -> [T, d]: per token, its picks' rows summed in fp32 in ascending expert id
    (the reference's accumulation order), then + shared [T, d], cast to shared's dtype."""
    T, K = indices.shape
    d = out.shape[-1]
    outs = out.reshape(-1, d)[slot].view(T, K, d)
    rank = torch.argsort(indices, dim=1, stable=True)
    outs = outs.gather(1, rank[..., None].expand(-1, -1, d))
    y = torch.zeros(T, d, device=out.device)
    for k in range(K):
        y = y + outs[:, k].float()
    y = y + shared.float()
    return y.to(shared.dtype)


def hc_mixes_pre_ref(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean: bool = False):
    """Block.hc_mixes(x) and Block.hc_pre(x, pre_prev) in one contract: x [T, hc, d] bf16 ->
    pre, post [T, hc], comb [T, hc, hc] (fp32) of this sublayer and y [T, d] (x collapsed with the
    previous sublayer's pre-mix); mean: then x.mean(dim=1) (the DSpark tap)."""
    xf = x.flatten(1).float()
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(xf, fn.float()) * rs
    pre, post, comb = hc_split_sinkhorn_ref(mixes, scale, base, x.shape[1], iters, hc_eps)
    y = (pre_prev.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return (pre, post, comb, y) + ((x.mean(dim=1),) if mean else ())


def hc_post_ref(y, res, post, comb):
    """y [T, d], res [T, hc, d], post [T, hc], comb [T, hc, hc] -> [T, hc, d] in y's dtype."""
    out = post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=1)
    return out.to(y.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype: normalized in fp32, then the fp32 weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def hc_pre_ref(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """mHC collapse (Block.hc_pre): x [T, hc, d], pre [T, hc] -> sum over hc of pre * x in fp32, in x's dtype."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def norm_rope_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cis: torch.Tensor) -> torch.Tensor:
    """The attention's KV row (Attention.qkv): RMSNorm, RoPE on the last 2 * cis.shape[-1] dims, act_quant."""
    return act_quant_ref(rope_ref(rms_norm_ref(x, weight, eps), cis))


def topk_ids_ref(x: torch.Tensor, k: int, descending: bool = False) -> torch.Tensor:
    """Indices of the k largest along the last dim, ties to the lowest index: deterministic and
    independent of the row's padded width (torch.topk's tie order depends on both), so a sequence's
    picks do not depend on what else is in the batch. The top-k runs on one integer key per entry,
    (value order, reversed index): 32 bits for bf16 scores in rows up to 2^16 wide (the indexer's:
    half the radix passes of the 64-bit key), 64 bits otherwise; both order entries the same way.
    descending: the ids by descending value, equal values lowest id first (else in no set order)."""
    bits = x.float().contiguous().view(torch.int32)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)                               # monotone in the float value
    width = x.shape[-1]
    ids = torch.arange(width, device=x.device, dtype=torch.int32)
    if x.dtype == torch.bfloat16 and width <= 1 << 16:
        # a bf16's float bits end in 16 zeros (16 ones after the flip for negatives): order >> 16
        # keeps every distinct value apart, in the same order
        key = ((order >> 16) << 16) | ((1 << 16) - 1 - ids)
    else:
        key = order.to(torch.int64) * (1 << 32) + ((1 << 31) - 1 - ids.to(torch.int64))
    return key.topk(k, dim=-1, sorted=descending).indices


def index_topk_ref(score: torch.Tensor, lens: torch.Tensor, topk: int, candidates: torch.Tensor | None = None):
    """score [n, E] (entries >= lens already -inf) -> [n, min(topk, E)] entry ids ascending, -1 where
    the pick is not reachable. A re-indexer (candidates given) scores only inside the candidate
    blocks of its candidate source: everything else is -inf before the top-k."""
    if candidates is not None:
        score = score.masked_fill(~candidates, -torch.inf)
    k = min(topk, score.shape[-1])
    idx = topk_ids_ref(score, k).sort(dim=-1).values
    # NOTE(model): a pick with a -inf score is unreachable (or, for a re-indexer, outside the
    # candidates): -1, so narrower and wider padded rows agree
    ok = (idx < lens[:, None]) & (score.gather(-1, idx) > -torch.inf)
    return torch.where(ok, idx, -1)


def topk_block_mask_ref(b: torch.Tensor, k: int, block_size: int, width: int) -> torch.Tensor:
    """b [n, NB] block scores -> [n, width] bool: entry j is kept iff its block j // block_size is
    among the row's k largest (topk_ids_ref: ties to the lowest block) and scores above -inf
    (width <= NB * block_size)."""
    top = topk_ids_ref(b, k)
    keep = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, top, b.gather(-1, top) > -torch.inf)
    return keep[..., None].expand(*keep.shape, block_size).flatten(-2)[..., :width]    # repeat_interleave, no host read


def candidate_blocks_ref(scores: torch.Tensor, compress_lens: torch.Tensor, topk_blocks: int,
                         block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k (attention.select_candidate_blocks): scores [n, W] -> [n, W] bool.
    Block score = max over its positions (-inf past W; a zero as +0.0); the block holding entry compress_lens - 1 pinned
    (+inf); topk_block_mask_ref of the row's min(topk_blocks, blocks) best."""
    width = scores.size(-1)
    b = torch.nn.functional.pad(scores, (0, -width % block_size), value=-torch.inf)
    b = b.unflatten(-1, (-1, block_size)).amax(-1)
    b = b.masked_fill(b == 0, 0.0)          # a zero max as +0.0: which signed zero amax returns is its own choice
    last = (compress_lens - 1).div(block_size, rounding_mode="floor")
    b = b.masked_fill(torch.arange(b.size(-1), device=b.device) == last[:, None], torch.inf)
    return topk_block_mask_ref(b, min(topk_blocks, b.size(-1)), block_size, width)


def carry_write_ref(raw_kv: torch.Tensor, raw_score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
                    ring_write: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """carry_*[ring_write] = the step's rows of raw_* (rows: those rows only), in place."""
    carry_kv[ring_write] = raw_kv if rows is None else raw_kv[rows]
    carry_score[ring_write] = raw_score if rows is None else raw_score[rows]


def compress_members_ref(raw_kv: torch.Tensor, raw_score: torch.Tensor, carry_kv: torch.Tensor,
                         carry_score: torch.Tensor, member_rows: torch.Tensor, member_carry: torch.Tensor,
                         ring_slots: torch.Tensor, group_seq: torch.Tensor, ring_len: int):
    """The ratio > 1 compressor's members [G, ratio, D] of kv and score: the step's row member_rows[g, r],
    or (-1: a position before the step) the carry ring's row ring_slots[group_seq[g]] * ring_len +
    member_carry[g, r]."""
    fresh = (member_rows >= 0)[..., None]                                  # [G, ratio, 1]
    frow = member_rows.clamp_min(0)
    crow = ring_slots[group_seq][:, None] * ring_len + member_carry.clamp_min(0)
    return (torch.where(fresh, raw_kv[frow], carry_kv[crow]), torch.where(fresh, raw_score[frow], carry_score[crow]))


def compress_pool_ref(raw_kv: torch.Tensor, raw_score: torch.Tensor, carry_kv: torch.Tensor, carry_score: torch.Tensor,
                      member_rows: torch.Tensor, member_carry: torch.Tensor, ring_slots: torch.Tensor,
                      group_seq: torch.Tensor, ring_len: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ratio > 1 compressor's latents [G, D] bf16 (Attention._compress, Compressor.pool): each group's members
    (compress_members_ref), the kv rows weighted by the softmax of the score rows over the group (per channel,
    fp32), summed, rounded to bf16, RMS-normed (rms_norm_ref)."""
    kv, score = compress_members_ref(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots,
                                     group_seq, ring_len)
    return rms_norm_ref(softmax_pool_ref(kv, score), weight, eps)


def softmax_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """kv, score [G, ratio, D] fp32 -> [G, D] bf16: kv weighted by the softmax of score over the ratio axis, summed."""
    return (kv * score.softmax(dim=1)).sum(dim=1).to(torch.bfloat16)


def block_rows_ref(block_tables: torch.Tensor, epb: int, entries: torch.Tensor,
                   seq: torch.Tensor | None = None) -> torch.Tensor:
    """Flat rows of a [num_blocks * epb, D] cache pool: entry e of sequence s sits at block_tables[s,
    min(e // epb, width - 1)] * epb + e % epb, an unallocated block (-1) reading row 0. entries [B, E]
    (every sequence's own row of ids) or, with seq, (seq, entries) pairs of any equal shape."""
    col = (entries // epb).clamp_max(block_tables.shape[1] - 1)
    blocks = block_tables.gather(-1, col) if seq is None else block_tables[seq, col]
    return blocks.clamp_min(0) * epb + entries % epb


def window_pool_ref(win_idx: torch.Tensor, ring_read: torch.Tensor, ring_rows: int, num_fresh: int) -> torch.Tensor:
    """[T, W] int32: the step's window lists (win_idx, buffer rows: ring_read's B*Wr, then the T fresh rows; -1
    nothing) as rows of the in-place sources (the ring [ring_rows, D], then the fresh rows: ring_rows + t)."""
    fresh = ring_rows + torch.arange(num_fresh, device=ring_read.device)
    table = torch.cat([ring_read, fresh]).to(torch.int32)
    return torch.where(win_idx >= 0, table[win_idx.clamp_min(0)], -1)


def pool_lists_ref(win_pool: torch.Tensor, win_len: torch.Tensor, topk: torch.Tensor, seq_of: torch.Tensor,
                   block_tables: torch.Tensor, epb: int, base: int) -> torch.Tensor:
    """[T, Lw + K] in win_pool's dtype (int32 from StepMetadata.window_pool): row t = win_pool[t, :win_len[t]],
    then t's compressed picks as pool rows (base + block_tables[seq, e // epb] * epb + e % epb, the column
    clamped to the table, unallocated blocks row 0; -1 picks stay -1), then -1 (triton_lists.pool_lists)."""
    T, K = topk.shape
    e = topk.clamp_min(0)
    col = (e // epb).clamp_max(block_tables.shape[1] - 1)
    blk = block_tables[seq_of[:, None].expand(T, K), col]
    picks = torch.where(topk >= 0, base + blk.clamp_min(0) * epb + e % epb, -1)
    out = torch.cat([win_pool, win_pool.new_full((T, K), -1)], dim=1)
    return out.scatter_(1, win_len[:, None] + torch.arange(K, device=topk.device), picks.to(out.dtype))


def router_topk_ref(logits: torch.Tensor, bias: torch.Tensor, topk: int, temp: float, route_scale: float,
                    norm: bool, bias_alt: torch.Tensor | None = None, alt_mask: torch.Tensor | None = None):
    """Gate.forward after its GEMM: logits [T, E] fp32 -> (weights [T, topk] fp32, indices [T, topk]
    int64). scores = sqrt(softplus(logits / temp)) (temp a Python float: torch's CUDA multiplies by
    its fp32 reciprocal, its CPU divides), then router_select_ref."""
    scores = torch.nn.functional.softplus(logits / float(temp)).sqrt()
    return router_select_ref(scores, bias, topk, route_scale, norm, bias_alt, alt_mask)


def router_select_ref(scores: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float, norm: bool,
                      bias_alt: torch.Tensor | None = None, alt_mask: torch.Tensor | None = None):
    """scores [T, E] fp32 -> the picks: the topk largest scores + bias (bias_alt on the rows where
    alt_mask [T] is set), by descending value, ties to the lowest id (torch.topk's picks and order
    wherever no two values tie); weights = scores there, divided by (w0 + w1 + ... + 1e-20) summed in
    pick order when norm and topk > 1 (torch's .sum may add in another order: a few ulp apart), times
    route_scale."""
    if alt_mask is not None:
        bias = torch.where(alt_mask[:, None], bias_alt, bias)
    indices = topk_ids_ref(scores + bias, topk, descending=True)
    weights = scores.gather(1, indices)
    if norm and topk > 1:
        total = weights[:, 0]
        for j in range(1, topk):
            total = total + weights[:, j]
        weights = weights / (total[:, None] + 1e-20)
    return weights * route_scale, indices


def ngram_hash_ref(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, history: torch.Tensor,
                   token_mask: torch.Tensor | None, token_map: torch.Tensor, multipliers: torch.Tensor,
                   primes: torch.Tensor, offsets: torch.Tensor, pad_id: int, dead: int) -> torch.Tensor:
    """Engram's n-gram hash ids (reference inference/engram.py; model/engram.py NgramHasher): input_ids [T],
    cu_seqlens [B+1] and history [B, n-1] (the ids before each chunk, oldest first; < 0 = markers) on the
    ids' device; token_mask [T] (False = dead: `dead` replaces its compressed id) -> [T, Le, (n-1) * H]
    int64. Each position looks back over its own chunk, then its history; a marker (< 0) blocks the rest
    of the look-back, which reads the compressed pad id. The n-gram's tokens times the layer's odd
    multipliers (no int64 overflow: multiplier * compressed vocab < 2^62), a rolling XOR, mod one prime
    per head, plus that head's table offset."""
    dev, h = input_ids.device, multipliers.shape[1] - 1
    T, B = input_ids.numel(), history.shape[0]
    comp = token_map[input_ids]
    if token_mask is not None:
        comp = torch.where(token_mask, comp, dead)
    hist_c = torch.where(history >= 0, token_map[history.clamp_min(0)], history)   # [B, h]
    # one extended row per sequence: [history (h), new tokens]; flat token k sits at ext_idx[k]
    cu = cu_seqlens
    q_lens = cu[1:] - cu[:-1]
    seq_of = torch.repeat_interleave(torch.arange(B, device=dev), q_lens, output_size=T)   # no host read
    local = torch.arange(T, device=dev) - cu[:-1][seq_of]
    ext_off = cu[:-1] + h * torch.arange(B, device=dev)
    ext = torch.empty(T + h * B, dtype=torch.int64, device=dev)
    ext_hist_idx = ext_off[:, None] + torch.arange(h, device=dev)
    ext[ext_hist_idx.flatten()] = hist_c.flatten()
    tok_idx = ext_off[seq_of] + h + local
    ext[tok_idx] = comp
    tokens, blocked = [], torch.zeros(T, dtype=torch.bool, device=dev)
    for shift in range(h + 1):
        src = ext[tok_idx - shift]
        blocked = blocked | (src < 0)             # before position 0 or a dead token
        tokens.append(torch.where(blocked, pad_id, src))
    tokens = torch.stack(tokens, -1)                                   # [T, n]
    products = tokens[:, None, :] * multipliers                        # [T, Le, n]
    rolling, hashes = products[..., 0], []
    for i in range(1, h + 1):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling[..., None] % primes[:, i - 1])           # [T, Le, H]
    return torch.cat(hashes, -1) + offsets


def engram_rows_ref(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Engram table rows, dequantized: weight [R, D] e4m3, scale [R, D/32] E8M0 bytes, ids [...] -> [..., D]
    bf16 (e4m3 times a power of two: exact in fp32, and in bf16 inside its normal range)."""
    v = weight[ids].float().unflatten(-1, (-1, 32)) * e8m0_to_float(scale[ids]).unsqueeze(-1)
    return v.flatten(-2).to(torch.bfloat16)


def engram_gate_ref(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, w: torch.Tensor, eps: float,
                    token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Engram's gated add (reference model.py Engram after its wkv): x [T, hc, d], key [T, hc*d], value
    [T, d], w [hc, d] = q_weight * k_weight -> [T, hc, d] in x's dtype: gate = sigmoid(signed sqrt of the
    RMS-normalized stream . key dot product / sqrt(d)), 0 for masked tokens; x + gate * value."""
    T, hc, d = x.shape
    key = key.float().unflatten(-1, (hc, d))
    h = x.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * w.float() * key).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask[:, None], 0)
    return (h + gate[..., None] * value.float()[:, None, :]).to(x.dtype)
