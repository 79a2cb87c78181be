"""Triton top-k of the sparse-attention indexer (references: reference.py `index_topk_ref`,
`topk_block_mask_ref`, the rule of deepinfer/model/attention.py).

    index_topk(score [n, E], lens [n], topk, candidates [n, E] bool | None) -> [n, min(topk, E)] int64
        each row's k largest scores (ties to the lowest id), ids ascending; -1 where the pick is
        >= lens[row] or scores -inf (outside the candidates counts as -inf)
    topk_block_mask(b [n, NB], k, block_size, width) -> [n, width] bool
        entry j kept iff its block j // block_size is among the row's k largest (ties to the lowest
        block) and scores above -inf
    candidate_blocks(score [n, W], lens [n], k, block_size) -> [n, W] bool
        attention.select_candidate_blocks in one launch: the block scores (each block's max, -inf past W)
        and the pin of the block holding entry lens - 1 (+inf) made in the kernel, then topk_block_mask
        (reference: candidate_blocks_ref; ~8 torch launches a step before)

Dataflow: one program per row, the whole row in registers (BLOCK = next pow2 of E, masked). Each
score becomes an int32 that orders like the float, order = bits ^ ((bits >> 31) & 0x7FFFFFFF): the
reference key without its id half (16-bit floats: their own 16 bits, the same order). A bitwise
search, MSB first, finds T = the k-th largest order in KEY_BITS passes (one count of order >=
candidate each). The picks are every order > T plus the lowest-id k - #(order > T) entries equal to
T (a cumsum): the same k entries as the reference's (order, reversed id) top-k, for any width and
in half the passes its key would take (16 for bf16, 32 for fp32). Output slots are the cumsum of the
picks, so the ids come out ascending with no sort. Preconditions (asserted): 2-D rows (a last stride
other than 1 is copied), E <= MAX_WIDTH, bf16 / fp16 / fp32 scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter

# One row in registers. ptxas (sm_90a, Triton 3.6 and 3.9): no spills up to 16384 at 16 warps
# (<= 128 registers); 32768 at 32 warps spills ~300 B per thread, still one launch per step.
MAX_WIDTH = 1 << 15
KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


@triton.jit
def topk_kernel(x_ptr, cand_ptr, lens_ptr, out_ptr, width, k, out_width, stride_x, stride_c, stride_o,
                BLOCK: tl.constexpr, KEY_BITS: tl.constexpr, KEY_NINF: tl.constexpr, KEY_PINF: tl.constexpr,
                HAS_CAND: tl.constexpr, HAS_LENS: tl.constexpr, EXPAND: tl.constexpr, EXPAND_P2: tl.constexpr,
                BLOCK_MAX: tl.constexpr = False, score_width=0, PDL: tl.constexpr = False,
                ALL_PICKED: tl.constexpr = False):
    """EXPAND == 0: the picks' ids ascending to out[row, :k] (int64), -1 where the score is not above
    -inf or (HAS_LENS) the id >= lens[row]. EXPAND > 0: keep = pick and score > -inf, for block i
    written to out[row, i*EXPAND : (i+1)*EXPAND] (bool as int8), columns < out_width. KEY_NINF /
    KEY_PINF: the keys of -inf / +inf, so "score > -inf" is a key range (NaN keys lie outside it)
    and only the keys stay live through the search. BLOCK_MAX (EXPAND mode): x is a row of score_width
    scores; element i is the max over its EXPAND scores (a zero max as +0.0), +inf for the block holding score
    lens[row] - 1. ALL_PICKED (k >= width, known on the host): every entry is a pick, no search (the candidate
    blocks' level one keeps 2,048 of 1,024 blocks at an 8k context)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, BLOCK)
    valid = ids < width
    if BLOCK_MAX:
        j2 = tl.arange(0, EXPAND_P2)
        col = ids[:, None] * EXPAND + j2[None, :]
        tile = tl.load(x_ptr + row * stride_x + col, mask=(j2[None, :] < EXPAND) & (col < score_width),
                       other=float("-inf"))
        x = tl.max(tile, axis=1).to(tile.dtype)                 # (a max is one of its values: exact)
        # a block of signed zeros scores +0.0: which zero a max returns is the reduction's choice (the
        # H100's tl.max and torch's amax differed), and the keys order -0.0 below +0.0 (compared in fp32:
        # the interpreter holds bf16 as raw bits)
        x = tl.where(x.to(tl.float32) == 0, tl.zeros([BLOCK], x.dtype), x)
        n_ok = tl.load(lens_ptr + row)
        last = tl.where(n_ok > 0, (n_ok - 1) // EXPAND, -1)
        x = tl.where(ids == last, tl.full([BLOCK], float("inf"), x.dtype), x)
        x = tl.where(valid, x, tl.full([BLOCK], float("-inf"), x.dtype))
    else:
        x = tl.load(x_ptr + row * stride_x + ids, mask=valid, other=float("-inf"))
    if HAS_CAND:
        c = tl.load(cand_ptr + row * stride_c + ids, mask=valid, other=0)
        x = tl.where(c != 0, x, tl.full([BLOCK], float("-inf"), x.dtype))
    if KEY_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)                      # sign-extended
        key = bits ^ ((bits >> 15) & 0x7FFF)
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # signed keys in [lo, -lo); the search builds T's unsigned pattern (key - lo) bit by bit, MSB
    # first: the sign step is "is T >= 0", the rest OR bits into T itself
    lo: tl.constexpr = -(1 << (KEY_BITS - 1))
    key = tl.where(valid, key, lo)                                 # padding: below every candidate
    if ALL_PICKED:
        sel = valid                     # k >= the width (the host knows): every entry is a pick, no search
    else:
        thr = tl.where(tl.sum((key >= 0).to(tl.int32), axis=0) >= k, 0, lo)
        for j in tl.static_range(KEY_BITS - 2, -1, -1):
            cand = thr | (1 << j)
            thr = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= k, cand, thr)
        # thr = the k-th largest key: all keys above it, then its ties from the lowest id
        gt = key > thr
        eq = (key == thr) & valid
        need = k - tl.sum(gt.to(tl.int32), axis=0)
        sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))
    live = (key > KEY_NINF) & (key <= KEY_PINF)                     # score > -inf
    if EXPAND == 0:
        pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1                 # slot of each pick, ascending id
        if HAS_LENS:
            live = live & (ids < tl.load(lens_ptr + row))
        tl.store(out_ptr + row * stride_o + pos, tl.where(live, ids, -1).to(tl.int64), mask=sel)
    else:
        keep = (sel & live).to(tl.int8)
        j2 = tl.arange(0, EXPAND_P2)
        col = ids[:, None] * EXPAND + j2[None, :]                     # [BLOCK, EXPAND_P2]
        tl.store(out_ptr + row * stride_o + col, tl.broadcast_to(keep[:, None], (BLOCK, EXPAND_P2)),
                 mask=(j2[None, :] < EXPAND) & (col < out_width))


