"""The seam between the engine and the model package: dtypes, cache sizes, cache allocation (the weights
are loaded by model/loader.py, called from worker/rank.py)."""

from __future__ import annotations

import logging
from math import prod

import torch

logger = logging.getLogger(__name__)

# dense_weights="auto" holds the dense FP8 linears in bf16 on CUDA while their extra byte per element
# stays within this share of the device's memory (the bytes come out of the KV cache), and spends what is left
# of it on FP8 decode copies (dense_fp8_copies): the release's 40 layers (6.0G dense elements with DSpark's
# blocks) fit it on a 141 GB H200 (5.3 GB left for copies) and just fit an 80 GB H100 (0.4 GB left)
DENSE_BF16_MAX_SHARE = 0.08

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def cache_bytes_per_block(model_args, block_tokens: int, dtype: str) -> int:
    from deepinfer.cache.model_caches import ModelCaches
    return ModelCaches.bytes_per_block(model_args, block_tokens, torch_dtype(dtype))


def ring_slot_bytes(model_args, dtype: str) -> int:
    from deepinfer.cache.model_caches import ModelCaches
    return ModelCaches.bytes_per_ring_slot(model_args, torch_dtype(dtype))


def allocate_caches(model_args, num_ring_slots: int, num_blocks: int, block_tokens: int, device: str, dtype: str,
                    scratch: bool = False):
    from deepinfer.cache.model_caches import ModelCaches
    return ModelCaches.allocate(model_args, num_ring_slots, num_blocks, block_tokens, device, torch_dtype(dtype),
                                scratch=scratch)


def dense_fp8_elements(model_args) -> int:
    """Elements of the dense FP8 linears that dense_weights="bf16" holds dequantized (every "fp8" tensor
    but wo_a, which stays as it is either way; routed experts are "fp4")."""
    from deepinfer.model.loader import expected_tensors
    return sum(prod(shape) for name, (kind, shape) in expected_tensors(model_args).items()
               if kind == "fp8" and not name.endswith("attn.wo_a.weight"))


# expert_format="auto": FP4 stacks where the FP8 ones would take more than this share of the device (the
# release at EP8: 0.5 of an H200; there the KV cache, not the GEMMs, bounds the batch). Below it FP8 stacks:
# the CUDA FP8 x FP8 kernel takes mid-size prefill steps (2,048-token chunks at 40 layers 655 ms against
# 767 on FP4 stacks, whose steps dequantize the stack to bf16; H200, 2026-12-04).
EXPERT_FP4_MIN_SHARE = 0.25


def fp8_expert_bytes(model_args, expert_share: float = 1.0) -> int:
    """Bytes of the routed experts as FP8 stacks (e4m3 + one E8M0 byte per 32 along K); expert_share: the
    part of them this rank holds (EP)."""
    from deepinfer.model.loader import expected_tensors
    return int(expert_share * sum(prod(shape) * 33 // 32 for _, (kind, shape) in expected_tensors(model_args).items()
                                  if kind == "fp4"))


def expert_share(model_args, parallel) -> float:
    """The part of the routed experts one rank holds: its local slots (EP, redundant ones included) over
    the experts, else all of them."""
    if parallel is None or getattr(parallel, "placement", None) is None:
        return 1.0
    return parallel.placement.num_local / max(model_args.n_routed_experts, 1)


def planned_expert_share(model_args, num_gpus: int, num_redundant_experts: int = 0) -> float:
    """expert_share of a plan's rank before any rank exists: the expert slots split evenly over num_gpus."""
    return (model_args.n_routed_experts + num_redundant_experts) / max(num_gpus, 1) \
        / max(model_args.n_routed_experts, 1)


