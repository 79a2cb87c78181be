"""Memory planner (deepinfer-plan): per-rank weight bytes, KV cache capacity, and whether it fits.

The layout it plans (deepinfer/parallel/__init__.py): attention DP + MoE EP over `num_gpus` ranks.
Every rank holds attention, shared experts, embed/head, the DSpark draft blocks (`mtp.*`, experts
included) and the small tensors; the backbone's routed experts are split over the ranks, each
holding (n_routed_experts + num_redundant_experts) / num_gpus physical slots per layer; the two
Engram tables are replicated ("device"), split by rows ("sharded") or kept once per node in host
memory ("host").

Bytes follow the CUDA weight format of `model/loader.py` (`load_model(weight_format="fp8")`): FP8
linears (wo_a included) as e4m3 + one E8M0 byte per 32x32 block, the MXFP4 routed experts
converted at load to FP8 stacks (e4m3 + one E8M0 byte per (row, 32 along K): ~2x their checkpoint
bytes), BF16 / F32 as stored, Engram tables as FP8 rows + scale. Names and shapes come from
`expected_tensors` / `_stored`, cache bytes from `ModelCaches`, so neither is re-derived here.

Per rank, memory is laid out as:

    | weights (replicated + local experts + Engram share) | reserve | ring slots | paged blocks ... |
                                                                     max_num_seqs+1  num_cache_blocks
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer.cache.kv_cache_manager import cdiv
from deepinfer.cache.model_caches import ModelCaches
from deepinfer.model.args import ModelArgs
from deepinfer.model.loader import _stored, expected_tensors
from deepinfer.worker.loading import torch_dtype

GiB = 1 << 30
# Activations and workspace left out of the cache: CUDA context + NCCL communicators (~2 GiB),
# captured CUDA graphs, one step's activations and MoE dispatch buffers (an all-gathered chunk
# over 8 ranks: ~1-4 GiB), allocator slack. A fixed amount: none of it scales with the GPU.
DEFAULT_RESERVE_BYTES = 10 * GiB
ENGRAM_PLACEMENTS = ("device", "sharded", "host")   # most GPU memory first
MAX_GPUS_SEARCHED = 1024                            # for the "needs N GPUs" hint
_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4}
PARTS = ("attention", "shared_experts", "routed_experts", "dspark", "engram", "embed_head", "other")
PART_LABELS = {
    "attention": "attention (incl. compressor, indexer)",
    "shared_experts": "shared experts",
    "routed_experts": "routed experts",
    "dspark": "DSpark draft blocks (mtp.*)",
    "engram": "Engram tables",
    "embed_head": "embed + head",
    "other": "other (norms, mHC, router, Engram proj)",
}


def release_config_dir() -> Path:
    """The folder holding the shipped DeepSeek-V4.1-Flash release config.json (package data)."""
    return Path(__file__).resolve().parents[1] / "configs" / "deepseek-v4.1-flash"


# ---- model bytes (independent of the parallel layout) --------------------------------------------
@dataclass(frozen=True)
class ModelBytes:
    """The whole model's device bytes, by how they spread over ranks."""
    replicated: dict[str, int]        # part -> bytes every rank holds (no routed experts, no Engram)
    routed_expert_bytes: int          # one backbone routed expert slot (w1 + w3 + w2, device format)
    num_moe_layers: int               # backbone layers with routed experts
    engram_rows: tuple[int, ...]      # rows per Engram table
    engram_row_bytes: int             # one row: FP8 values + E8M0 scales
    checkpoint_bytes: int             # the stored checkpoint (expected tensors, checkpoint dtypes)

    @property
    def engram_bytes(self) -> int:
        return sum(self.engram_rows) * self.engram_row_bytes


def _part(name: str) -> str:
    if name.startswith("mtp."):
        return "dspark"                               # replicated, its experts too
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".engram.embed." in name:
        return "engram"
    if ".attn." in name:
        return "attention"
    if name in ("embed.weight", "head.weight"):
        return "embed_head"
    return "other"


