"""YOCO prefill truncation (DeepInfer's "compact" mode; the V4.1 report's decoder replay, CED).

The backbone splits at the first ratio-1 layer B (20 in V4.1, 6 in the tiny preset): layers
[0, B) are the encoder, [B, n_layers) the decoder. With `EngineArgs(yoco_prefill_keep_tokens=N)`:

    encoder layers         every row of the step (the whole prompt)
    layer B's compressor   every row: the decoder's global (compressed) KV and index keys for every
                           token, projected from layer B's input (decoder layers read only these)
    decoder layers         only rows at positions >= keep_from = (tokens known) - N of each sequence

A decoder query at p sees window keys in [max(p-W+1, keep_from), p] (the dropped rows never wrote
the decoder's window rings). N >= window + backtracking keeps every later decode step's window
inside the kept rows, so only the prompt's own logits and the last N rows' hidden states are
approximate (by design, as DeepInfer and DeepSeek's service run it; perf/yoco_prefill.py measures
the drift). Decode and verification rows are always kept (keep_from <= their start).

A chunk wholly before keep_from keeps one placeholder row (its last) through the decoder, so every
sequence still has a logits row; it sees only itself and writes nothing that a kept row reads
(its window-ring slot is rewritten by a later position before any query reads it).

The encoder computes exactly what exact mode computes, so the compressed KV a step writes (and the
prefix cache shares) is the same in both modes; only decoder window rings and outputs differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import ForwardBatch


def decoder_start(args) -> int:
    """B: the first ratio-1 backbone layer (DeepInfer's n_prefill_layer); n_layers if none."""
    return next((i for i, r in enumerate(args.compress_ratios[:args.n_layers]) if r == 1), args.n_layers)


def check_yoco(args, keep_tokens: int, max_backtrack: int) -> None:
    """Raise ValueError (naming the setting) when this model or N cannot run YOCO truncation."""
    B = decoder_start(args)
    if B >= args.n_layers:
        raise ValueError("yoco_prefill_keep_tokens needs a model with a ratio-1 decoder layer "
                         "(compress_ratios has no 1): this checkpoint has no YOCO boundary")
    low = args.window_size + max_backtrack
    if keep_tokens < low:
        raise ValueError(f"yoco_prefill_keep_tokens={keep_tokens} is below the window ({args.window_size}) + "
                         f"the largest rollback ({max_backtrack}) = {low}: later decode steps would read "
                         f"window keys that were never computed (DeepInfer runs 140 for V4.1)")
    late = [s for s in args.kv_source_layers if s > B]
    if late or any(args.compress_ratios[L] > 1 for L in range(B, args.n_layers)):
        raise ValueError(f"yoco_prefill_keep_tokens: decoder layers {B}..{args.n_layers - 1} must read the "
                         f"compressed KV of layer {B} only (KV sources after it: {late}); this checkpoint's "
                         "layout cannot be truncated")


@dataclass
class Compaction:
    """Which rows of a step go through the decoder layers."""
    kept: torch.Tensor            # [T'] int64 device: rows of the step kept
    batch: ForwardBatch           # the decoder's step over the kept rows


def plan_compaction(batch: ForwardBatch) -> Compaction | None:
    """The decoder's step, or None when every row is kept (the step runs as in exact mode)."""
    if batch.yoco_keep_from is None:
        return None
    cu = batch.cu_seqlens.numpy().astype(np.int64)
    starts = batch.start_pos.numpy().astype(np.int64)
    q = cu[1:] - cu[:-1]
    ends = starts + q
    keep_from = batch.yoco_keep_from.numpy().astype(np.int64)
    if not (keep_from > starts).any():
        return None
    # first kept position per sequence; a chunk wholly before keep_from keeps its last row
    new_start = np.where(keep_from >= ends, ends - 1, np.maximum(starts, keep_from))
    new_start = np.where(q == 0, starts, new_start)
    new_q = ends - new_start
    first_row = cu[:-1] + (new_start - starts)
    kept = np.repeat(first_row - np.concatenate([[0], np.cumsum(new_q)[:-1]]), new_q) + np.arange(int(new_q.sum()))
    new_cu = np.zeros_like(cu)
    np.cumsum(new_q, out=new_cu[1:])
    # window floor: no key below keep_from (the dropped rows wrote no decoder ring), a placeholder
    # row sees itself; an earlier replay floor still applies
    floor = np.minimum(np.maximum(keep_from, 0), new_start)
    if batch.window_start is not None:
        floor = np.maximum(floor, np.minimum(batch.window_start.numpy().astype(np.int64), new_start))
    dev = batch.input_ids.device
    kept_dev = torch.from_numpy(kept).to(dev)
    row_map = torch.full((int(cu[-1]),), -1, dtype=torch.int64, device=dev)
    row_map[kept_dev] = torch.arange(len(kept), device=dev)
    sub = ForwardBatch(
        input_ids=batch.input_ids[kept_dev], positions=batch.positions[kept_dev],
        cu_seqlens=torch.from_numpy(new_cu), start_pos=torch.from_numpy(new_start),
        ngram_history=batch.ngram_history, ring_slots=batch.ring_slots, block_tables=batch.block_tables,
        logits_indices=row_map[batch.logits_indices],
        token_mask=None if batch.token_mask is None else batch.token_mask[kept_dev],
        window_start=torch.from_numpy(floor),
        write_from=torch.from_numpy(ends))     # layer B wrote every entry already: nothing below the end
    return Compaction(kept=kept_dev, batch=sub)


def write_decoder_kv(layer, h: torch.Tensor, pre: torch.Tensor, meta, caches, rope) -> None:
    """Layer B's compressed KV and index keys for every row of the step, from its attention input
    (the same mixes and norm its forward applies), before the rows are dropped."""
    _, xa = layer.mixes_pre(h, "attn", pre, tail=False)
    attn = layer.attn
    attn._compress(meta, attn.compressor.project(layer.attn_norm(xa)), caches, rope)