def resolved_expert_format(expert_format: str, device: str, batch_invariant: bool = False, model_args=None,
                           expert_share: float = 1.0, total_memory: int | None = None) -> str:
    """EngineArgs.expert_format on this device: "fp8" / "fp4" as asked (FP4 stacks on CUDA only; a CPU
    keeps FP8 stacks, the same values); "auto": fp4 on CUDA where the FP8 stacks would take more than
    EXPERT_FP4_MIN_SHARE of the device's memory (half of it then goes to the KV cache instead; the same
    decode and whole-prompt prefill speed), unless batch-invariant mode (whose W8A16 tiles are fixed; the
    W4A16 ones follow the step) or the DeepGEMM backend (128-tile FP8 stacks) needs FP8 stacks."""
    from deepinfer.kernels import select
    if not device.startswith("cuda") or expert_format == "fp8":
        return "fp8"
    if batch_invariant or select.GEMM == "deepgemm":      # FP8 stacks only
        if expert_format == "fp4":
            logger.warning("expert_format='fp4' asked with %s: routed experts in FP8 stacks instead (the W4A16 "
                           "tiles follow the step's size; DeepGEMM reads 128-tile FP8 stacks)",
                           "batch_invariant" if batch_invariant else "DEEPINFER_GEMM=deepgemm")
        return "fp8"
    if expert_format == "fp4":
        return "fp4"
    if model_args is None or model_args.expert_dtype != "fp4":
        return "fp8"
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    need = fp8_expert_bytes(model_args, expert_share)
    if need > EXPERT_FP4_MIN_SHARE * total_memory:
        logger.info("expert_format='auto': routed experts in FP4 stacks (FP8 ones would take %.1f GB, over %.0f%% "
                    "of the device's %.0f GB)", need / 1e9, 100 * EXPERT_FP4_MIN_SHARE, total_memory / 1e9)
        return "fp4"
    return "fp8"


def hold_dense_bf16(dense_weights: str, device: str, model_args, total_memory: int | None = None) -> bool:
    """EngineArgs.dense_weights on this device: "bf16" ("bf16+fp8") and "fp8" as asked (bf16 on CUDA only: a CPU
    computes the same values either way); "auto": bf16 on CUDA when the extra byte per dense element is
    at most DENSE_BF16_MAX_SHARE of the device's memory, else fp8, said once in the log."""
    if not device.startswith("cuda") or dense_weights == "fp8":
        return False
    if dense_weights in ("bf16", "bf16+fp8"):
        return True
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    extra = dense_fp8_elements(model_args)
    if extra > DENSE_BF16_MAX_SHARE * total_memory:
        logger.info("dense_weights='auto': dense FP8 linears kept in FP8 (bf16 would take %.1f GB more, over "
                    "%.0f%% of the device's %.0f GB)", extra / 1e9, 100 * DENSE_BF16_MAX_SHARE, total_memory / 1e9)
        return False
    return True


# dense_weights="auto" also keeps the release's FP8 bytes beside the bf16 weights (Linear.fp8_decode) of the
# linears where this GPU model's measured decode table (kernels/fp8_decode_table.json) has the FP8 decode GEMM
# beat the bf16-held path at some decode size up to this many tokens: most time saved a step per copied element
# first, while the bf16 weights' extra byte and the copies stay within DENSE_BF16_MAX_SHARE of the device (the
# release on an H200, by its table of 2026-12-05: wq_b, wo_b, wqkv_a and the shared w1 / w3, DSpark's blocks
# too; on an 80 GB H100 only wqkv_a fits)
DENSE_FP8_COPY_MAX_M = 64


