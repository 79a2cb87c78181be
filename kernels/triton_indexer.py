"""Triton lightning-indexer scores (reference: deepinfer/model/attention.py `Indexer.scores`).

    index_scores(q [n, IH, ID], w [n, IH], keys [E, ID], lens=None) -> [n, E] bf16
        score[t, e] = sum_h relu(q[t, h] . keys[e]) * w[t, h]
    with the reference's bf16 rounding after the product, after the weighting and after the head
    sum; with lens, entries e >= lens[t] are -inf (the causal mask of the caller).

Dataflow: a program owns BT queries x BE keys: q tile [BT*IH, ID] against keys [BE, ID] in one
tensor-core dot (fp32), rounded, relu'd and weighted per head, summed over the IH heads in fp32.
The top-k over these scores is kernels/triton_topk.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def index_scores_kernel(q_ptr, w_ptr, k_ptr, lens_ptr, ks_ptr, rows_ptr, o_ptr, n, E,
                        IH: tl.constexpr, ID: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                        HAS_LENS: tl.constexpr, UPCAST: tl.constexpr, PER_TOKEN_KEYS: tl.constexpr,
                        PAGED: tl.constexpr = False):
    """PER_TOKEN_KEYS (BT == 1): query t reads keys rows ks[t] .. ks[t] + E of a shared pool (one
    sequence's keys per decode token), else all queries share keys[0:E]. PAGED: those are entries of
    a row table, key e of query t is pool row rows[ks[t] + e] (the cache pool read in place, no
    gathered copy). With PER_TOKEN_KEYS and lens, a key block wholly past lens[t] only writes -inf
    (a CUDA-graph step sizes E for the longest context it serves)."""
    pid_t = tl.program_id(0)
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
        kbase = tl.load(ks_ptr + pid_t).to(tl.int64)
    if PAGED:
        krow = tl.load(rows_ptr + kbase + re, mask=e_ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + krow[:, None] * ID + rd[None, :], mask=e_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + (kbase + re[:, None].to(tl.int64)) * ID + rd[None, :], mask=e_ok[:, None], other=0.0)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))                            # [BT*IH, BE] fp32
    s = tl.maximum(s.to(tl.bfloat16).to(tl.float32), 0.0)
    w = tl.load(w_ptr + rq, mask=q_ok, other=0.0).to(tl.float32)
    s = (s * w[:, None]).to(tl.bfloat16).to(tl.float32)
    tot = tl.sum(tl.reshape(s, (BT, IH, BE)), axis=1)          # [BT, BE]
    if HAS_LENS:
        ln = tl.load(lens_ptr + rt, mask=rt < n, other=0)
        tot = tl.where(re[None, :] < ln[:, None], tot, float("-inf"))
    tl.store(o_ptr + rt[:, None].to(tl.int64) * E + re[None, :], tot.to(tl.bfloat16),
             mask=(rt < n)[:, None] & e_ok[None, :])


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor | None = None,
                 key_start: torch.Tensor | None = None, num_keys: int | None = None,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """key_start [n] (with num_keys): query t scores keys[key_start[t] : key_start[t] + num_keys]
    (a batch of decode tokens, each over its own sequence's keys); out [n, num_keys]. rows (with
    key_start): a flat row table, query t's key e is keys[rows[key_start[t] + e]]."""
    n, ih, idim = q.shape
    E = keys.shape[0] if key_start is None else num_keys
    out = torch.empty(n, E, dtype=torch.bfloat16, device=q.device)
    if n == 0 or E == 0:
        return out
    bt = 1 if key_start is not None else max(1, min(128 // ih, triton.next_power_of_2(n)))
    be = 128
    lens_t = lens.to(torch.int32).contiguous() if lens is not None else out
    ks = key_start.to(torch.int64).contiguous() if key_start is not None else out
    paged = rows is not None and key_start is not None
    rows_t = rows.to(torch.int64).contiguous() if paged else ks
    index_scores_kernel[(triton.cdiv(n, bt), triton.cdiv(E, be))](
        q.contiguous(), w.contiguous(), keys.contiguous(), lens_t, ks, rows_t, out, n, E, IH=ih, ID=idim, BT=bt,
        BE=be, HAS_LENS=lens is not None, UPCAST=INTERPRET, PER_TOKEN_KEYS=key_start is not None, PAGED=paged,
        num_warps=4)
    return out


def index_scores_ref(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor | None = None):
    """Indexer.scores (deepinfer/model/attention.py), restated, plus the optional length mask."""
    s = torch.einsum("nhd,ed->nhe", q.float(), keys.float()).to(torch.bfloat16)
    s = s.relu() * w.unsqueeze(-1)
    s = s.float().sum(1).to(torch.bfloat16)
    if lens is not None:
        s = s.masked_fill(torch.arange(keys.shape[0], device=s.device) >= lens[:, None], -torch.inf)
    return s