def _stored_bytes(kind: str, shape: tuple[int, ...], args: ModelArgs) -> int:
    """Checkpoint bytes of one logical weight (its tensor and `.scale`); 'A|B' dtypes count as A."""
    return sum(math.prod(shp) * _DTYPE_BYTES[dt.split("|")[0]] for _, dt, shp in _stored(kind, shape, args))


def _device_bytes(kind: str, shape: tuple[int, ...], args: ModelArgs, expert_format: str = "fp8") -> int:
    """Bytes of one logical weight as load_model keeps it on CUDA (expert_format "fp4": the routed experts
    as stored, EngineArgs.expert_format)."""
    if kind == "fp4" and args.expert_dtype == "fp4" and expert_format == "fp8":
        n, k = shape                                  # FP8 stacks: e4m3 + E8M0 per (row, 32 along K)
        return n * k + n * cdiv(k, 32)
    return _stored_bytes(kind, shape, args)           # everything else stays as stored


def model_bytes(args: ModelArgs, expert_format: str = "fp8") -> ModelBytes:
    replicated = dict.fromkeys(PARTS, 0)
    routed, checkpoint = 0, 0
    for name, (kind, shape) in expected_tensors(args).items():
        checkpoint += _stored_bytes(kind, shape, args)
        part = _part(name)
        if part == "routed_experts":
            routed += _device_bytes(kind, shape, args, expert_format)
        elif part != "engram":
            replicated[part] += _device_bytes(kind, shape, args, expert_format)
    num_experts = args.n_layers * args.n_routed_experts
    return ModelBytes(replicated, routed // num_experts, args.n_layers, tuple(args.engram_num_embeddings),
                      _stored_bytes("table", (1, args.engram_head_dim), args), checkpoint)


# ---- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanParams:
    """What plan_memory was asked (EngineArgs' parallel and cache knobs)."""
    num_gpus: int
    gpu_memory_bytes: int                 # per GPU
    num_redundant_experts: int = 0        # extra physical expert slots per backbone layer (EPLB)
    engram_placement: str = "sharded"     # "device" | "sharded" | "host"
    max_model_len: int = 65536
    max_num_seqs: int = 64                # per rank: each DP rank runs its own scheduler and cache
    block_tokens: int = 64
    cache_dtype: str = "bfloat16"
    reserve_bytes: int = DEFAULT_RESERVE_BYTES


@dataclass(frozen=True)
class WeightBytes:
    """One rank's weight bytes by part (PARTS)."""
    attention: int
    shared_experts: int
    routed_experts: int
    dspark: int
    engram: int
    embed_head: int
    other: int

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in PARTS)


@dataclass(frozen=True)
class MemoryPlan:
    params: PlanParams
    n_routed_experts: int                 # logical routed experts per backbone layer
    num_moe_layers: int                   # backbone layers whose experts are split
    num_local_experts: int                # physical expert slots per rank per backbone layer
    rank_weights: tuple[WeightBytes, ...]  # one per rank (they differ only by Engram row remainders)
    host_bytes: int                       # node host memory: the Engram tables once, when "host"
    checkpoint_bytes: int                 # the release checkpoint as stored (FP4 experts)
    bytes_per_block: int                  # paged compressed KV + index keys of block_tokens positions
    bytes_per_ring_slot: int              # one sequence's window rings + compressor carry
    free_cache_bytes: int                 # GPU memory - weights - reserve; < 0: weights do not fit
    num_cache_blocks: int                 # paged blocks after max_num_seqs + 1 ring slots (+1: CUDA-graph scratch)
    num_seqs_at_max_len: int              # sequences of max_model_len tokens (blocks + own ring slot)
    fits: bool                            # weights and one max_model_len sequence fit every rank
    problem: str = ""                     # why not, and what would fit; "" when it fits

    @property
    def weights(self) -> WeightBytes:
        """The largest rank's weights: the one that binds."""
        return max(self.rank_weights, key=lambda w: w.total)

    @property
    def max_cache_tokens(self) -> int:
        return self.num_cache_blocks * self.params.block_tokens

    @property
    def blocks_per_seq(self) -> int:
        return cdiv(self.params.max_model_len, self.params.block_tokens)

    def message(self) -> str:
        p = self.params
        head = (f"{p.num_gpus} GPU(s) x {_size(p.gpu_memory_bytes)}, engram_placement={p.engram_placement!r}, "
                f"num_redundant_experts={p.num_redundant_experts}")
        if not self.fits:
            return f"does not fit ({head}): {self.problem}"
        return (f"fits ({head}): {_size(self.weights.total)} of weights per GPU, KV cache for "
                f"{self.max_cache_tokens:,} tokens per GPU = {self.num_seqs_at_max_len} sequence(s) of "
                f"max_model_len={p.max_model_len}")

    def table(self) -> str:
        return "\n".join(_table_lines(self))