def decode_copy_kinds(model_args, rows_of, budget: int) -> frozenset[str]:
    """The tensor kinds ("layers.N.attn.wq_b.weight") whose FP8 copies pay at decode sizes: rows_of(n, k) gives
    the measured table's rows of a call's shape; a kind pays where a row of at most DENSE_FP8_COPY_MAX_M tokens
    has the decode GEMM WIN_MARGIN faster than the bf16-held path. Taken by microseconds saved a step per
    copied element, while their elements fit `budget`; fused linears (fused_linears.FUSED_GROUPS) are one call:
    copied both or neither."""
    from deepinfer.kernels.cuda_fp8_decode import WIN_MARGIN
    from deepinfer.model.fused_linears import FUSED_GROUPS
    from deepinfer.model.loader import expected_tensors, tensor_kind
    kinds: dict[str, list] = {}                  # kind -> [tensors, elements, (N, K)]
    for name, (kind, shape) in expected_tensors(model_args).items():
        if kind != "fp8" or name.endswith("attn.wo_a.weight"):
            continue
        entry = kinds.setdefault(tensor_kind(name), [0, 0, tuple(shape)])
        entry[0] += 1
        entry[1] += prod(shape)
    calls = []                                   # (kinds, tensors a kind, elements, (N, K) of the call)
    grouped = set()
    for group in FUSED_GROUPS:
        for prefix in {k[:-len(group[0])] for k in kinds if k.endswith(group[0])}:
            members = [prefix + suffix for suffix in group]
            if all(m in kinds for m in members):
                grouped.update(members)
                n = sum(kinds[m][2][0] for m in members)
                calls.append((tuple(members), kinds[members[0]][0], sum(kinds[m][1] for m in members),
                              (n, kinds[members[0]][2][1])))
    calls += [((k,), v[0], v[1], v[2]) for k, v in kinds.items() if k not in grouped]
    scored = []
    for members, count, elements, (n, k) in calls:
        gains = [r["bf16_held_us"] - r["decode_us"] for r in rows_of(n, k)
                 if r["m"] <= DENSE_FP8_COPY_MAX_M and r["bf16_held_us"] >= WIN_MARGIN * r["decode_us"]]
        if gains:
            scored.append((max(gains) * count / elements, members, elements))
    chosen: set[str] = set()
    for _, members, elements in sorted(scored, key=lambda s: -s[0]):
        if elements <= budget:
            chosen.update(members)
            budget -= elements
    return frozenset(chosen)


def fp8_kind_elements(model_args) -> dict[str, int]:
    """Elements of each dense FP8 tensor kind ("layers.N.attn.wq_b.weight": all layers of it together)."""
    from deepinfer.model.loader import expected_tensors, tensor_kind
    out: dict[str, int] = {}
    for name, (kind, shape) in expected_tensors(model_args).items():
        if kind == "fp8":
            out[tensor_kind(name)] = out.get(tensor_kind(name), 0) + prod(shape)
    return out


def wo_a_copies(model_args, budget: int) -> frozenset[str]:
    """The wo_a kinds (the backbone's first, then DSpark's blocks) whose FP8 blocks fit `budget` elements beside
    their bf16 copy: the grouped W8A16 kernel runs decode-sized calls on them (1.06-1.41x the bf16 bmm at 1-64
    tokens, perf/bench_wo_a.py; select.grouped_takes_fp8)."""
    chosen = set()
    for kind, elements in sorted(fp8_kind_elements(model_args).items(), key=lambda kv: not kv[0].startswith("layers.")):
        if kind.endswith("attn.wo_a.weight") and elements <= budget:
            chosen.add(kind)
            budget -= elements
    return frozenset(chosen)


def dense_fp8_copies(dense_weights: str, device: str, model_args, total_memory: int | None = None) -> bool | frozenset:
    """Which bf16-held dense linears keep their FP8 bytes for the decode GEMM (Linear.fp8_decode; wo_a: its FP8
    blocks, Linear.fp8_blocks): True, every one ("bf16+fp8"); False, none ("bf16", "fp8", a CPU, or "auto" where the
    bf16 weights do not fit); "auto": the kinds decode_copy_kinds takes from this GPU model's measured table within
    what DENSE_BF16_MAX_SHARE of the device leaves past the bf16 weights' extra byte (none where no table was
    measured on it), then wo_a's (wo_a_copies) with what is left."""
    if not device.startswith("cuda") or dense_weights in ("fp8", "bf16"):
        return False
    if dense_weights == "bf16+fp8":
        return True
    dev = torch.device(device)
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(dev).total_memory
    if not hold_dense_bf16(dense_weights, device, model_args, total_memory):
        return False
    from deepinfer.kernels.cuda_fp8_decode import measured_rows
    gpu = torch.cuda.get_device_name(dev)
    budget = int(DENSE_BF16_MAX_SHARE * total_memory) - dense_fp8_elements(model_args)
    kinds = decode_copy_kinds(model_args, lambda n, k: measured_rows(n, k, gpu), budget)
    elements = fp8_kind_elements(model_args)
    kinds |= wo_a_copies(model_args, budget - sum(elements[k] for k in kinds))      # wo_a with what is left
    if kinds:
        logger.info("dense_weights='auto': FP8 decode copies kept beside the bf16 weights of %s",
                    ", ".join(sorted({k.split(".N.", 1)[-1].rsplit(".weight", 1)[0] for k in kinds})))
    return kinds
