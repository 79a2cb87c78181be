"""One rank's half of the engine: the model, its caches, the sampler and the ModelRunner.

The single-process Engine builds one in process; each rank worker of the multi-GPU engine
(deepinfer/parallel/worker.py) builds its own. What the front end needs without a model (EOS id,
vocabulary, position limit) is in ModelFacts, read from config.json alone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from deepinfer.cache.kv_cache_manager import cdiv
from deepinfer.config import EngineArgs

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_TOKENS_PER_SEQ = 2048   # CPU cache size when num_cache_blocks is not given


@dataclass
class ModelFacts:
    """The checkpoint's config facts the scheduler and request checks need."""
    model_args: object            # deepinfer.model.args.ModelArgs
    eos_token_id: int | None
    max_position: int
    vocab_size: int

    @classmethod
    def read(cls, args: EngineArgs) -> "ModelFacts":
        from deepinfer.model.args import ModelArgs
        cfg = read_hf_config(args.checkpoint)
        overrides = model_overrides(args)
        model_args = ModelArgs.from_hf_config(cfg, **overrides) if cfg else ModelArgs.from_checkpoint(args.checkpoint)
        tc = cfg.get("text_config", {})
        return cls(model_args, cfg.get("eos_token_id", tc.get("eos_token_id")),
                   int(tc.get("max_position_embeddings", cfg.get("max_position_embeddings", 1 << 20))),
                   model_args.vocab_size)


@dataclass
class RankRuntime:
    device: str
    model: object                 # deepinfer.model.transformer.Transformer
    caches: object                # deepinfer.cache.model_caches.ModelCaches
    runner: object                # deepinfer.worker.model_runner.ModelRunner
    sampler: object               # deepinfer.sample.Sampler | None
    num_cache_blocks: int
    max_model_len: int
    graph_sizes: tuple[int, ...]
    async_scheduling: bool


def model_overrides(args: EngineArgs) -> dict:
    # batch invariance also needs chunking invariance: one window layout for every chunk
    return {**({"step_shape_invariant": True} if args.batch_invariant else {}), **args.model_overrides}


