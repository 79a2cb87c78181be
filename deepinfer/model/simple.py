"""A one-sequence, non-paged convenience path (score CLI, tests): builds the ForwardBatch and small
caches itself and runs THROUGH the same `Transformer.forward` as the engine."""

from __future__ import annotations

import torch

from deepinfer.cache.model_caches import ModelCaches

from .batch import ForwardBatch
from .dspark import DraftOutput, dspark_absorb, dspark_propose
from .transformer import ModelOutput


def make_batch(chunks: list[tuple[list[int], int, list[int]]], ring_slots: list[int], block_tables: torch.Tensor,
               ngram: int, device, logits: str = "last", token_mask=None) -> ForwardBatch:
    """chunks: per sequence (new token ids, start position, all earlier token ids)."""
    ids, pos, cu, hist, li = [], [], [0], [], []
    for new, start, earlier in chunks:
        ids += new
        pos += range(start, start + len(new))
        cu.append(cu[-1] + len(new))
        h = earlier[-(ngram - 1):] if ngram > 1 else []
        hist.append([-1] * (ngram - 1 - len(h)) + list(h))
        li += list(range(cu[-2], cu[-1])) if logits == "all" else [cu[-1] - 1]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64),
        start_pos=torch.tensor([c[1] for c in chunks], dtype=torch.int64),
        ngram_history=torch.tensor(hist, dtype=torch.int64, device=device).view(len(chunks), max(ngram - 1, 0)),
        ring_slots=torch.tensor(ring_slots, dtype=torch.int64),
        block_tables=block_tables.to(device),
        logits_indices=torch.tensor(li, dtype=torch.int64, device=device),
        token_mask=token_mask,
    )


class SequenceRunner:
    """One sequence: `step(ids)` appends tokens (any count) and returns the ModelOutput."""

    def __init__(self, model, max_len: int, device=None, block_tokens: int = 64):
        self.model, self.args = model, model.args
        self.device = device or next(iter(model.buffers())).device
        nb = (max_len + block_tokens - 1) // block_tokens
        self.caches = ModelCaches.allocate(self.args, 1, nb, block_tokens, self.device)
        self.block_table = torch.arange(nb, dtype=torch.int64).view(1, nb)
        self.tokens: list[int] = []

    def step(self, ids: list[int], logits: str = "last", dump_hidden: bool = False) -> ModelOutput:
        batch = make_batch([(list(ids), len(self.tokens), self.tokens)], [0], self.block_table,
                           self.args.engram_max_ngram_size, self.device, logits)
        out = self.model(batch, self.caches, dump_hidden=dump_hidden)
        self._last_positions = batch.positions
        self.tokens += list(ids)
        return out

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens (caches need nothing: they are addressed by position)."""
        del self.tokens[len(self.tokens) - num_tokens:]

    def dspark_absorb(self, main_hidden: torch.Tensor, positions: torch.Tensor) -> None:
        dspark_absorb(self.model, main_hidden, positions, [0], [0, positions.numel()], self.caches)

    def dspark_propose(self, anchor: int, position: int) -> DraftOutput:
        ids = torch.tensor([anchor], dtype=torch.int64, device=self.device)
        return dspark_propose(self.model, ids, [position], [0], self.caches)
