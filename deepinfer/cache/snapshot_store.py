"""Window snapshots, the runner's half: the tensors of num_slots snapshots and the copies in and
out of the model's caches (cache/snapshot_index.py decides which slot holds what).

One snapshot = what a ring slot holds for its sequence plus its partial tail block:

    window rings   per layer (DSpark blocks included)    [RING, head_dim]       (whole slot copied:
    carry kv/score per ratio>1 KV source (fp32)          [RING, head_dim] x 2    addressed by position,
    tail block     per KV source: compressed entries     [B / ratio, head_dim]   so a copy into another
                   and index keys                        [B / ratio, index_dim]  slot keeps addressing)

On CUDA the store is pinned host memory (the report keeps SWA state in host DRAM) and the copies
are asynchronous on the current stream, so a save issued before the step that reuses the slot or
block, and a restore before the step that reads it, are ordered with it.
"""

from __future__ import annotations

import torch


class SnapshotStore:
    def __init__(self, caches, num_slots: int) -> None:
        self.caches = caches
        self.num_slots = num_slots
        dev = caches.window_kv[0].device
        pin = dev.type == "cuda"
        host = lambda t: torch.empty((num_slots,) + tuple(t.shape[1:]), dtype=t.dtype,   # noqa: E731
                                     device="cpu", pin_memory=pin)
        self.window = [host(t) for t in caches.window_kv]
        self.carry_kv = {s: host(t) for s, t in caches.carry_kv.items()}
        self.carry_score = {s: host(t) for s, t in caches.carry_score.items()}
        self.tail_kv = {s: host(t) for s, t in caches.compressed_kv.items()}
        self.tail_ik = {s: host(t) for s, t in caches.index_k.items()}
        self.num_saves = self.num_restores = 0

    @staticmethod
    def bytes_per_snapshot(caches_or_args, block_tokens: int = 64, dtype: torch.dtype = torch.bfloat16) -> int:
        """From a ModelArgs: ring slot bytes + one block (ModelCaches' own sizing)."""
        from deepinfer.cache.model_caches import ModelCaches
        a = caches_or_args
        return ModelCaches.bytes_per_ring_slot(a, dtype) + ModelCaches.bytes_per_block(a, block_tokens, dtype)

    def _pairs(self):
        c = self.caches
        yield from zip(self.window, c.window_kv)
        for s in self.carry_kv:
            yield self.carry_kv[s], c.carry_kv[s]
            yield self.carry_score[s], c.carry_score[s]

    def _block_pairs(self):
        c = self.caches
        for s in self.tail_kv:
            yield self.tail_kv[s], c.compressed_kv[s]
        for s in self.tail_ik:
            yield self.tail_ik[s], c.index_k[s]

    def save(self, ring_slot: int, tail_block: int, slot: int) -> None:
        """Ring slot (and tail block, -1 = none) -> snapshot slot."""
        for dst, src in self._pairs():
            dst[slot].copy_(src[ring_slot], non_blocking=True)
        if tail_block >= 0:
            for dst, src in self._block_pairs():
                dst[slot].copy_(src[tail_block], non_blocking=True)
        self.num_saves += 1

    def restore(self, slot: int, ring_slot: int, tail_block: int) -> None:
        """Snapshot slot -> a new sequence's ring slot (and its tail block, -1 = none)."""
        for src, dst in self._pairs():
            dst[ring_slot].copy_(src[slot], non_blocking=True)
        if tail_block >= 0:
            for src, dst in self._block_pairs():
                dst[tail_block].copy_(src[slot], non_blocking=True)
        self.num_restores += 1


def num_snapshot_slots(engine_args, model_args) -> int:
    """Snapshots the pool holds: window_snapshot_bytes / one snapshot's bytes (None = 2 per running
    sequence); 0 without prefix caching."""
    if not engine_args.enable_prefix_caching:
        return 0
    if engine_args.window_snapshot_bytes is None:
        return 2 * engine_args.max_num_seqs
    import torch
    dtype = getattr(torch, engine_args.dtype)
    return engine_args.window_snapshot_bytes // SnapshotStore.bytes_per_snapshot(model_args, engine_args.block_tokens, dtype)


def check_replay_tokens(engine_args, model_args) -> None:
    """A replay shorter than the window would leave window keys that the next tokens read unbuilt."""
    if engine_args.enable_prefix_caching and engine_args.swa_replay_tokens < model_args.window_size:
        raise ValueError(f"swa_replay_tokens ({engine_args.swa_replay_tokens}) is below the model's window "
                         f"({model_args.window_size}): the window keys a query after the hit reads would not exist")