def build_rank(args: EngineArgs, facts: ModelFacts, parallel=None, device: str | None = None) -> RankRuntime:
    """Load the model (this rank's experts only when `parallel` splits them), size and allocate the
    caches, and build the runner."""
    from deepinfer.cache.disk_tier import num_disk_blocks
    from deepinfer.cache.host_tier import num_host_slots
    from deepinfer.cache.snapshot_store import check_replay_tokens, num_snapshot_slots
    from deepinfer.kernels.select import precompile_cuda_kernels
    from deepinfer.model.loader import load_model
    from deepinfer.worker.graph_step import graph_sizes
    from deepinfer.worker.loading import (allocate_caches, cache_bytes_per_block, dense_fp8_copies, expert_share,
                                          hold_dense_bf16, resolved_expert_format, torch_dtype)
    device = device or args.resolved_device()
    torch_dtype(args.dtype)
    check_replay_tokens(args, facts.model_args)
    if args.yoco_prefill_keep_tokens:
        from deepinfer.model.yoco import check_yoco
        check_yoco(facts.model_args, args.yoco_prefill_keep_tokens,
                   args.num_speculative_tokens + 1 if args.speculative else 0)
    disk_blocks = num_disk_blocks(args, facts.model_args)      # refuses a bad disk tier before loading
    nvcc = precompile_cuda_kernels(device)       # compiled beside the weight load, not in the first prefill
    model = load_model(args.checkpoint, device=device, progress=parallel is not None and parallel.rank == 0,
                       parallel=parallel, load_format=args.load_format,
                       expert_format=resolved_expert_format(args.expert_format, device, args.batch_invariant,
                                                            facts.model_args, expert_share(facts.model_args, parallel)),
                       **({"dense_bf16": True} if hold_dense_bf16(args.dense_weights, device, facts.model_args) else {}),
                       dense_fp8_copy=dense_fp8_copies(args.dense_weights, device, facts.model_args),
                       engram_placement="host" if args.resolved_engram_placement() == "host" else "device",
                       # EPLB moves experts between ranks' stacks: keep one scale form in all of them
                       **({"expert_row_scales": False} if args.enable_eplb else {}), **model_overrides(args))
    if nvcc is not None:
        nvcc.join()
    if args.dummy_routing == "balanced":        # before any graph is captured (they keep the picks)
        from deepinfer.model.balanced_routing import install
        install(model, *((parallel.rank, parallel.world_size) if parallel is not None else ()))
    model_args = model.args
    lockstep = None
    if parallel is None or not parallel.is_parallel:
        sizes = graph_sizes(args, model_args, device)
    else:       # every rank replays the same captured size in a step (parallel/lockstep.py)
        from deepinfer.parallel.lockstep import GraphLockstep, HostAgreement, rank_graph_sizes
        sizes = rank_graph_sizes(args, model_args, device, parallel.world_size) if parallel.host_agreement else ()
        if sizes and (parallel.placement is not None or parallel.engram_sharded):    # collectives in a step
            lockstep = GraphLockstep(parallel, HostAgreement(parallel.host_agreement, parallel.rank,
                                                             parallel.world_size, GraphLockstep.FIELDS))
    num_blocks = args.num_cache_blocks
    if num_blocks is None:
        if device.startswith("cuda"):
            num_blocks = _blocks_from_memory(model_args, args, cache_bytes_per_block)
        else:
            num_blocks = args.max_num_seqs * cdiv(min(facts.max_position, CPU_DEFAULT_CACHE_TOKENS_PER_SEQ),
                                                  args.block_tokens)
    max_model_len = min(args.max_model_len or facts.max_position, facts.max_position, num_blocks * args.block_tokens)
    # overlapped verify steps (spec/overlap.py) run the static step form: padding writes need scratch rows
    # (with prefix caching too: steps with a row under bounded replay resolve first, spec/overlap.py);
    # on rank workers each rank's from its own launched step (DataParallelScheduler.schedule_overlapped)
    # speculation pipelines like plain decoding: async on CUDA unless turned off (H200, 2026-12-02,
    # full-width-ep8: overlapped verify steps 1.43-1.79x the synchronous engine's tok/s at batch 1-64)
    spec_async = args.async_scheduling is True or (args.async_scheduling is None and device.startswith("cuda"))
    overlap = args.speculative == "dspark" and spec_async and args.spec_async_overlap
    caches = allocate_caches(model_args, args.max_num_seqs, num_blocks, args.block_tokens, device, args.dtype,
                             scratch=bool(sizes) or overlap)
    async_scheduling = args.async_scheduling if args.async_scheduling is not None else device.startswith("cuda")
    proposer = None
    if args.speculative == "dspark":
        from deepinfer.spec.dspark_proposer import DSparkProposer
        proposer = DSparkProposer(model, caches, args.num_speculative_tokens, acceptance=args.spec_acceptance,
                                  replay_accepted_length=args.spec_replay_accepted_length, seed=args.seed,
                                  replay_concentration=args.spec_replay_concentration,
                                  replay_regime_tokens=args.spec_replay_regime_tokens)
        # across data-parallel ranks too: the executor asks every rank about its launched step
        async_scheduling = spec_async
    from deepinfer.worker.model_runner import ModelRunner
    sampler = make_sampler(args.checkpoint, facts.vocab_size)
    runner = ModelRunner(model, caches, device, args.max_num_seqs, max_model_len, args.block_tokens,
                         ngram_width=max(model_args.engram_max_ngram_size - 1, 0), sampler=sampler,
                         batch_invariant=args.batch_invariant, proposer=proposer, graph_sizes=sizes,
                         graph_max_len=args.max_seq_len_to_capture,
                         num_snapshot_slots=num_snapshot_slots(args, model_args),
                         num_host_slots=num_host_slots(args, model_args),
                         yoco_keep_tokens=args.yoco_prefill_keep_tokens,
                         disk_cache_dir=args.disk_cache_dir if disk_blocks else None,
                         packed_verify=args.spec_packed_verify, lockstep=lockstep)
    if overlap:
        from deepinfer.spec.overlap import ring_fits
        if ring_fits(model, caches, args.num_speculative_tokens):
            runner.enable_overlap()
        else:
            logger.warning("spec_async_overlap off: the ring (%d) is shorter than the draft window + drafts + 1",
                           caches.ring_len)
    return RankRuntime(device, model, caches, runner, sampler, num_blocks, max_model_len, sizes, async_scheduling)


def make_sampler(checkpoint: str, vocab_size: int):
    """The Sampler, or None (greedy only) where its dependencies (xgrammar) are missing."""
    try:
        from deepinfer.sample import Sampler
    except ImportError as e:
        logger.warning("deepinfer.sample unavailable (%s): greedy sampling only", e)
        return None
    tokenizer = Path(checkpoint) / "tokenizer.json"
    return Sampler(vocab_size, str(tokenizer) if tokenizer.is_file() else None)


def read_hf_config(checkpoint: str) -> dict:
    path = Path(checkpoint) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _blocks_from_memory(model_args, args: EngineArgs, bytes_per_block) -> int:
    import torch

    from deepinfer.worker.loading import ring_slot_bytes
    free, _ = torch.cuda.mem_get_info()
    budget = int(free * args.cache_memory_fraction) - args.max_num_seqs * ring_slot_bytes(model_args, args.dtype)
    return max(1, budget // bytes_per_block(model_args, args.block_tokens, args.dtype))