def _key(v: float, dtype: torch.dtype) -> int:
    """The kernel's key of the value v in dtype (order = bits ^ ((bits >> sign) & max))."""
    nb = KEY_BITS[dtype]
    bits = torch.tensor([v], dtype=dtype if nb == 16 else torch.float32).view(getattr(torch, f"int{nb}")).item()
    return bits ^ ((bits >> (nb - 1)) & ((1 << (nb - 1)) - 1))


def _launch_cfg(width: int, dtype: torch.dtype) -> dict:
    block = triton.next_power_of_2(width)
    num_warps = max(4, min(16, block // 512)) * (2 if block > 16384 else 1)     # 8192 -> 16, 32768 -> 32
    return dict(BLOCK=block, num_warps=num_warps, KEY_BITS=KEY_BITS[dtype], KEY_NINF=_key(-float("inf"), dtype),
                KEY_PINF=_key(float("inf"), dtype))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def index_topk(score: torch.Tensor, lens: torch.Tensor, topk: int,
               candidates: torch.Tensor | None = None) -> torch.Tensor:
    """score [n, E] float, lens [n] int, candidates [n, E] bool or None -> [n, min(topk, E)] int64
    (reference.index_topk_ref bit for bit)."""
    assert score.dim() == 2 and score.dtype in KEY_BITS and score.shape[1] <= MAX_WIDTH, (score.shape, score.dtype)
    n, width = score.shape
    assert lens.shape == (n,), (lens.shape, n)
    k = min(topk, width)
    out = torch.empty(n, k, dtype=torch.int64, device=score.device)
    if n == 0 or k == 0:
        return out
    score = _rows(score)
    if candidates is not None:
        assert candidates.shape == score.shape and candidates.dtype == torch.bool
        candidates = _rows(candidates).view(torch.uint8)
    cand = candidates if candidates is not None else score
    topk_kernel[(n,)](score, cand, lens.contiguous(), out, width, k, k, score.stride(0), cand.stride(0),
                      out.stride(0), HAS_CAND=candidates is not None, HAS_LENS=True, EXPAND=0, EXPAND_P2=1,
                      ALL_PICKED=k >= width,
                      **_launch_cfg(width, score.dtype), **pdl_args())
    return out


def topk_block_mask(b: torch.Tensor, k: int, block_size: int, width: int) -> torch.Tensor:
    """b [n, NB] float block scores -> [n, width] bool (reference.topk_block_mask_ref bit for bit;
    contiguous where the reference returns a view)."""
    assert b.dim() == 2 and b.dtype in KEY_BITS and b.shape[1] <= MAX_WIDTH, (b.shape, b.dtype)
    n, nb = b.shape
    assert 0 <= k <= nb and width <= nb * block_size, (k, nb, block_size, width)
    out = torch.empty(n, width, dtype=torch.bool, device=b.device)
    if n == 0 or width == 0:
        return out
    b = _rows(b)
    topk_kernel[(n,)](b, b, b, out.view(torch.int8), nb, k, width, b.stride(0), 0, out.stride(0),
                      HAS_CAND=False, HAS_LENS=False, EXPAND=block_size, ALL_PICKED=k >= nb,
                      EXPAND_P2=triton.next_power_of_2(block_size), **_launch_cfg(nb, b.dtype), **pdl_args())
    return out


def candidate_blocks(score: torch.Tensor, lens: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """score [n, W] float, lens [n] int -> [n, W] bool (reference.candidate_blocks_ref bit for bit)."""
    assert score.dim() == 2 and score.dtype in KEY_BITS and lens.shape == score.shape[:1], (score.shape, lens.shape)
    n, width = score.shape
    nb = -(-width // block_size)
    assert nb <= MAX_WIDTH and 0 <= k, (nb, k)
    k = min(k, nb)
    out = torch.empty(n, width, dtype=torch.bool, device=score.device)
    if n == 0 or width == 0:
        return out
    score = _rows(score)
    topk_kernel[(n,)](score, score, lens.contiguous(), out.view(torch.int8), nb, k, width, score.stride(0), 0,
                      out.stride(0), HAS_CAND=False, HAS_LENS=False, EXPAND=block_size, ALL_PICKED=k >= nb,
                      EXPAND_P2=triton.next_power_of_2(block_size), BLOCK_MAX=True, score_width=width,
                      **_launch_cfg(nb, score.dtype), **pdl_args())
    return out
