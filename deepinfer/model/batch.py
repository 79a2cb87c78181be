"""The contract between the engine's model runner and the model: one step over many sequences.

A step runs any number of sequences, each with any number of new tokens starting at any position
(whole prefill, a prefill chunk that continues a cache, one-token decode, 1+k verification, a
replayed suffix). All per-token tensors are flat over the batch: sequence i owns rows
cu_seqlens[i] : cu_seqlens[i + 1].

Caches are addressed by absolute position, never by "how many were appended", so rolling back
rejected draft tokens is free: the runner lowers the sequence's length and the next step
overwrites the stale rows (see deepinfer/cache/model_caches.py for why every kind allows that).

    sequence i:   | cached: positions 0 .. start_pos[i]-1 | new: start_pos[i] .. start_pos[i]+q_len[i]-1 |
                    (read from caches)                     (computed now, written to caches)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64, the new tokens of every sequence, concatenated
    positions: torch.Tensor        # [T] int64, absolute position of each new token
    cu_seqlens: torch.Tensor       # [B+1] int64 (CPU), prefix sums of the new-token counts
    start_pos: torch.Tensor        # [B] int64 (CPU), tokens already in the caches per sequence
    ngram_history: torch.Tensor    # [B, max_ngram_size-1] int64, token ids at start_pos-3..start_pos-1 (-1 before 0, -2 image-span token)
    ring_slots: torch.Tensor       # [B] int64 (CPU), the window-ring / compressor-carry slot each sequence owns
    block_tables: torch.Tensor     # [B, max_blocks] int64, compressed-cache blocks per sequence (-1 = none)
    logits_indices: torch.Tensor   # [N] int64, rows of T whose logits are wanted (last token, or all verified ones)
    token_mask: torch.Tensor | None = None   # [T] bool, False inside image spans (Engram dead, VL router bias)
    image_rows: torch.Tensor | None = None   # [n] int64, rows of T inside image spans whose embeddings are image_embeds
    image_embeds: torch.Tensor | None = None # [n, dim] bf16, span embeddings (VisionTower.encode) for those rows
    # SWA bounded replay (outputs.ReplayParams), None = no sequence replays: per sequence, the first
    # position whose window key exists (queries never see keys below it) and the first position
    # whose compressed entries this step may write (the ones below are cached and shared)
    window_start: torch.Tensor | None = None   # [B] int64 (CPU)
    write_from: torch.Tensor | None = None     # [B] int64 (CPU)
    # YOCO prefill truncation (model/yoco.py), None = off: per sequence, the first position whose row
    # runs through the decoder layers (earlier rows run the encoder and layer B's compressor only)
    yoco_keep_from: torch.Tensor | None = None   # [B] int64 (CPU)

    @property
    def num_seqs(self) -> int:
        return self.start_pos.numel()

    @property
    def q_lens(self) -> torch.Tensor:  # [B]
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]
