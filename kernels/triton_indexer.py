"""Triton lightning-indexer scores (reference: deepinfer/model/attention.py `Indexer.scores`).

    index_scores(q [n, IH, ID], w [n, IH], keys [E, ID], lens=None) -> [n, E] bf16
        score[t, e] = sum_h relu(q[t, h] . keys[e]) * w[t, h]
    with the reference's bf16 rounding after the product, after the weighting and after the head
    sum; with lens, entries e >= lens[t] are -inf (the causal mask of the caller).

    index_scores(..., runs=query_runs(cu, ...))   the prefill form: queries of one sequence in runs of
                            RUN_BT, each run's key tile loaded once and scored head by head

Dataflow: a program owns BT queries x BE keys: q tile [BT*IH, ID] against keys [BE, ID] in one
tensor-core dot (fp32), rounded, relu'd and weighted per head, summed over the IH heads in fp32.
With per-token keys (a batch of sequences: decode) BT is 1 and the dot is IH rows tall; there
index_scores_decode_kernel gives one program a query and a run of NB key blocks: q and w loaded
once, the key blocks (read through the row table) in a pipelined loop, each block's arithmetic that
of index_scores_kernel (so NB, chosen on the host from n and E, never changes a bit), blocks past
lens[t] only written -inf. Prefill queries share their sequence's keys, so `runs` hands
consecutive queries of one sequence to one program (index_scores_runs_kernel): the key tile is
loaded once, each head is a [RUN_BT, ID] x [ID, BE] dot accumulated in fp32, and key blocks past
every query's length only write -inf (half the causal square). Its head sum runs in another order
than the per-token kernels', so batch-invariant runs keep the per-token form (kernels/select.py).
The top-k over these scores is kernels/triton_topk.py.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter
from .reference import fp4_rows_width
from .triton_gemm import _fp4_nibbles_ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _key_rows(rows_ptr, kbase, re, e_ok, epb, nb, BLOCKED: tl.constexpr):
    """Pool rows of keys re: rows[kbase + re] (a row table), or BLOCKED (rows_ptr a block table, kbase its
    row of the query's sequence): table[kbase + min(re // epb, nb - 1)] (unallocated -1 -> 0) * epb + re % epb,
    reference.block_rows_ref's rows without the [B, E] table written."""
    if BLOCKED:
        blk = tl.load(rows_ptr + kbase + tl.minimum(re // epb, nb - 1), mask=e_ok, other=0).to(tl.int64)
        return tl.maximum(blk, 0) * epb + re % epb
    return tl.load(rows_ptr + kbase + re, mask=e_ok, other=0).to(tl.int64)


@triton.jit
def _fp4_unpack_rows(row_ptr, rows_ok, D: tl.constexpr):
    """Packed rows at row_ptr [R] (reference.fp4_pack_rows_ref's bytes) -> their values [R, D] bf16, exact;
    rows past rows_ok read as zeros. One vector load of the codes and one of the scales a row, each byte's
    nibbles decoded by the W4A16 reference decode (triton_gemm._fp4_nibbles_ref) and joined back (a load
    a value, each byte twice, cost more than the bytes saved: H100, 2026-12-05)."""
    R: tl.constexpr = row_ptr.shape[0]
    m2 = rows_ok[:, None]
    b = tl.load(row_ptr[:, None] + tl.arange(0, D // 2)[None, :], mask=m2, other=0).to(tl.int32)
    e = tl.load(row_ptr[:, None] + D // 2 + tl.arange(0, D // 32)[None, :], mask=m2, other=127).to(tl.int32)
    s = tl.reshape(tl.broadcast_to((e << 23).to(tl.float32, bitcast=True)[:, :, None], (R, D // 32, 16)),
                   (R, D // 2))                                             # each byte's block scale
    lo, hi = _fp4_nibbles_ref(b, s)
    return tl.reshape(tl.join(lo, hi), (R, D)).to(tl.bfloat16)             # value 2j low, 2j + 1 high


@triton.jit
def _load_keys(k_ptr, krow, e_ok, rd, ID: tl.constexpr, PACKED: tl.constexpr, KW: tl.constexpr):
    """Key rows krow [BE] -> [BE, ID] bf16: plain bf16 rows, or PACKED uint8 rows of KW bytes
    (reference.fp4_pack_rows_ref: the values exactly, a third of the bytes)."""
    if PACKED:
        k = _fp4_unpack_rows(k_ptr + krow * KW, e_ok, ID)
    else:
        k = tl.load(k_ptr + krow[:, None] * ID + rd[None, :], mask=e_ok[:, None], other=0.0)
    return k


@triton.jit
def _relu_block_dot(q, k_ptr, rows_ptr, kbase, re, e_ok, rd, epb, nb, ID: tl.constexpr, PAGED: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCKED: tl.constexpr = False, PACKED: tl.constexpr = False,
                    KW: tl.constexpr = 0):
    """q [rows, ID] against the key block re (pool rows _key_rows(...) when PAGED, else kbase + re):
    the fp32 dot rounded to bf16, relu'd (the reference's first rounding)."""
    if PAGED:
        krow = _key_rows(rows_ptr, kbase, re, e_ok, epb, nb, BLOCKED)
    else:
        krow = kbase + re.to(tl.int64)
    k = _load_keys(k_ptr, krow, e_ok, rd, ID, PACKED, KW)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))
    return tl.maximum(s.to(tl.bfloat16).to(tl.float32), 0.0)


@triton.jit
def index_scores_kernel(q_ptr, w_ptr, k_ptr, lens_ptr, ks_ptr, ks_mul, rows_ptr, epb, nb, o_ptr, n, E,
                        IH: tl.constexpr, ID: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                        HAS_LENS: tl.constexpr, UPCAST: tl.constexpr, PER_TOKEN_KEYS: tl.constexpr,
                        PAGED: tl.constexpr = False, tok_ptr=None, HAS_TOKENS: tl.constexpr = False,
                        BLOCKED: tl.constexpr = False, PACKED: tl.constexpr = False, KW: tl.constexpr = 0):
    """PER_TOKEN_KEYS (BT == 1): query t reads keys rows ks[t] .. ks[t] + E of a shared pool (one
    sequence's keys per decode token), else all queries share keys[0:E]. PAGED: those are entries of
    a row table, key e of query t is pool row rows[ks[t] + e] (the cache pool read in place, no
    gathered copy). With PER_TOKEN_KEYS and lens, a key block wholly past lens[t] only writes -inf
    (a CUDA-graph step sizes E for the longest context it serves). HAS_TOKENS (BT == 1): program i
    scores query tok[i] (the queries left out of the prefill runs). index_scores sends per-token keys
    to index_scores_decode_kernel (this kernel's bits, NB blocks a program) unless blocks_per_program=0."""
    pid_t = tl.program_id(0)
    if HAS_TOKENS:
        pid_t = tl.load(tok_ptr + pid_t)
    pid_e = tl.program_id(1)
    rq = pid_t * BT * IH + tl.arange(0, BT * IH)             # flattened (token, head) rows
    rd = tl.arange(0, ID)
    re = pid_e * BE + tl.arange(0, BE)
    q_ok = rq < n * IH
    e_ok = re < E
    rt = pid_t * BT + tl.arange(0, BT)
    if PER_TOKEN_KEYS and HAS_LENS:
        if pid_e * BE >= tl.load(lens_ptr + pid_t):
            ninf = tl.full((BT, BE), float("-inf"), tl.float32)
            tl.store(o_ptr + rt[:, None].to(tl.int64) * E + re[None, :], ninf.to(tl.bfloat16),
                     mask=(rt < n)[:, None] & e_ok[None, :])
            return
    q = tl.load(q_ptr + rq[:, None].to(tl.int64) * ID + rd[None, :], mask=q_ok[:, None], other=0.0)
    kbase = 0
    if PER_TOKEN_KEYS:
        kbase = tl.load(ks_ptr + pid_t).to(tl.int64) * ks_mul
    s = _relu_block_dot(q, k_ptr, rows_ptr, kbase, re, e_ok, rd, epb, nb, ID, PAGED, UPCAST, BLOCKED,
                        PACKED, KW)                                                     # [BT*IH, BE]
    w = tl.load(w_ptr + rq, mask=q_ok, other=0.0).to(tl.float32)
    s = (s * w[:, None]).to(tl.bfloat16).to(tl.float32)
    tot = tl.sum(tl.reshape(s, (BT, IH, BE)), axis=1)          # [BT, BE]
    if HAS_LENS:
        ln = tl.load(lens_ptr + rt, mask=rt < n, other=0)
        tot = tl.where(re[None, :] < ln[:, None], tot, float("-inf"))
    tl.store(o_ptr + rt[:, None].to(tl.int64) * E + re[None, :], tot.to(tl.bfloat16),
             mask=(rt < n)[:, None] & e_ok[None, :])


@triton.jit
def index_scores_decode_kernel(q_ptr, w_ptr, k_ptr, lens_ptr, ks_ptr, ks_mul, rows_ptr, epb, nb, o_ptr, E, NB,
                               IH: tl.constexpr, ID: tl.constexpr, BE: tl.constexpr, HAS_LENS: tl.constexpr,
                               UPCAST: tl.constexpr, PAGED: tl.constexpr, STAGES: tl.constexpr,
                               tok_ptr=None, HAS_TOKENS: tl.constexpr = False, BLOCKED: tl.constexpr = False,
                               PACKED: tl.constexpr = False, KW: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Per-token keys (index_scores_kernel's PER_TOKEN_KEYS form, BT == 1), one program per (query,
    run of NB key blocks): q [IH, ID] and w loaded once, the key blocks walked in a pipelined loop.
    Each block's arithmetic is index_scores_kernel's, step for step (same dot shape, roundings and
    head-sum tile), so the bits do not depend on NB. Blocks past lens[t] only write -inf (a second,
    store-only loop: no branch inside the pipelined one)."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    if HAS_TOKENS:
        pid_t = tl.load(tok_ptr + pid_t)
    b0 = tl.program_id(1) * NB                                # first key block of this program
    rq = pid_t * IH + tl.arange(0, IH)                        # the query's (token, head) rows
    rd = tl.arange(0, ID)
    rt = pid_t + tl.arange(0, 1)
    q = tl.load(q_ptr + rq[:, None].to(tl.int64) * ID + rd[None, :])
    w = tl.load(w_ptr + rq).to(tl.float32)
    kbase = tl.load(ks_ptr + pid_t).to(tl.int64) * ks_mul
    orow = o_ptr + rt[:, None].to(tl.int64) * E
    live = E
    if HAS_LENS:
        ln = tl.load(lens_ptr + rt)                           # [1]
        live = tl.minimum(tl.load(lens_ptr + pid_t), E)
    # blocks b0 .. b0 + n_live hold a key below min(lens[t], E)
    n_live = tl.minimum(tl.maximum((live - b0 * BE + BE - 1) // BE, 0), NB)
    for j in tl.range(0, n_live, num_stages=STAGES):
        re = (b0 + j) * BE + tl.arange(0, BE)
        e_ok = re < E
        s = _relu_block_dot(q, k_ptr, rows_ptr, kbase, re, e_ok, rd, epb, nb, ID, PAGED, UPCAST, BLOCKED,
                            PACKED, KW)                                                 # [IH, BE]
        s = (s * w[:, None]).to(tl.bfloat16).to(tl.float32)
        tot = tl.sum(tl.reshape(s, (1, IH, BE)), axis=1)       # [1, BE], index_scores_kernel's tile
        if HAS_LENS:
            tot = tl.where(re[None, :] < ln[:, None], tot, float("-inf"))
        tl.store(orow + re[None, :], tot.to(tl.bfloat16), mask=e_ok[None, :])
    ninf = tl.full((1, BE), float("-inf"), tl.float32).to(tl.bfloat16)
    for j in range(n_live, NB):
        re = (b0 + j) * BE + tl.arange(0, BE)
        tl.store(orow + re[None, :], ninf, mask=(re < E)[None, :])


@triton.jit
def index_scores_runs_kernel(q_ptr, w_ptr, k_ptr, lens_ptr, ks_ptr, ks_mul, rows_ptr, epb, nb, run_t0_ptr, run_n_ptr,
                             o_ptr, E,
                             IH: tl.constexpr, ID: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                             UPCAST: tl.constexpr, PAGED: tl.constexpr, BLOCKED: tl.constexpr = False,
                             PACKED: tl.constexpr = False, KW: tl.constexpr = 0):
    """Program (run r, key block): queries run_t0[r] .. + run_n[r] (<= BT, one sequence: they share
    key_start) against keys pid_e * BE .. + BE, with lens."""
    pid_r = tl.program_id(0)
    pid_e = tl.program_id(1)
    t0 = tl.load(run_t0_ptr + pid_r).to(tl.int64)
    cnt = tl.load(run_n_ptr + pid_r)
    i = tl.arange(0, BT)
    t_ok = i < cnt
    rt = t0 + i
    re = pid_e * BE + tl.arange(0, BE)
    e_ok = re < E
    ln = tl.load(lens_ptr + rt, mask=t_ok, other=0)
    optr = o_ptr + rt[:, None] * E + re[None, :]
    omask = t_ok[:, None] & e_ok[None, :]
    if pid_e * BE >= tl.max(ln, axis=0):                     # past every query's causal length
        tl.store(optr, tl.full((BT, BE), float("-inf"), tl.float32).to(tl.bfloat16), mask=omask)
    else:
        kbase = tl.load(ks_ptr + t0).to(tl.int64) * ks_mul
        rd = tl.arange(0, ID)
        if PAGED:
            krow = _key_rows(rows_ptr, kbase, re, e_ok, epb, nb, BLOCKED)
        else:
            krow = kbase + re.to(tl.int64)
        kt = tl.trans(_load_keys(k_ptr, krow, e_ok, rd, ID, PACKED, KW))
        acc = tl.zeros((BT, BE), tl.float32)
        for h in range(IH):
            qh = tl.load(q_ptr + (rt[:, None] * IH + h) * ID + rd[None, :], mask=t_ok[:, None], other=0.0)
            if UPCAST:
                s = tl.dot(qh.to(tl.float32), kt.to(tl.float32))
            else:
                s = tl.dot(qh, kt)                             # [BT, BE] fp32
            s = tl.maximum(s.to(tl.bfloat16).to(tl.float32), 0.0)
            wh = tl.load(w_ptr + rt * IH + h, mask=t_ok, other=0.0).to(tl.float32)
            acc += (s * wh[:, None]).to(tl.bfloat16).to(tl.float32)
        tot = tl.where(re[None, :] < ln[:, None], acc, float("-inf"))
        tl.store(optr, tot.to(tl.bfloat16), mask=omask)


# queries per run program and the shortest sequence run worth one (shorter ones: per-token programs)
RUN_BT = 64
RUN_MIN = 16
RUN_WARPS = 4

# The decode form (index_scores_decode_kernel): warps and pipeline depth of its key loop, the most key
# blocks one program walks, and the programs per SM it keeps at least (fewer blocks per program where
# the grid would drop below that). Module values so perf/bench_indexer.py can sweep them.
DECODE_WARPS = 4            # index_scores_kernel's: the same dot and head-sum layout
DECODE_STAGES = 3
DECODE_NB_MAX = 16
DECODE_PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; an H200's 132 elsewhere (the interpreter: NB as on the GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def decode_blocks_per_program(n: int, num_blocks: int, sms: int = 132) -> int:
    """NB of the decode form: a power of two <= DECODE_NB_MAX, as large as keeps n * cdiv(num_blocks, NB)
    programs >= DECODE_PROGRAMS_PER_SM per SM (batch 1-16 still fill the GPU, batch 128 walks long runs).
    Host-only (n and E): fixed for a CUDA graph, whatever the lens it replays."""
    nb = 1
    while nb < DECODE_NB_MAX and nb < num_blocks and n * -(-num_blocks // (2 * nb)) >= DECODE_PROGRAMS_PER_SM * sms:
        nb *= 2
    return nb


def query_runs(cu: np.ndarray, bt: int | None = None, min_len: int = RUN_MIN) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cu [B+1] host cumulative query counts -> (run starts, run lengths) of the sequences with at least
    min_len queries cut into runs of <= bt (None: RUN_BT, the height index_scores launches), and the
    other queries' ids (int32 arrays)."""
    bt = RUN_BT if bt is None else bt
    cu = np.asarray(cu, dtype=np.int64)
    q = cu[1:] - cu[:-1]
    long_ = q >= min_len
    per = -(-q[long_] // bt)                                                  # runs per long sequence
    first = np.repeat(cu[:-1][long_], per)
    k = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)      # run index within its sequence
    t0 = first + k * bt
    ends = np.repeat(cu[1:][long_], per)
    singles = np.nonzero(np.repeat(~long_, q))[0]
    return t0.astype(np.int32), np.minimum(ends - t0, bt).astype(np.int32), singles.astype(np.int32)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor | None = None,
                 key_start: torch.Tensor | None = None, num_keys: int | None = None,
                 rows: torch.Tensor | None = None, runs: tuple | None = None,
                 blocks_per_program: int | None = None, key_start_scale: int = 1,
                 block_table: torch.Tensor | None = None, entries_per_block: int = 0) -> torch.Tensor:
    """key_start [n] (with num_keys): query t scores keys[key_start[t] * key_start_scale : .. + num_keys]
    (a batch of decode tokens, each over its own sequence's keys: key_start = the token's sequence and
    key_start_scale = num_keys, with no [n] product launched); out [n, num_keys]. lens and key_start may be
    int32 or int64 (read as they are, no conversion launch). rows (with
    key_start): a flat row table, query t's key e is keys[rows[key_start[t] + e]]. block_table (with
    key_start = each query's sequence and entries_per_block, instead of rows): query t's key e is keys[
    reference.block_rows_ref(block_table, entries_per_block, ..)[seq, e]], the row computed in the kernel
    (no [B, E] row table: at batch 64 and 8k entries 4 MB written and read a step). runs (with
    key_start and lens): query_runs(cu) as device tensors (run starts, run lengths, other queries).
    blocks_per_program: key blocks per program of the per-token queries (the decode form; None:
    decode_blocks_per_program, 0: index_scores_kernel, one block each); the same bits either way. keys
    (or the pool) as uint8 rows of fp4_rows_width(ID) bytes: reference.fp4_pack_rows_ref's packed keys,
    unpacked in the kernel to the same bf16 values (the same scores, a third of the bytes read)."""
    n, ih, idim = q.shape
    E = keys.shape[0] if key_start is None else num_keys
    out = torch.empty(n, E, dtype=torch.bfloat16, device=q.device)
    if n == 0 or E == 0:
        return out
    bt = 1 if key_start is not None else max(1, min(128 // ih, triton.next_power_of_2(n)))
    be = 128
    lens_t = lens.contiguous() if lens is not None else out
    ks = key_start.contiguous() if key_start is not None else out
    blocked = block_table is not None
    if blocked:
        assert key_start is not None and rows is None and entries_per_block > 0
        rows, key_start_scale = block_table, block_table.stride(0)
        assert block_table.stride(-1) == 1, "block table rows must be contiguous"
    paged = rows is not None and key_start is not None
    rows_t = rows.contiguous() if paged else ks
    epb, nbt = (entries_per_block, block_table.shape[1]) if blocked else (1, 1)
    q, w, keys = q.contiguous(), w.contiguous(), keys.contiguous()
    packed = keys.dtype == torch.uint8                  # rows of reference.fp4_pack_rows_ref
    if packed:
        assert keys.shape[-1] == fp4_rows_width(idim), (tuple(keys.shape), idim)
    pk = dict(PACKED=packed, KW=keys.shape[-1] if packed else 0)
    grid_t, tokens = triton.cdiv(n, bt), None
    if runs is not None:
        assert key_start is not None and lens is not None, "runs score per-sequence keys under a causal length"
        run_t0, run_n, tokens = runs
        if run_t0.numel():
            index_scores_runs_kernel[(run_t0.numel(), triton.cdiv(E, be))](
                q, w, keys, lens_t, ks, key_start_scale, rows_t, epb, nbt, run_t0, run_n, out, E, IH=ih, ID=idim,
                BT=RUN_BT, BE=be, UPCAST=INTERPRET, PAGED=paged, BLOCKED=blocked, num_warps=RUN_WARPS, **pk)
        grid_t = tokens.numel()
    num_blocks = triton.cdiv(E, be)
    if grid_t and key_start is not None and blocks_per_program != 0:
        nb = blocks_per_program or decode_blocks_per_program(
            grid_t, num_blocks, _sm_count(q.device))
        index_scores_decode_kernel[(grid_t, triton.cdiv(num_blocks, nb))](
            q, w, keys, lens_t, ks, key_start_scale, rows_t, epb, nbt, out, E, nb, IH=ih, ID=idim, BE=be,
            HAS_LENS=lens is not None, UPCAST=INTERPRET, PAGED=paged, STAGES=DECODE_STAGES, tok_ptr=tokens,
            HAS_TOKENS=tokens is not None, BLOCKED=blocked, num_warps=DECODE_WARPS, **pk, **pdl_args())
    elif grid_t:
        index_scores_kernel[(grid_t, num_blocks)](
            q, w, keys, lens_t, ks, key_start_scale, rows_t, epb, nbt, out, n, E, IH=ih, ID=idim, BT=bt,
            BE=be, HAS_LENS=lens is not None, UPCAST=INTERPRET, PER_TOKEN_KEYS=key_start is not None, PAGED=paged,
            tok_ptr=tokens, HAS_TOKENS=tokens is not None, BLOCKED=blocked, num_warps=4, **pk)
    return out


def index_scores_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor | None = None):
    """Indexer.scores (deepinfer/model/attention.py), restated, plus the optional length mask."""
    s = torch.einsum("nhd,ed->nhe", q.float(), keys.float()).to(torch.bfloat16)
    s = s.relu() * w.unsqueeze(-1)
    s = s.float().sum(1).to(torch.bfloat16)
    if lens is not None:
        s = s.masked_fill(torch.arange(keys.shape[0], device=s.device) >= lens[:, None], -torch.inf)
    return s
