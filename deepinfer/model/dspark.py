"""DSpark draft blocks (reference model.py `DSparkBlock`, `DSparkAttention`, Markov and confidence
heads), as two batch functions the engine calls:

  dspark_absorb(model, main_hidden, batch-like rows, caches)
      main_x = main_norm(main_proj(mean streams entering the target layers)); every draft block's
      ring takes kv_norm(wkv(main_x)) (RoPE at the backbone position, FP8-rounded) at those
      positions. Call it for the positions that are accepted (prefill: all prompt positions).
  dspark_propose(model, anchor_ids, positions, ring_slots, caches)
      the block [anchor, noise x (B-1)] at positions p+1..p+B through the draft blocks; each row
      attends to its block's ring at positions max(0, p-window+1)..p and to all B rows
      (bidirectional); then the head, the Markov bigram bias token by token, the confidence head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer.host_copy import to_device

from . import ops
from .attention import Attention
from .block import Block
from .layers import Embedding, Linear, RMSNorm, linear_fp32


@dataclass
class DraftOutput:
    draft_ids: torch.Tensor     # [B, block] int64: drafts for positions p+2 .. p+block+1 (anchor excluded)
    logits: torch.Tensor        # [B, block, V] fp32, Markov bias included
    confidence: torch.Tensor    # [B, block] fp32 confidence logits (pre-sigmoid)


class DSparkAttention(Attention):
    def forward_draft(self, x: torch.Tensor, anchors_pos: list[int], ring_slots: list[int], block: int,
                      caches, rope_tables, x_rounded: torch.Tensor | None = None) -> torch.Tensor:
        """x [B*block, d] normed draft rows -> [B*block, d]. One sparse_attn call for all sequences:
        buffer [B x window ring rows | B*block draft rows]; the rows of sequence b attend to its ring
        positions max(0, p-window+1)..p in ring-slot order (the reference's), then its block's rows."""
        dev, W, B = x.device, self.window, len(anchors_pos)
        p = np.asarray(anchors_pos, dtype=np.int64)
        pos = to_device(np.repeat(p, block) + np.tile(np.arange(1, block + 1), B), dev)
        cis = rope_tables[self.rope_kind](pos, int(p.max(initial=0)) + block)
        _, _, q, kv = self.qkv(x, cis, x_rounded)
        r = np.arange(W)
        ring_pos = p[:, None] - (p[:, None] - r) % W              # [B, W]: the position in ring slot r
        nv = np.minimum(p + 1, W)                                 # valid slots are 0 .. nv-1
        slots = np.asarray(ring_slots, dtype=np.int64)
        flat = slots[:, None] * caches.ring_len + np.maximum(ring_pos, 0) % caches.ring_len
        ring = caches.window_kv[self.layer_id].flatten(0, 1)
        buf = torch.cat([ring[to_device(flat.ravel(), dev)].to(kv.dtype), kv])
        j = np.arange(W + block)
        ring_idx = np.arange(B)[:, None] * W + j
        draft_idx = B * W + np.arange(B)[:, None] * block + j - nv[:, None]
        lists = np.where(j < nv[:, None], ring_idx, np.where(j < (nv + block)[:, None], draft_idx, -1))
        width = int((nv + block).max(initial=0))
        idx = to_device(np.repeat(lists[:, :width], block, axis=0), dev)     # [B*block, width]
        return self.out(ops.sparse_attn(q, buf, self.attn_sink, idx, self.scale, unrope=cis))

    def forward_draft_static(self, x: torch.Tensor, step: "DraftStepBuffers", caches, rope_tables,
                             x_rounded: torch.Tensor | None = None) -> torch.Tensor:
        """forward_draft on prebuilt device tensors (the CUDA-graph form, DraftStepBuffers): the same
        buffer and lists, the lists W + block wide (trailing -1s), padding sequences reading a scratch
        ring slot and listing nothing."""
        v = step.v
        cis = rope_tables[self.rope_kind](v["positions"], step.max_pos)
        _, _, q, kv = self.qkv(x, cis, x_rounded)
        ring = caches.window_kv[self.layer_id].flatten(0, 1)
        buf = torch.cat([ring[v["ring_rows"]].to(kv.dtype), kv])
        return self.out(ops.sparse_attn(q, buf, self.attn_sink, v["lists"], self.scale, unrope=cis))

    def main_kv(self, main_x: torch.Tensor, positions: torch.Tensor, rope_tables,
                max_pos: int | None = None) -> torch.Tensor:
        cis = rope_tables[self.rope_kind](positions, max_pos)
        return ops.act_quant(ops.rope(self.kv_norm(self.wkv(main_x)), cis))


class MarkovHead(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = Embedding(args.vocab_size, args.dspark_markov_rank)
        self.head = Linear(args.dspark_markov_rank, args.vocab_size)

    def forward(self, ids: torch.Tensor):
        e = self.embed(ids)
        return linear_fp32(e, self.head.weight), e


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = Linear(in_features, 1)


class DSparkBlock(Block):
    """A backbone block with DSpark attention, plus the stage-0 input and last-stage output heads."""

    attention_cls = DSparkAttention

    def __init__(self, args, layer_id: int):
        super().__init__(args, layer_id)
        stage = layer_id - args.n_layers
        self.stage, self.layer_id = stage, layer_id
        if stage == 0:
            self.main_proj = Linear(args.dim * len(args.dspark_target_layer_ids), args.dim)
            self.main_norm = RMSNorm(args.dim, args.norm_eps)
        if stage == args.n_mtp_layers - 1:
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.markov_head = MarkovHead(args)
            self.confidence_head = ConfidenceHead(args.dim + args.dspark_markov_rank)


class DraftStepBuffers:
    """A drafting pass of up to B sequences in static buffers (views of one int64 buffer, filled on
    the host and copied in one go), the CUDA-graph form of dspark_propose's per-call index work:

        flat = | anchor_ids B | positions B*block | ring_rows B*W | lists B*block x (W + block) |

    Sequence b's rows are its block at positions p+1 .. p+block; its ring rows are the W ring slots
    in ring-slot order (forward_draft's); its lists: the nv = min(p+1, W) valid ring rows, then the
    block's rows, then -1. Padding sequences (b >= n): position 0, the scratch ring slot, no list."""

    def __init__(self, num_seqs: int, *, window: int, block: int, ring_len: int, scratch_slot: int,
                 max_pos: int, device="cpu") -> None:
        B, W = self.num_seqs, self.window = num_seqs, window
        self.block, self.ring_len, self.scratch_slot, self.max_pos = block, ring_len, scratch_slot, max_pos
        self.shapes = {"anchor_ids": (B,), "positions": (B * block,), "ring_rows": (B * W,),
                       "lists": (B * block, W + block)}
        self.numel = sum(int(np.prod(sh)) for sh in self.shapes.values())
        self.flat = torch.zeros(self.numel, dtype=torch.int64, device=device)
        self.v = self.views(self.flat)

    def views(self, buf) -> dict:
        out, off = {}, 0
        for name, shape in self.shapes.items():
            n = int(np.prod(shape))
            out[name] = buf[off:off + n].reshape(shape)
            off += n
        return out

    def fill(self, host: np.ndarray, anchor_ids, positions, ring_slots) -> None:
        v = self.views(host[:self.numel])
        B, W, blk, n = self.num_seqs, self.window, self.block, len(positions)
        assert n <= B, (n, B)
        p = np.zeros(B, dtype=np.int64)
        p[:n] = positions
        slots = np.full(B, self.scratch_slot, dtype=np.int64)
        slots[:n] = ring_slots
        v["anchor_ids"][:] = 0
        v["anchor_ids"][:n] = anchor_ids
        real = np.repeat(np.arange(B) < n, blk)
        v["positions"][:] = np.where(real, np.repeat(p, blk) + np.tile(np.arange(1, blk + 1), B), 0)
        r = np.arange(W)
        ring_pos = p[:, None] - (p[:, None] - r) % W
        v["ring_rows"][:] = (slots[:, None] * self.ring_len + np.maximum(ring_pos, 0) % self.ring_len).ravel()
        nv = np.minimum(p + 1, W)
        j = np.arange(W + blk)
        ring_idx = np.arange(B)[:, None] * W + j
        draft_idx = B * W + np.arange(B)[:, None] * blk + j - nv[:, None]
        lists = np.where(j < nv[:, None], ring_idx, np.where(j < (nv + blk)[:, None], draft_idx, -1))
        lists[n:] = -1
        v["lists"][:] = np.repeat(lists, blk, axis=0)


    def fill_on_device(self, anchor_ids: torch.Tensor, positions: torch.Tensor, ring_slots: torch.Tensor) -> None:
        """fill() into the buffers themselves from tensors on their device ([n] each), by tensor ops
        only: an overlapped verify step drafts from anchors and positions its resolution left on the
        device (spec/overlap.py)."""
        v, dev = self.v, self.flat.device
        B, W, blk, RL, n = self.num_seqs, self.window, self.block, self.ring_len, int(positions.shape[0])
        assert n <= B, (n, B)
        i64 = dict(dtype=torch.int64, device=dev)
        seqs = torch.arange(B, **i64)
        p = torch.zeros(B, **i64)
        p[:n] = positions
        slots = torch.full((B,), self.scratch_slot, **i64)
        slots[:n] = ring_slots
        v["anchor_ids"].zero_()
        v["anchor_ids"][:n] = anchor_ids
        real = (seqs < n).repeat_interleave(blk)
        v["positions"].copy_(torch.where(real, p.repeat_interleave(blk) + torch.arange(1, blk + 1, **i64).repeat(B), 0))
        r = torch.arange(W, **i64)
        ring_pos = p[:, None] - (p[:, None] - r) % W
        v["ring_rows"].copy_((slots[:, None] * RL + ring_pos.clamp_min(0) % RL).reshape(-1))
        nv = (p + 1).clamp_max(W)[:, None]
        j = torch.arange(W + blk, **i64)
        ring_idx = seqs[:, None] * W + j
        draft_idx = B * W + seqs[:, None] * blk + j - nv
        lists = torch.where(j < nv, ring_idx, torch.where(j < nv + blk, draft_idx, -1))
        lists = torch.where(seqs[:, None] < n, lists, -1)
        v["lists"].copy_(lists.repeat_interleave(blk, dim=0))

def _main_x(model, main_hidden: torch.Tensor) -> torch.Tensor:
    m0 = model.mtp[0]
    return m0.main_norm(m0.main_proj(main_hidden))


@torch.inference_mode()
def dspark_absorb(model, main_hidden: torch.Tensor, positions: torch.Tensor, ring_slots: list[int],
                  cu_seqlens: list[int], caches, max_pos: int | None = None) -> None:
    """main_hidden [T, k*d] rows at `positions` [T]; sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1].
    max_pos: a bound on the positions, if known (no device-to-host read for the rope table)."""
    main_x = _main_x(model, main_hidden)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    counts = cu[1:] - cu[:-1]
    ring_len = caches.ring_len
    keep = np.arange(int(cu[-1])) >= np.repeat(cu[1:], counts) - ring_len      # only the last RING rows
    rows = to_device(np.nonzero(keep)[0], positions.device)
    slots = to_device(np.repeat(np.asarray(ring_slots, dtype=np.int64), counts)[keep], positions.device)
    dst = slots * ring_len + positions[rows] % ring_len
    for m in model.mtp:
        kv = m.attn.main_kv(main_x, positions, model.rope, max_pos)
        ring = caches.window_kv[m.layer_id].flatten(0, 1)
        ring[dst] = kv[rows].to(ring.dtype)


@torch.inference_mode()
def dspark_propose(model, anchor_ids: torch.Tensor, positions: list[int], ring_slots: list[int], caches,
                   sample=None, static: DraftStepBuffers | None = None) -> DraftOutput:
    """anchor_ids [B] (the token at position p+1); positions: p per sequence (the last absorbed
    backbone position). `sample(logits [B, V]) -> [B]` picks each draft (greedy by default).
    static: the pass's index tensors prebuilt (CUDA graphs; anchor_ids = its anchor_ids view)."""
    args = model.args
    blk, B, dev = args.dspark_block_size, anchor_ids.numel(), anchor_ids.device
    ids = torch.full((B, blk), args.dspark_noise_token_id, dtype=torch.int64, device=dev)
    ids[:, 0] = anchor_ids
    h = model.embed(ids.flatten()).unsqueeze(1).repeat(1, args.hc_mult, 1)         # [B*blk, hc, d]
    pre = torch.zeros(h.shape[0], args.hc_mult, device=dev)
    pre[:, 0] = 1.0
    for m in model.mtp:
        attn = m.attn
        if static is not None:
            fn = lambda xn, xq=None, attn=attn: attn.forward_draft_static(xn, static, caches, model.rope, xq)  # noqa: E731
        else:
            fn = lambda xn, xq=None, attn=attn: attn.forward_draft(  # noqa: E731
                xn, positions, ring_slots, blk, caches, model.rope, xq)
        h, pre = m(h, pre, fn)
    last = model.mtp[-1]
    x = Block.hc_pre(h, pre)                                                      # [B*blk, d] bf16
    logits = model.logits(last.norm(x)).view(B, blk, -1)
    out = torch.empty(B, blk + 1, dtype=torch.int64, device=dev)
    out[:, 0] = anchor_ids
    embeds = []
    for i in range(blk):
        bias, e = last.markov_head(out[:, i])
        logits[:, i] += bias
        embeds.append(e)
        out[:, i + 1] = logits[:, i].argmax(-1) if sample is None else sample(logits[:, i])
    feat = torch.cat([x.view(B, blk, -1), torch.stack(embeds, 1)], dim=-1)
    conf = linear_fp32(feat, last.confidence_head.proj.weight).squeeze(-1)
    return DraftOutput(draft_ids=out[:, 1:], logits=logits, confidence=conf)
