"""The model's cache tensors, addressed by absolute position (so rolling back draft tokens is free).

Three kinds, all explicit tensors handed to `Transformer.forward` (no hidden module state):

  window ring      per layer (DSpark blocks included): [num_ring_slots, RING, head_dim]; position p of
                   the sequence owning ring slot r lives at [r, p % RING]. RING = 2 * window, not
                   window: a step reads positions t-window+1 .. start-1 from the ring BEFORE writing its
                   new rows, and after a rollback of up to `window` rejected positions the rows it needs
                   have not been overwritten.
  compressor carry per ratio>1 KV source: raw pre-pool rows (kv, score), fp32 [num_ring_slots, RING, head_dim],
                   same addressing, so a group of `ratio` positions that straddles two steps pools
                   correctly, also after a rollback.
  compressed pools per KV source: compressed KV [num_blocks, block_tokens // ratio, head_dim] and, for sources
                   with an indexer, index keys [num_blocks, block_tokens // ratio, index_head_dim], or with
                   ModelArgs.index_k_packed [.., fp4_rows_width(index_head_dim)] uint8 (packed FP4 rows:
                   reference.fp4_pack_rows_ref; write_entries / read_entries pack and unpack them). A
                   sequence's block table row covers `block_tokens` token positions per block for every
                   source: entry j (covering positions j*ratio ..) is at
                   [block_table[j*ratio // block_tokens], j % (block_tokens // ratio)].

    positions:  0 ........ block_tokens-1 | block_tokens ..... 2*block_tokens-1 | ...
    block table:        block_table[0]    |          block_table[1]             | ...
    ratio-2 entries:  0 .. block_tokens/2-1 |  block_tokens/2 .. block_tokens-1  | ...

Engram n-gram history is not cached: the runner passes the previous max_ngram-1 ids (ForwardBatch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.reference import fp4_pack_rows_ref, fp4_rows_dim, fp4_rows_width, fp4_unpack_rows_ref


@dataclass
class ModelCaches:
    ring_len: int                                  # RING = 2 * window
    block_tokens: int                              # token positions per block (every source)
    window_kv: list[torch.Tensor]                  # per layer (backbone + DSpark): [slots, RING, head_dim]
    carry_kv: dict[int, torch.Tensor]              # ratio>1 source -> [slots, RING, head_dim] fp32
    carry_score: dict[int, torch.Tensor]           # ratio>1 source -> [slots, RING, head_dim] fp32
    compressed_kv: dict[int, torch.Tensor]         # source -> [num_blocks, block_tokens // ratio, head_dim]
    index_k: dict[int, torch.Tensor]               # source with indexer -> [num_blocks, block_tokens // ratio, row bytes]
    ratios: dict[int, int]                         # source -> compress ratio
    # one ring slot and one pool block that no sequence owns (allocate(scratch=True)): the padding
    # rows of a static decode step (CUDA graphs) write there; -1 = none
    scratch_slot: int = -1
    scratch_block: int = -1

    # ---- construction and sizing -------------------------------------------------------------
    @classmethod
    def allocate(cls, args, num_ring_slots: int, num_blocks: int, block_tokens: int = 64,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 scratch: bool = False) -> "ModelCaches":
        """scratch: one more ring slot (id num_ring_slots) and pool block (id num_blocks) for padding."""
        ring = 2 * args.window_size
        slots, blocks = num_ring_slots, num_blocks
        num_ring_slots, num_blocks = num_ring_slots + scratch, num_blocks + scratch
        for s in args.kv_source_layers:
            if block_tokens % args.compress_ratios[s]:
                raise ValueError(f"block_tokens {block_tokens} is not a multiple of layer {s}'s ratio")
        D, ID = args.head_dim, args.index_head_dim
        window = [torch.zeros(num_ring_slots, ring, D, dtype=dtype, device=device)
                  for _ in range(args.n_total_layers)]
        ratios = {s: args.compress_ratios[s] for s in args.kv_source_layers}
        carry_kv = {s: torch.zeros(num_ring_slots, ring, D, device=device) for s, r in ratios.items() if r > 1}
        carry_score = {s: torch.zeros(num_ring_slots, ring, D, device=device) for s, r in ratios.items() if r > 1}
        ckv = {s: torch.zeros(num_blocks, block_tokens // r, D, dtype=dtype, device=device) for s, r in ratios.items()}
        # index keys in dtype, or (ModelArgs.index_k_packed) as packed FP4 rows: their values are FP4 in
        # 32-blocks (reference.fp4_pack_rows_ref), in under a third of bf16's bytes
        ik_shape, ik_dtype = ((fp4_rows_width(ID), torch.uint8) if args.index_k_packed else (ID, dtype))
        ik = {s: torch.zeros(num_blocks, block_tokens // r, ik_shape, dtype=ik_dtype, device=device)
              for s, r in ratios.items() if s in args.index_source_layers}
        return cls(ring, block_tokens, window, carry_kv, carry_score, ckv, ik, ratios,
                   scratch_slot=slots if scratch else -1, scratch_block=blocks if scratch else -1)

    @staticmethod
    def bytes_per_ring_slot(args, dtype: torch.dtype = torch.bfloat16) -> int:
        """Window rings of every layer plus the fp32 compressor carry of one sequence."""
        ring, es = 2 * args.window_size, torch.finfo(dtype).bits // 8
        n_carry = sum(1 for s in args.kv_source_layers if args.compress_ratios[s] > 1)
        return args.n_total_layers * ring * args.head_dim * es + n_carry * 2 * ring * args.head_dim * 4

    @staticmethod
    def bytes_per_block(args, block_tokens: int = 64, dtype: torch.dtype = torch.bfloat16) -> int:
        """Compressed KV and index keys of `block_tokens` positions, summed over the sources."""
        es, total = torch.finfo(dtype).bits // 8, 0
        for s in args.kv_source_layers:
            per = block_tokens // args.compress_ratios[s]
            total += per * args.head_dim * es
            if s in args.index_source_layers:
                row = fp4_rows_width(args.index_head_dim) if args.index_k_packed else args.index_head_dim * es
                total += per * row
        return total

    # ---- access (used by the model) -----------------------------------------------------------
    def read_ring(self, layer: int, slot: int, positions: torch.Tensor) -> torch.Tensor:
        return self.window_kv[layer][slot, positions % self.ring_len]

    def write_ring(self, layer: int, slot: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        keep = slice(max(0, positions.numel() - self.ring_len), None)   # only the last RING rows
        self.window_kv[layer][slot, positions[keep] % self.ring_len] = rows[keep].to(self.window_kv[layer].dtype)

    def entries_per_block(self, src: int) -> int:
        return self.block_tokens // self.ratios[src]

    def _addr(self, src: int, block_table: torch.Tensor, entries: torch.Tensor):
        per = self.block_tokens // self.ratios[src]
        blocks = block_table[entries // per]
        return blocks, entries % per

    def write_entries(self, pool: dict[int, torch.Tensor], src: int, block_table: torch.Tensor,
                      entries: torch.Tensor, values: torch.Tensor) -> None:
        b, o = self._addr(src, block_table, entries)
        if pool[src].dtype == torch.uint8:                   # packed FP4 rows (the index keys)
            pool[src][b, o] = fp4_pack_rows_ref(values)
        else:
            pool[src][b, o] = values.to(pool[src].dtype)

    def read_entries(self, pool: dict[int, torch.Tensor], src: int, block_table: torch.Tensor,
                     num_entries: int) -> torch.Tensor:
        entries = torch.arange(num_entries, device=block_table.device)
        b, o = self._addr(src, block_table, entries)
        rows = pool[src][b, o]
        return fp4_unpack_rows_ref(rows, fp4_rows_dim(rows.shape[-1])) if rows.dtype == torch.uint8 else rows