class InsufficientMemoryError(ValueError):
    """The weights plus one max_model_len sequence do not fit the GPUs given."""


def check_fits(plan: MemoryPlan) -> MemoryPlan:
    """The engine's start-up check: raise InsufficientMemoryError(plan.message()) unless it fits."""
    if not plan.fits:
        raise InsufficientMemoryError(plan.message())
    return plan


def plan_memory(model_args: ModelArgs, *, num_gpus: int, gpu_memory_bytes: int, num_redundant_experts: int = 0,
                engram_placement: str = "sharded", max_model_len: int = 65536, max_num_seqs: int = 64,
                block_tokens: int = 64, cache_dtype: str = "bfloat16",
                reserve_bytes: int = DEFAULT_RESERVE_BYTES, expert_format: str = "fp8") -> MemoryPlan:
    """Per-rank bytes of attention DP + MoE EP over `num_gpus` GPUs of `gpu_memory_bytes` each.
    Raises ValueError on inputs no plan can have (naming the number); a plan that does not fit is
    returned with fits=False and `problem` saying by how much and what would fit."""
    p = PlanParams(num_gpus, gpu_memory_bytes, num_redundant_experts, engram_placement, max_model_len,
                   max_num_seqs, block_tokens, cache_dtype, reserve_bytes)
    validate_params(model_args, p)
    mb = model_bytes(model_args, expert_format)
    plan = _plan(mb, model_args, p)
    if not plan.fits:
        plan = replace(plan, problem=_problem(mb, model_args, plan))
    return plan


def validate_params(args: ModelArgs, p: PlanParams) -> None:
    for name in ("num_gpus", "gpu_memory_bytes", "max_model_len", "max_num_seqs", "block_tokens"):
        if getattr(p, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(p, name)}")
    for name in ("num_redundant_experts", "reserve_bytes"):
        if getattr(p, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(p, name)}")
    if p.engram_placement not in ENGRAM_PLACEMENTS:
        raise ValueError(f"engram_placement must be one of {ENGRAM_PLACEMENTS}, got {p.engram_placement!r}")
    torch_dtype(p.cache_dtype)
    num_slots = args.n_routed_experts + p.num_redundant_experts
    if num_slots % p.num_gpus:
        up = p.num_redundant_experts + (-num_slots) % p.num_gpus
        raise ValueError(f"n_routed_experts ({args.n_routed_experts}) + num_redundant_experts "
                         f"({p.num_redundant_experts}) = {num_slots} expert slots per layer do not split evenly "
                         f"over num_gpus={p.num_gpus}: use num_redundant_experts={up}, or a num_gpus that "
                         f"divides {num_slots}")
    for s in args.kv_source_layers:
        if p.block_tokens % args.compress_ratios[s]:
            raise ValueError(f"block_tokens={p.block_tokens} is not a multiple of layer {s}'s compress ratio "
                             f"{args.compress_ratios[s]}")


def engram_rows_of_rank(num_rows: int, num_gpus: int, rank: int) -> int:
    """Rows of one table that rank `rank` holds when sharded: an even split, the remainder on the
    first ranks (so rank 0 holds the most)."""
    return num_rows // num_gpus + (rank < num_rows % num_gpus)


