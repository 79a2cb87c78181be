"""DeepSeek-V4.1 backbone (reference model.py `Block`, `Transformer`): embed -> hc_mult copies ->
blocks (Engram before a block where configured) -> collapse with the last pre-mix -> norm -> head.

One `forward(batch, caches)` serves every step shape: a whole prefill, a chunk continuing a cache,
one-token decode and 1+k verification, for any number of sequences at once (see model/batch.py).
Everything runs flat over all T new tokens of all sequences; attention gathers one KV buffer per
layer for the whole batch (model/step_metadata.py builds the index lists once per step).
With YOCO truncation (ForwardBatch.yoco_keep_from, model/yoco.py) the rows drop to the kept ones
at the first decoder layer, after it has written the compressed KV of every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .args import ModelArgs
from .block import Block
from .batch import ForwardBatch
from .engram import NgramHasher
from .dspark import DSparkBlock
from .layers import Embedding, Linear, RMSNorm, linear_fp32, rope_tables
from .step_metadata import StepMetadata
from .vision import VisionTower
from . import block, ops, side_stream, yoco


@dataclass
class ModelOutput:
    logits: torch.Tensor                      # [N, V] fp32, rows = batch.logits_indices
    main_hidden: torch.Tensor | None = None   # [T, len(dspark_target_layer_ids) * dim] bf16: DSpark input
    hidden: torch.Tensor | None = None        # [n_layers + 1, T, hc, dim] fp32 (dump_hidden): stream entering each layer, then the last output
    attn_out: torch.Tensor | None = None      # [n_layers, T, dim] fp32 (dump_hidden): each attention output
    hash_ids: torch.Tensor | None = None      # [T, n_engram_layers, cols] int64 (dump_hidden)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, hasher: NgramHasher | None = None, parallel=None):
        super().__init__()
        self.args = args
        self.parallel = parallel      # deepinfer.parallel.ParallelState; None = one rank, every expert local
        self.hasher = hasher
        self.rope = rope_tables(args)
        self.embed = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([Block(args, i, parallel) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = Linear(args.dim, args.vocab_size)
        self.mtp = nn.ModuleList([DSparkBlock(args, args.n_layers + j) for j in range(args.n_mtp_layers)]
                                 if args.dspark_block_size else [])
        self.vision_tower = VisionTower(args.vision, args.dim) if args.vision is not None else None
        # the last index-key owner in layer order: what the reference's aliased decode reads first
        self.decoder_start = yoco.decoder_start(args)   # YOCO boundary B (used when a batch sets yoco_keep_from)
        owners = [s for s in args.kv_source_layers if s in args.index_source_layers]
        self._last_index_owner = owners[-1] if owners else -1

    # ---- helpers ---------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V] fp32 = x @ head^T over fp32 values. On CUDA a bf16 GEMM with fp32 output gives those
        values (bf16 x bf16 products are exact in fp32, the sum is fp32) without materializing an
        fp32 copy of the [V, dim] head each step (2.6 GB written and read at full width)."""
        return linear_fp32(x, self.head.weight)

    def step_metadata(self, batch: ForwardBatch, caches) -> StepMetadata:
        owner = self._last_index_owner if self.args.emulate_index_k_alias else -1
        return StepMetadata.build(batch, self.args.window_size, caches.ring_len, owner,
                                  canonical_layout=self.args.step_shape_invariant)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """A rank with no tokens this step: every collective a forward makes, in the same order (each
        sharded Engram table's lookup, each expert-parallel MoE layer's dispatch and combine), with no
        tokens, so the other ranks' collectives line up and this rank's shards serve their tokens."""
        dev = self.embed.weight.device
        x = torch.empty(0, self.args.dim, dtype=torch.bfloat16, device=dev)
        for layer in self.layers:
            if layer.engram is not None and layer.engram.embed.sharded:
                layer.engram.embed(torch.empty(0, self.args.n_hash_cols, dtype=torch.long, device=dev))
            if layer.ffn.ep is not None:
                layer.ffn(x)

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches, dump_hidden: bool = False,
                meta: StepMetadata | None = None) -> ModelOutput:
        """meta: the step's metadata when the caller holds it in static buffers (CUDA graphs,
        step_metadata.DecodeStepBuffers); None = built here from the batch's host arrays."""
        args = self.args
        meta = self.step_metadata(batch, caches) if meta is None else meta
        image_mask = None if batch.token_mask is None else ~batch.token_mask
        hashes = None
        if args.engram_layer_ids:
            hashes = self.hasher(batch.input_ids, batch.cu_seqlens, batch.ngram_history, batch.token_mask)
        h = self.embed(batch.input_ids)                                              # [T, d]
        if batch.image_rows is not None:       # image spans: aligner rows and learned delimiters
            h[batch.image_rows] = batch.image_embeds.to(h.dtype)
        h = h.unsqueeze(1).repeat(1, args.hc_mult, 1)                                # [T, hc, d]
        pre = torch.zeros(h.shape[0], args.hc_mult, device=h.device)
        pre[:, 0] = 1.0
        taps, snaps, attn_outs = [], [], ([] if dump_hidden else None)
        compact = yoco.plan_compaction(batch)
        token_mask, num_rows = batch.token_mask, h.shape[0]
        # Engram's projections read only the hash ids: in a small step the next layer's is made on the side
        # stream beside this layer (model/side_stream.py); a sharded table's lookup is a collective: inline
        ahead = hashes is not None and compact is None and side_stream.forks(h.device, num_rows)
        engram_kv = {}
        for i, layer in enumerate(self.layers):
            if dump_hidden:
                snaps.append(h.float())
            for j in (i, i + 1) if ahead else ():
                eg = self.layers[j].engram if j < len(self.layers) else None
                if eg is not None and j not in engram_kv and not eg.embed.sharded:
                    engram_kv[j] = side_stream.branch(eg.project, hashes[:, eg.hash_index], tokens=num_rows)
            if layer.engram is not None:
                kv = engram_kv.pop(i).wait() if i in engram_kv else None
                h = layer.engram(h, hashes[:, layer.engram.hash_index], token_mask, kv)
            if compact is not None and i == self.decoder_start:
                if dump_hidden:
                    raise ValueError("dump_hidden does not combine with YOCO prefill truncation")
                # YOCO: the decoder's compressed KV for every row, then the decoder runs the kept rows only
                yoco.write_decoder_kv(layer, h, pre, meta, caches, self.rope)
                kept, batch = compact.kept, compact.batch
                h, pre = h[kept], pre[kept]
                image_mask = None if image_mask is None else image_mask[kept]
                hashes = None if hashes is None else hashes[kept]
                token_mask = batch.token_mask
                meta = self.step_metadata(batch, caches)
            attn_fn = lambda xn, xq=None, layer=layer: layer.attn(xn, meta, caches, self.rope, xq)  # noqa: E731
            # a DSpark target layer's tap (its input averaged over the hc copies) comes out of its mixes; the
            # block's output stays an Expand for a next block that reads it first (block.FUSE_SUBLAYER_INPUT)
            nxt = i + 1
            defer = (block.fuses_sublayer_inputs(pre.shape[0]) and not dump_hidden and nxt < len(self.layers)
                     and self.layers[nxt].engram is None and not (compact is not None and nxt == self.decoder_start))
            h, pre = layer(h, pre, attn_fn, image_mask, attn_outs, taps if i in args.dspark_target_layer_ids else None,
                           defer_out=defer)
        if dump_hidden:
            snaps.append(h.float())
        li = batch.logits_indices
        x = ops.hc_pre_norm(h, pre, li, self.norm.weight, self.norm.eps)   # norm(Block.hc_pre(h[li], pre[li]))
        if compact is not None and taps:    # DSpark rings get the kept rows (drafts read the last window only)
            taps = [t if t.shape[0] == num_rows else t.new_zeros(num_rows, t.shape[1]).index_copy_(0, compact.kept, t)
                    for t in taps]
        return ModelOutput(
            logits=self.logits(x),
            main_hidden=torch.cat(taps, dim=-1) if taps else None,
            hidden=torch.stack(snaps) if dump_hidden else None,
            attn_out=torch.stack([a.float() for a in attn_outs]) if dump_hidden else None,
            hash_ids=hashes if dump_hidden else None,
        )