def _rank_weights(mb: ModelBytes, p: PlanParams, num_local_experts: int, rank: int) -> WeightBytes:
    parts = dict(mb.replicated)
    parts["routed_experts"] = mb.num_moe_layers * num_local_experts * mb.routed_expert_bytes
    if p.engram_placement == "device":
        parts["engram"] = mb.engram_bytes
    elif p.engram_placement == "sharded":
        rows = sum(engram_rows_of_rank(n, p.num_gpus, rank) for n in mb.engram_rows)
        parts["engram"] = rows * mb.engram_row_bytes
    else:
        parts["engram"] = 0                            # "host": read from pinned host memory
    return WeightBytes(**parts)


def _plan(mb: ModelBytes, args: ModelArgs, p: PlanParams) -> MemoryPlan:
    num_local = (args.n_routed_experts + p.num_redundant_experts) // p.num_gpus
    ranks = tuple(_rank_weights(mb, p, num_local, r) for r in range(p.num_gpus))
    dtype = torch_dtype(p.cache_dtype)
    bpb = ModelCaches.bytes_per_block(args, p.block_tokens, dtype)
    ring = ModelCaches.bytes_per_ring_slot(args, dtype)
    free = p.gpu_memory_bytes - max(w.total for w in ranks) - p.reserve_bytes
    # as the engine allocates: max_num_seqs ring slots + one scratch slot and block (CUDA graphs)
    num_blocks = max(0, (free - (p.max_num_seqs + 1) * ring) // bpb - 1)
    blocks_per_seq = cdiv(p.max_model_len, p.block_tokens)
    num_seqs = max(0, free // (blocks_per_seq * bpb + ring))
    return MemoryPlan(
        params=p, n_routed_experts=args.n_routed_experts, num_moe_layers=mb.num_moe_layers,
        num_local_experts=num_local, rank_weights=ranks,
        host_bytes=mb.engram_bytes if p.engram_placement == "host" else 0,
        checkpoint_bytes=mb.checkpoint_bytes, bytes_per_block=bpb, bytes_per_ring_slot=ring,
        free_cache_bytes=free, num_cache_blocks=num_blocks, num_seqs_at_max_len=num_seqs,
        fits=free >= 0 and num_blocks >= blocks_per_seq)


# ---- why it does not fit, and what would -----------------------------------------------------------
def _problem(mb: ModelBytes, args: ModelArgs, plan: MemoryPlan) -> str:
    p = plan.params
    if plan.free_cache_bytes < 0:
        what = (f"the weights need {_size(plan.weights.total)} per GPU + a {_size(p.reserve_bytes)} reserve, "
                f"but a GPU has {_size(p.gpu_memory_bytes)}: {_size(-plan.free_cache_bytes)} short")
    else:
        need = (p.max_num_seqs + 1) * plan.bytes_per_ring_slot + (plan.blocks_per_seq + 1) * plan.bytes_per_block
        what = (f"the weights fit, but the {_size(plan.free_cache_bytes)} left for the KV cache holds "
                f"{plan.max_cache_tokens:,} tokens, less than one sequence of max_model_len={p.max_model_len} "
                f"({_size(need)} with max_num_seqs={p.max_num_seqs} ring slots)")
    hints = _hints(mb, args, plan)
    if not hints:
        return what + "; no GPU count or Engram placement makes it fit"
    return what + "; " + ", or ".join(hints)


def _fits(mb: ModelBytes, args: ModelArgs, p: PlanParams) -> bool:
    return (args.n_routed_experts + p.num_redundant_experts) % p.num_gpus == 0 and _plan(mb, args, p).fits


def _min_gpus(mb: ModelBytes, args: ModelArgs, p: PlanParams) -> int | None:
    """The fewest GPUs above p.num_gpus that fit (counts that split the expert slots evenly)."""
    num_slots = args.n_routed_experts + p.num_redundant_experts
    for g in range(p.num_gpus + 1, min(num_slots, MAX_GPUS_SEARCHED) + 1):
        if num_slots % g == 0 and _fits(mb, args, replace(p, num_gpus=g)):
            return g
    return None


def _hints(mb: ModelBytes, args: ModelArgs, plan: MemoryPlan) -> list[str]:
    p = plan.params
    hints = []
    g = _min_gpus(mb, args, p)
    if g:
        hints.append(f"needs {g} GPUs")
    for q in ENGRAM_PLACEMENTS[ENGRAM_PLACEMENTS.index(p.engram_placement) + 1:]:
        pq = replace(p, engram_placement=q)
        if _fits(mb, args, pq):
            hints.append(f"fits with engram_placement={q!r}")
        elif (gq := _min_gpus(mb, args, pq)) and (g is None or gq < g):
            hints.append(f"fits with engram_placement={q!r} on {gq} GPUs")
    if p.num_redundant_experts and _fits(mb, args, replace(p, num_redundant_experts=0)):
        hints.append("fits with num_redundant_experts=0")
    if plan.free_cache_bytes >= 0 and plan.max_cache_tokens > 0:
        hints.append(f"fits with max_model_len={plan.max_cache_tokens}")
    return hints


# ---- the table -------------------------------------------------------------------------------------
def _size(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB / KiB below (tiny test models)."""
    if n == 0:
        return "0 B"
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.1f} {unit}"


def _row(label: str, per_gpu: str, all_gpus: str = "") -> str:
    return f"  {label:<46}{per_gpu:>12}{all_gpus:>12}".rstrip()


def _part_label(plan: MemoryPlan, part: str) -> str:
    p = plan.params
    if part == "routed_experts":
        return (f"routed experts ({plan.num_local_experts} of {plan.n_routed_experts}"
                f"{f'+{p.num_redundant_experts}' if p.num_redundant_experts else ''} x {plan.num_moe_layers} layers)")
    if part == "engram":
        share = {"device": "replicated", "sharded": f"1/{p.num_gpus} of the rows", "host": "in host memory"}
        return f"Engram tables ({share[p.engram_placement]})"
    return PART_LABELS[part]


def _table_lines(plan: MemoryPlan) -> list[str]:
    p, w = plan.params, plan.weights
    lines = [f"memory plan: {p.num_gpus} GPU(s) x {_size(p.gpu_memory_bytes)} ({p.gpu_memory_bytes:,} B), "
             f"engram_placement={p.engram_placement!r}, num_redundant_experts={p.num_redundant_experts}",
             _row("weights (the largest rank)", "per GPU", "all GPUs")]
    for part in PARTS:
        lines.append(_row(_part_label(plan, part), _size(getattr(w, part)),
                          _size(sum(getattr(r, part) for r in plan.rank_weights))))
    lines += [_row("total weights", _size(w.total), _size(sum(r.total for r in plan.rank_weights))),
              _row("reserve (activations, workspace)", _size(p.reserve_bytes)),
              _row("left for the KV cache", _size(plan.free_cache_bytes)),
              f"KV cache per GPU ({p.cache_dtype}, {p.block_tokens}-token blocks of "
              f"{plan.bytes_per_block / 1024:.0f} KiB, ring slot {plan.bytes_per_ring_slot / 2**20:.1f} MiB)",
              _row(f"ring slots (max_num_seqs={p.max_num_seqs} + 1)",
                   _size((p.max_num_seqs + 1) * plan.bytes_per_ring_slot)),
              _row("paged blocks", f"{plan.num_cache_blocks:,}"),
              _row("tokens in paged blocks", f"{plan.max_cache_tokens:,}"),
              _row(f"sequences of max_model_len={p.max_model_len}", f"{plan.num_seqs_at_max_len:,}"),
              "per node",
              _row("host memory (Engram tables)", _size(plan.host_bytes)),
              *([_row("  as /dev/shm files (rank workers: --shm-size)", _size(plan.host_bytes))]
                if plan.host_bytes and p.num_gpus > 1 else []),
              _row("checkpoint as stored (for reference)", _size(plan.checkpoint_bytes)),
              ("fits" if plan.fits else f"DOES NOT FIT: {plan.problem}")]
    return lines
