"""Per-call dispatch: the Triton fast path for CUDA tensors on a capable GPU, the torch reference
otherwise. Same names and contracts as the references; deepinfer/model/ops.py binds these names, so on a CPU
every call lands on the torch reference.

Knobs (environment, read once):
    DEEPINFER_KERNELS=fast       the Triton fast paths on CUDA (default; CPU tensors always take the
                                 references). The whole model with every op bound passes both shared
                                 fixtures' rules, hidden states included, on the H200 (2026-11-30,
                                 tests/kernels/test_model_fast_path.py)
    DEEPINFER_KERNELS=ref        the torch references everywhere (what the fast paths are tested against)
    DEEPINFER_BATCH_INVARIANT=1  fixed-split configs in the GEMMs (attention and mHC are batch
                                 invariant by construction: their splits depend on L / d only)
    DEEPINFER_GEMM=triton        the FP8 linears and the masked MoE GEMMs on our exact Triton kernels
                                 (default)
    DEEPINFER_GEMM=deepgemm      the same GEMMs through DeepGEMM on 128x128-tile weights and per-(row,
                                 128) activation scales (near-exact, kernels/deepgemm.py) where it can
                                 run: the fast path on for the tensor, an SM90 GPU, DeepGEMM importable,
                                 not batch-invariant mode, N and K multiples of 128; else the path above.
                                 load_model converts the weights once (deepgemm.prepare_deepgemm)
    DEEPINFER_PREFILL_GEMM=auto  (default) an FP8 linear takes an FP8 x FP8 variant (triton_fp8_variants)
                                 only where the measured table (DEEPINFER_FP8_TABLE, else
                                 kernels/fp8_select_table.json; written by perf/bench_fp8_prefill.py
                                 --variants) says it beat W8A16 at that (N, K) and M; else W8A16. No
                                 table: W8A16 everywhere
    DEEPINFER_PREFILL_GEMM=w8a16 W8A16 everywhere, whatever the table says
    DEEPINFER_PREFILL_GEMM=<variant>  that FP8 x FP8 variant (e.g. lag_blocks) for every FP8 linear of >=
                                 DEEPINFER_FP8_VARIANT_MIN_M rows (32), and the MoE's large steps in the
                                 grouped contiguous form on it
    DEEPINFER_PREFILL_GEMM=cuda  FP8 linears of >= DEEPINFER_FP8_VARIANT_MIN_M rows (32) with 32x32-block,
                                 per-(row, 32) or per-row weight scales on the warp-specialized CUDA kernel
                                 (cuda_fp8_gemm: SM90, nvcc; the promotion of one K=32 slice overlapped with
                                 the next slice's wgmma; split-K at decode sizes), and the MoE's grouped
                                 contiguous form on it (the row-scaled expert stacks included); a call it
                                 declines takes the W8A16 path (logged once). auto takes the CUDA kernel
                                 for dense linears of >= CUDA_AUTO_MIN_M rows with 32x32-block scales (from
                                 CUDA_AUTO_WIDE_MIN_M rows where its tiles cover 3/4 of the SMs) and
                                 for the MoE's grouped contiguous steps with block or per-row scales
                                 (per-(row, 32) scales measured slower than W8A16)
    DEEPINFER_PREFILL_GEMM=bf16  every dense FP8 linear of a CUDA call (outside graph capture) dequantizes its
                                 weight exactly to bf16 (triton_dequant: e4m3 times a power of two fits bf16)
                                 and runs act_quant + cuBLAS's bf16 GEMM: the release GEMM's products summed
                                 in fp32, at cuBLAS's rate. auto takes it from DEEPINFER_BF16_AUTO_MIN_M rows
                                 (256; 0: never), ahead of the CUDA kernel; wo_a's grouped GEMM too
    DEEPINFER_PREFILL_GEMM=fp8   FP8 linears of >= DEEPINFER_FP8_PREFILL_MIN_M rows (512) with K % 128 == 0
                                 on the first FP8 x FP8 per-32-promotion kernel (triton_fp8_prefill), and
                                 the MoE's large steps in the grouped contiguous form on it
    DEEPINFER_FP8_DECODE_MAX_M   FP8 linears of at most this many rows (default 0: only where the measured
                                 table kernels/fp8_decode_table.json says it won at that M) on the CUDA FP8 x FP8
                                 decode GEMM (cuda_fp8_decode: weight rows on the MMA's M side, tokens on N,
                                 split-K), ahead of every path above but DeepGEMM: the release bytes read
                                 once, E8M0 scales per 32x32 block or per (row, 32); and the FP8 copy a
                                 bf16-held Linear keeps for such calls (EngineArgs.dense_weights="bf16+fp8")
    DEEPINFER_MOE_CONTIGUOUS=1   MoE steps past the masked form (prefill) in the grouped contiguous form
                                 on the W8A16 kernel (triton_moe_contiguous; default: MOE_CONTIGUOUS_DEFAULT)
    DEEPINFER_W4A8=1             FP4 stacks' masked MoE (decode) on W4A8 (triton_w4a8: FP8 slabs x the packed
                                 bytes decoded to e4m3) where its decline reason is None, else W4A16 (default 0)
    Shape rules: a fast path whose rules a call breaks takes the next path (the torch reference) and
    logs one line per (op, rule) (_fast_for; declined() lists them), so any valid config runs.
    DEEPINFER_FAST_OFF=a,b       these ops (_fast_for's names: compress_pool, index_topk, ...) take their next
                                 path: a benchmark's A/B of one kernel against what it replaced
    TRITON_INTERPRET=1           with DEEPINFER_KERNELS=fast set explicitly, CPU tensors take the fast paths too,
                                 through Triton's interpreter (tests/kernels/fast_model_smoke.py: the
                                 whole model's dispatch and shapes checked on a CPU, slowly)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import weakref

import numpy as np
import torch

from . import deepgemm as _dg
from . import batch_invariant as _bi
from .measured_table import rows_by_shape
from . import reference as _ref
from .grouped_rows import GroupedRows, counts_of  # noqa: F401  (GroupedRows: in the annotations)

KERNELS = os.environ.get("DEEPINFER_KERNELS", "fast")
if KERNELS not in ("ref", "fast"):
    raise ValueError(f"DEEPINFER_KERNELS must be 'ref' or 'fast', got {KERNELS!r}")
BATCH_INVARIANT = os.environ.get("DEEPINFER_BATCH_INVARIANT", "0") == "1"
GEMM = os.environ.get("DEEPINFER_GEMM", "triton")
if GEMM not in ("triton", "deepgemm"):
    raise ValueError(f"DEEPINFER_GEMM must be 'triton' or 'deepgemm', got {GEMM!r}")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# ops (_fast_for's names) that take their next path anyway: DEEPINFER_FAST_OFF=compress_pool,index_topk
FAST_OFF = frozenset(k for k in os.environ.get("DEEPINFER_FAST_OFF", "").split(",") if k)
# DEEPINFER_PREFILL_GEMM=fp8: FP8 linears of at least FP8_PREFILL_MIN_M rows (and the MoE's grouped
# contiguous form) on the FP8 x FP8 per-32-promotion kernels (triton_fp8_prefill). Opt-in: on the H200
# (2026-12-02, perf/bench_fp8_prefill.py, M 8192) that Triton kernel ran 72-74 TFLOP/s (the BK 32 walk of
# triton_gemm.fp8_gemm 150-159) against W8A16's 292-325: a wgmma wait per 32 K and the promotion FMAs
# on the CUDA cores cap it, so the default keeps W8A16 (the per-expert loop for large MoE steps).
# The variants of triton_fp8_variants.VARIANTS (named here so that this module imports no Triton; a test
# checks the two lists agree): per-slice promotion with [BM, BN/32] scales (one FFMA per element), the next
# slice's wgmma in flight during the promotion (lag), TMA loads, other tiles.
FP8_VARIANTS = ("seq", "blocks", "blocks_bm64", "blocks_bn256", "lag_blocks", "lag_blocks_bm64", "lag2_blocks_bn64", "tma_blocks",
                "tma_lag_blocks")
PREFILL_GEMM = os.environ.get("DEEPINFER_PREFILL_GEMM", "auto")
if PREFILL_GEMM not in ("auto", "fp8", "w8a16", "cuda", "bf16") + FP8_VARIANTS:
    raise ValueError(f"DEEPINFER_PREFILL_GEMM must be auto, w8a16, fp8, cuda, bf16 or one of {FP8_VARIANTS}, "
                     f"got {PREFILL_GEMM!r}")
# auto: dense FP8 linears of at least this many rows dequantize the weight to bf16 (exact) and run
# cuBLAS's bf16 GEMM (kernels/triton_dequant.py says why that is the release's arithmetic); 0: never
BF16_AUTO_MIN_M = int(os.environ.get("DEEPINFER_BF16_AUTO_MIN_M", "256"))
# forced up to this many rows (0 by default: only where cuda_fp8_decode's measured table says the kernel
# won at that M; perf/H200_NOTES.md "2026-12-04 (afternoon)")
FP8_DECODE_MAX_M = int(os.environ.get("DEEPINFER_FP8_DECODE_MAX_M", "0"))
# the masked MoE (decode) on the CUDA FP8 x FP8 form over the row-scaled FP8 stacks
# (cuda_fp8_decode.fp8_masked_moe_gemm; FP8 dispatch and SwiGLU outputs) instead of W8A16: "1" on, "0" off
MOE_FP8_DECODE = os.environ.get("DEEPINFER_MOE_FP8_DECODE", "1")
# auto: the MoE's grouped contiguous GEMMs of at least this many token-expert rows dequantize the whole
# expert stack to bf16 (exact, as the dense linears) and run one bf16 grouped GEMM (torch._grouped_mm)
# instead of the CUDA FP8 x FP8 kernel; the dequant (3 bytes of traffic per stack element) pays only on
# long steps. 0: never. perf/bench_moe_forms.py --prefill measures the two side by side: with the dequant
# at 0.91 of copy (H200, 2026-12-03, afternoon) bf16 / FP8 speed 0.91x at 12,288 rows, 1.01x at 18,432,
# 1.09x at 24,576, 1.15x at 49,152
BF16_MOE_MIN_ROWS = int(os.environ.get("DEEPINFER_BF16_MOE_MIN_ROWS", "16384"))
# FP4 stacks: grouped contiguous steps of at most this many token-expert rows an expert (on average) read the
# packed bytes in the GEMM's K loop (triton_fp4_contiguous.w4a16_grouped_contiguous); longer ones dequantize
# the whole stack to bf16 first, where the bf16 grouped GEMM's speed pays for the dequant pass (its cost is
# per expert, the GEMMs' per row). H100, 2026-12-06 (perf/bench_fp4_prefill.py, 48 experts): W4A16 4.0-4.1x
# the dequant path at 64 rows an expert, 1.70-1.75x at 256 (a 2,048-token chunk), 0.92-0.93x at 1,024 (1 x
# 8k); whole chunked prefill 822.1 -> 653.8-726.5 ms. 0: always dequantize
FP4_W4A16_MAX_ROWS_PER_EXPERT = int(os.environ.get("DEEPINFER_FP4_W4A16_MAX_ROWS_PER_EXPERT", "640"))
# FP4 stacks' masked MoE (decode) on W4A8 (triton_w4a8: FP8 activation slabs x the packed bytes decoded to e4m3 in
# the K loop) instead of W4A16, where triton_w4a8.w4a8_decline_reason takes both stacks: "1" on, "0" off (default;
# not measured on a GPU yet)
W4A8 = os.environ.get("DEEPINFER_W4A8", "0")
FP8_PREFILL_MIN_M = int(os.environ.get("DEEPINFER_FP8_PREFILL_MIN_M", "512"))
FP8_VARIANT_MIN_M = int(os.environ.get("DEEPINFER_FP8_VARIANT_MIN_M", "32"))
# auto: the CUDA FP8 x FP8 kernel takes dense FP8 linears from this many rows (H200, 2026-12-02,
# bench_fp8_prefill.py --cuda: 1.12-1.25x W8A16 on the six release linears at M = 8,192; 0.2-1.05x at
# M <= 128, where it has no split-K; M in between not measured yet)
CUDA_AUTO_MIN_M = int(os.environ.get("DEEPINFER_CUDA_AUTO_MIN_M", "4096"))
# auto also takes the CUDA kernel from this many rows where the 128 x 128 output tiles cover at least
# 3/4 of the SMs (DEEPINFER_CUDA_AUTO_WIDE_MIN_M; empty or 0: off). Per linear it pays (H200,
# 2026-12-02, M 256 / 512 / 1024: 1.08-1.63x W8A16 wherever that holds; where it does not, W8A16 won 5
# of 7 points, e.g. wqkv_a at M 512: 0.83x). Whole prefill, same-run A/B (H200, 2026-12-03,
# bench_model_prefill.py --cases chunked 1x8192 --iters 2, pinned host copies): chunked (2,048-token
# chunks) 196.2 ms with it against 208.3 without, 1 x 8192 192.5 / 194.3. (The 264 ms of an earlier
# run was not the rule: with blocking host copies both sides were slower, 243 / 216.)
_WIDE = os.environ.get("DEEPINFER_CUDA_AUTO_WIDE_MIN_M", "256")
CUDA_AUTO_WIDE_MIN_M = int(_WIDE) if _WIDE and int(_WIDE) > 0 else None
# sparse attention of at least SPARSE_PREFILL_MIN_ROWS queries on FlashMLA's sparse prefill kernel
# (DEEPINFER_SPARSE_PREFILL=flashmla) or on ours (triton)
SPARSE_PREFILL = os.environ.get("DEEPINFER_SPARSE_PREFILL", "flashmla")
if SPARSE_PREFILL not in ("flashmla", "triton"):
    raise ValueError(f"DEEPINFER_SPARSE_PREFILL must be flashmla or triton, got {SPARSE_PREFILL!r}")
SPARSE_PREFILL_MIN_ROWS = int(os.environ.get("DEEPINFER_SPARSE_PREFILL_MIN_ROWS", "256"))
# a tuple of kv pieces is concatenated for FlashMLA: only where that copy is small next to the attention
# (a window ring beside a prefill chunk), not a whole compressed pool handed over for a few hundred queries
SPARSE_PREFILL_CONCAT_SLACK = 1 << 16
FP8_TABLE_PATH = os.environ.get("DEEPINFER_FP8_TABLE", os.path.join(os.path.dirname(__file__), "fp8_select_table.json"))
# bf16-held dense linears at decode sizes: where the Triton skinny kernel beat cuBLAS (measured per (N, K, M);
# written by perf/bench_skinny_bf16.py --write-table); "" = cuBLAS everywhere
SKINNY_TABLE_PATH = os.environ.get("DEEPINFER_SKINNY_TABLE",
                                   os.path.join(os.path.dirname(__file__), "skinny_bf16_table.json"))

log = logging.getLogger(__name__)
_DECLINED: set[tuple[str, str]] = set()


def declined() -> set[tuple[str, str]]:
    """(op, rule) of every fast path that declined a shape in this process (tests, benchmarks)."""
    return set(_DECLINED)


def _fast_for(t: torch.Tensor, op: str, ok: bool, rule: str, then: str = "the torch reference") -> bool:
    """use_fast(t) and the op's shape rules hold. Where the fast path is on but the shape breaks its
    rules, the call takes the next path (the torch reference) and says so once per (op, rule). An op named
    in FAST_OFF always takes the next path (benchmarks' A/B of one kernel against what it replaced)."""
    if not use_fast(t) or op in FAST_OFF:
        return False
    if not ok and (op, rule) not in _DECLINED:
        _DECLINED.add((op, rule))
        log.warning("kernels: %s declines the fast path (needs %s); using %s", op, rule, then)
    return ok


@functools.lru_cache(maxsize=None)
def _fast_ok(device_index: int) -> bool:
    """Triton importable and an NVIDIA GPU of compute capability >= 8.9 (FP8 tensor cores)."""
    if KERNELS != "fast":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _batch_invariant() -> bool:
    """DEEPINFER_BATCH_INVARIANT=1, or inside batch_invariant_mode() (EngineArgs.batch_invariant)."""
    return BATCH_INVARIANT or _bi.active()


def use_fast(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return INTERPRET and KERNELS == "fast" and os.environ.get("DEEPINFER_KERNELS") == "fast"
    return _fast_ok(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _deepgemm_ok(device_index: int) -> bool:
    """An SM90 GPU (DeepGEMM's fp32-scale 1D2D kernels) and DeepGEMM importable."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    return _dg.load() is not None


def deepgemm_usable(t: torch.Tensor) -> bool:
    """DeepGEMM can run the GEMMs of CUDA tensor t (whatever DEEPINFER_GEMM says): the fast paths on
    for it, an SM90 GPU, DeepGEMM importable, and not batch-invariant mode (DeepGEMM picks its tiles
    by M). Host-side checks only."""
    if not t.is_cuda or _batch_invariant() or not use_fast(t):
        return False
    return _deepgemm_ok(t.device.index if t.device.index is not None else torch.cuda.current_device())


def deepgemm_active(t: torch.Tensor) -> bool:
    """DEEPINFER_GEMM=deepgemm and DeepGEMM can run for t."""
    return GEMM == "deepgemm" and deepgemm_usable(t)


def capability_report() -> dict:
    """What each op resolves to on this machine (for logs and the benchmarks)."""
    from . import deepgemm, flashmla
    cuda = torch.cuda.is_available()
    fast = cuda and _fast_ok(torch.cuda.current_device())
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": torch.cuda.get_device_capability() if cuda else None,
        "triton_fast_path": fast,
        "deep_gemm": deepgemm.load() is not None if cuda else False,
        "flash_mla": flashmla.load() is not None if cuda else False,
        "batch_invariant": BATCH_INVARIANT,
    }


def act_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    if _fast_for(x, "act_quant", x.shape[-1] % block == 0, "the last dim a multiple of the block"):
        from .triton_quant import act_quant as fast
        return fast(x, block)
    return _ref.act_quant_ref(x, block)


def fp4_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    if _fast_for(x, "fp4_quant", block in (16, 32) and x.shape[-1] % block == 0,
                 "block 16 or 32 dividing the last dim"):
        from .triton_quant import fp4_quant as fast
        return fast(x, block)
    return _ref.fp4_quant_ref(x, block)


def sparse_attn(q, kv, sink, idxs, scale, block: int = 64, unrope: torch.Tensor | None = None):
    """kv [M, D], or a tuple of up to three such tensors that idxs counts across in order (read in
    place by the Triton kernel; the reference concatenates them). Prefill-sized calls take FlashMLA's
    sparse prefill kernel where it runs (_flashmla_prefill_ok). unrope: cis [n, rd/2]: the output's rope
    dims rotated back (rope(out, cis, inverse=True)), in the Triton kernel's store where it runs."""
    if _flashmla_prefill_ok(q, kv, block):
        from .flashmla import sparse_prefill
        return _unrope(sparse_prefill(q, kv, sink, idxs, scale), unrope)
    if _fast_for(q, "sparse_attn", sparse_attn_shape_ok(q, block),
                 "block 64, a power-of-two head_dim >= 16, heads < 16 or a multiple of min(64, heads)"):
        from .triton_sparse_attn import DEFAULT_BLOCKS_PER_SPLIT, sparse_attn as fast, unrope_ok
        # batch-invariant mode: splits from the list length only; else sized to the batch's occupancy
        bps = DEFAULT_BLOCKS_PER_SPLIT if _batch_invariant() else None
        if unrope is not None and not unrope_ok(q, unrope):
            return _unrope(fast(q, kv, sink, idxs, scale, blocks_per_split=bps), unrope)
        return fast(q, kv, sink, idxs, scale, blocks_per_split=bps, unrope=unrope)
    if isinstance(kv, (tuple, list)):
        kv = torch.cat([t.to(q.dtype) for t in kv])
    return _unrope(_ref.sparse_attn_ref(q, kv, sink, idxs, scale, block), unrope)


def _unrope(out: torch.Tensor, cis: torch.Tensor | None) -> torch.Tensor:
    return out if cis is None else rope(out, cis, inverse=True, inplace=True)


def _flashmla_prefill_ok(q, kv, block: int = 64) -> bool:
    """FlashMLA's SM90 sparse prefill takes this call: DEEPINFER_SPARSE_PREFILL=flashmla (the default), at
    least SPARSE_PREFILL_MIN_ROWS queries, a CUDA bf16 q with 64 or 128 heads of 512 and bf16 kv (None: the
    caller has not built it yet), block 64, not batch-invariant mode (its splits are its own), not inside a
    graph capture (decode steps keep the Triton kernel: one path for every captured size), FlashMLA
    importable on an SM90 GPU. It reads one kv tensor: a tuple is concatenated, so one of more than
    4 rows per query + SPARSE_PREFILL_CONCAT_SLACK (a whole pool) declines; the attention layer gathers the
    rows for it (sparse_prefill_gathers)."""
    if SPARSE_PREFILL != "flashmla" or block != 64 or not q.is_cuda or q.dtype != torch.bfloat16 \
            or q.shape[0] < SPARSE_PREFILL_MIN_ROWS or _batch_invariant() or not use_fast(q) \
            or torch.cuda.is_current_stream_capturing():
        return False
    if isinstance(kv, (tuple, list)) and sum(t.shape[0] for t in kv) > 4 * q.shape[0] + SPARSE_PREFILL_CONCAT_SLACK:
        return False
    from . import flashmla
    srcs = () if kv is None else kv if isinstance(kv, (tuple, list)) else (kv,)
    ok = q.shape[1] in flashmla.SPARSE_PREFILL_HEADS and q.shape[2] == 512 \
        and all(t.dtype == torch.bfloat16 for t in srcs) and _flashmla_ok(q.device.index or 0)
    return _fast_for(q, "sparse_prefill_flashmla", ok,
                     "64 or 128 heads of 512, bf16 kv, FlashMLA importable on SM90", then="the Triton kernel")


def sparse_prefill_gathers(q) -> bool:
    """The attention layer should gather this call's kv rows into one tensor (FlashMLA's sparse prefill
    reads one) rather than hand over the pools in place."""
    return _flashmla_prefill_ok(q, None)


@functools.lru_cache(maxsize=None)
def _flashmla_ok(device_index: int) -> bool:
    from . import flashmla
    mod = flashmla.load()
    return mod is not None and hasattr(mod, "flash_mla_sparse_fwd") \
        and torch.cuda.get_device_capability(device_index) == (9, 0)


def sparse_attn_shape_ok(q: torch.Tensor, block: int = 64) -> bool:
    """The Triton kernel's rules: q [n, H, D] with D a power of two (its tl.arange) of at least 16 (the
    MMA), heads padded to 16 below 16, else tiled by min(64, H)."""
    H, D = q.shape[-2:]
    return block == 64 and D >= 16 and D & (D - 1) == 0 and (H < 16 or H % min(64, H) == 0)


def sparse_attn_in_place(q) -> bool:
    """sparse_attn reads a tuple of kv tensors in place (no concatenation): the Triton path."""
    return use_fast(q) and sparse_attn_shape_ok(q)


def hc_split_sinkhorn(mixes, scale, base, hc, iters, eps):
    if _fast_for(mixes, "hc_split_sinkhorn", hc == 4, "hc_mult 4"):
        from .triton_mhc import hc_split_sinkhorn as fast
        return fast(mixes, scale, base, hc, iters, eps)
    return _ref.hc_split_sinkhorn_ref(mixes, scale, base, hc, iters, eps)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP8-weight Linear: x [..., K] bf16, w [N, K] e4m3, w_scale E8M0 bytes (or f32 pow2) per 32x32
    tile [N/32, K/32] or per (row, 32) [N, K/32] -> [..., N] bf16. Triton W8A16 GEMM on capable
    GPUs, else act_quant + the matmul of the exactly dequantized weight in the model's dense compute
    dtype (fp32 on CPU, bf16 elsewhere): the very ops of a dense Linear, so the same bits.
    DEEPINFER_GEMM=deepgemm: DeepGEMM on the weight's cached 128x128-tile form where it can run
    (deepgemm_active, N and K multiples of 128). A weight already in that form (f32 [N/128, K/128]
    scales: experts converted in place by deepgemm.prepare_deepgemm) runs through DeepGEMM whenever
    it can run, else through the same reference on its exact values."""
    if _dg.is_tile128(w, w_scale):
        if deepgemm_usable(x):
            return _dg.linear(x, w, w_scale)
        return _ref_fp8_linear(x, _dg.dequant_tile128(w, w_scale))
    if deepgemm_active(x) and _dg.shapes_ok(*w.shape) and _fast_gemm_ok(w, w_scale):
        pair = _dg.cached_tile128(w, w_scale)
        if pair is not None:
            return _dg.linear(x, *pair)
    if fp8_decode_takes(x, w, w_scale, against="fp8_select"):
        return fp8_decode_linear(x, w, w_scale)
    if _bf16_gemm_ok(x, w, w_scale):
        return _bf16_gemm_linear(x, w, w_scale)
    if _cuda_fp8_ok(x, w, w_scale):
        from .cuda_fp8_gemm import fp8_linear_cuda
        return fp8_linear_cuda(x, w, w_scale)
    if _prefill_fp8_ok(x, w, w_scale):
        from .triton_fp8_prefill import fp8_prefill_linear
        return fp8_prefill_linear(x, w, w_scale)
    variant = _fp8_variant_for(x, w, w_scale)
    if variant is not None:
        from .triton_fp8_variants import fp8_variant_linear
        split = None
        if PREFILL_GEMM == "auto":            # the split count measured with the table's pick, if any
            split = fp8_table_entry(x.numel() // w.shape[1], *w.shape)[1]
        return fp8_variant_linear(x, w, w_scale, variant, split_k=split)
    if _fast_for(x, "fp8_linear", _fast_gemm_ok(w, w_scale), _GEMM_RULE):
        from .triton_gemm import fp8_linear as fast
        return fast(x, w, w_scale, batch_invariant=_batch_invariant())
    return _ref_fp8_linear(x, dequant_fp8(w, w_scale))


def fp8_decode_takes(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, against: str = "bf16_held") -> bool:
    """The CUDA FP8 x FP8 decode GEMM takes this call: a bf16 CUDA tensor on the fast path, not batch-invariant
    mode (its split-K sum order follows M), of 1..FP8_DECODE_MAX_M rows or where its measured table says it
    beat `against` at this M (cuda_fp8_decode.table_choice: the bf16-held path for Linear.fp8_decode copies,
    "fp8_select" for FP8-held weights), and a weight within cuda_fp8_decode's rules (logged once per rule
    where it is not)."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or _batch_invariant() or not use_fast(x):
        return False
    k = x.shape[-1]
    m = x.numel() // max(k, 1)
    if m < 1 or w.dim() != 2 or w.shape[1] != k:
        return False
    from . import cuda_fp8_decode
    if m > FP8_DECODE_MAX_M and cuda_fp8_decode.table_choice(
            m, w.shape[0], k, torch.cuda.get_device_name(x.device.index if x.device.index is not None
                                                         else torch.cuda.current_device()), against) is None:
        return False
    reason = cuda_fp8_decode.decline_reason(m, w.shape[0], k, w, w_scale, x.device)
    if reason is None and not cuda_fp8_decode.scales_ready(w_scale):
        if torch.cuda.is_current_stream_capturing():   # its scale layout is made eagerly, never in a graph
            reason = "its weight scales prepared before CUDA graph capture (an eager call does it)"
        else:
            cuda_fp8_decode.kernel_scales(w_scale)
    return _fast_for(x, "fp8_decode_gemm", reason is None, reason or "", then="the other FP8 paths")


def fp8_decode_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """act_quant + the CUDA FP8 x FP8 decode GEMM (callers check fp8_decode_takes first)."""
    from .cuda_fp8_decode import fp8_decode_linear as run
    return run(x, w, w_scale)


_BF16_EXACT: dict[int, tuple] = {}         # id(w_scale) -> (weakref to it, verdict)
_BF16_SCRATCH: dict[tuple, torch.Tensor] = {}


def _bf16_gemm_ok(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, m: int | None = None,
                  exact_of: torch.Tensor | None = None) -> bool:
    """The dense bf16 path takes this call (of m rows; default: x's rows; exact_of: the whole grouped weight's
    scales, when w is one group of it): DEEPINFER_PREFILL_GEMM=bf16 (any M)
    or auto from BF16_AUTO_MIN_M rows; a CUDA tensor on the fast path, not batch-invariant mode (W8A16
    keeps one formulation for every M there), not inside a graph capture (the scratch buffer), a 2-D
    weight in a layout the W8A16 kernel takes, and every w * scale a bf16 value (checked once per weight;
    logged once where it is not)."""
    if PREFILL_GEMM not in ("bf16", "auto") or _batch_invariant() or not x.is_cuda or not use_fast(x) \
            or w.dim() != 2 or x.dtype != torch.bfloat16 or torch.cuda.is_current_stream_capturing():
        return False
    m = x.numel() // max(w.shape[1], 1) if m is None else m
    if PREFILL_GEMM == "auto" and (BF16_AUTO_MIN_M <= 0 or m < BF16_AUTO_MIN_M):
        return False
    if not _fast_gemm_ok(w, w_scale):
        return _fast_for(x, "bf16_gemm", False, _GEMM_RULE, then="the FP8 paths")
    return _bf16_exact_weight(w_scale if exact_of is None else exact_of, x)


def _bf16_exact_weight(w_scale: torch.Tensor, x: torch.Tensor) -> bool:
    """triton_dequant.bf16_exact of these scales, computed once per weight (a host read)."""
    hit = _BF16_EXACT.get(id(w_scale))
    if hit is None or hit[0]() is not w_scale:
        from .triton_dequant import bf16_exact
        hit = _BF16_EXACT[id(w_scale)] = (weakref.ref(w_scale), bf16_exact(w_scale))
    return _fast_for(x, "bf16_gemm", hit[1], "weight scales within 2^-117..2^118 (w * scale a normal bf16 value)",
                     then="the FP8 paths")


def _bf16_scratch(x: torch.Tensor, numel: int) -> torch.Tensor:
    """numel bf16 elements of the scratch buffer of x's device and current stream (reused by the next call
    on that stream, which the stream orders after this one's GEMM)."""
    key = (x.device, torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0)
    buf = _BF16_SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _BF16_SCRATCH[key] = torch.empty(numel, dtype=torch.bfloat16, device=x.device)
    return buf[:numel]


def _bf16_dequant_scratch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """w dequantized to bf16 in the scratch buffer (_bf16_scratch)."""
    from .triton_dequant import dequant_fp8_bf16
    n, k = w.shape
    return dequant_fp8_bf16(w, w_scale, out=_bf16_scratch(x, n * k).view(n, k))


def _bf16_gemm_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """act_quant (e4m3 values times powers of two, in bf16) times the weight dequantized into this
    stream's scratch buffer, on cuBLAS: the release GEMM's products, summed in fp32."""
    return torch.nn.functional.linear(act_quant(x), _bf16_dequant_scratch(x, w, w_scale))


def _bf16_grouped(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """grouped_w8a16 on the bf16 path: every group's weight dequantized into the scratch buffer at once,
    then [G, M, K] x [G, K, N] on cuBLAS, token-major in and out."""
    g, n, k = w.shape
    wd = _bf16_dequant_scratch(x, w.view(g * n, k), w_scale.flatten(0, 1)).view(g, n, k)
    return grouped_mm_token_major(x, wd)


def grouped_mm_token_major(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, G, K] @ w [G, N, K]^T per group -> [M, G, N] contiguous (einsum "tgd,grd->tgr"). The GEMM
    writes the token-major rows itself (bmm into a transposed view): the einsum's [G, M, N] result
    needed a strided copy before wo_b (~180 us a layer at 8k tokens in the H200 profile, 2026-12-03).
    A CPU keeps the einsum (a strided out moves CPU bmm's fp32 bits, and the fixtures' bits are the
    einsum's), and so does batch-invariant mode (its dispatch mode computes the einsum token by token)."""
    if not x.is_cuda or _batch_invariant():
        return torch.einsum("tgd,grd->tgr", x, w).contiguous()
    out = x.new_empty(x.shape[0], w.shape[0], w.shape[1])
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


def _bf16_grouped_contiguous_ok(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """The MoE's grouped contiguous step takes the bf16 grouped GEMM: auto (or bf16) with at least
    BF16_MOE_MIN_ROWS rows, a CUDA tensor of an SM90+ device outside graph capture (the scratch buffer),
    not batch-invariant mode, N and K multiples of 8 (the grouped GEMM's 16-byte rows), and every
    w * scale of the stack a bf16 value."""
    if PREFILL_GEMM not in ("bf16", "auto") or BF16_MOE_MIN_ROWS <= 0 or x.shape[0] < BF16_MOE_MIN_ROWS \
            or _batch_invariant() or not x.is_cuda or not use_fast(x) or x.dtype != torch.bfloat16 \
            or w.dim() != 3 or torch.cuda.is_current_stream_capturing():
        return False
    if not _fast_for(x, "bf16_grouped_mm", hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)
                     >= (9, 0) and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0,
                     "torch._grouped_mm on an SM90+ device, N and K multiples of 8", then="the FP8 paths"):
        return False
    return _bf16_exact_weight(w_scale, x)


def _bf16_grouped_contiguous(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
    """grouped_fp8_linear_contiguous on the bf16 path: the whole stack dequantized into this stream's
    scratch buffer, then one grouped GEMM over the experts' row ranges (no host read of counts)."""
    from .grouped_bf16 import bf16_grouped_contiguous
    e, n, k = w.shape
    wd = _bf16_dequant_scratch(x, w.view(e * n, k), w_scale.flatten(0, 1)).view(e, n, k)
    return bf16_grouped_contiguous(x, wd, counts)


def _cuda_fp8_ok(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """The CUDA FP8 x FP8 kernel takes this call: DEEPINFER_PREFILL_GEMM=cuda and at least FP8_VARIANT_MIN_M
    rows, or auto (the default) with 32x32-block weight scales and at least CUDA_AUTO_MIN_M rows (or
    CUDA_AUTO_WIDE_MIN_M rows whose 128 x 128 tiles cover 3/4 of the SMs); not
    batch-invariant mode, and its rules (cuda_fp8_gemm.decline_reason: SM90, nvcc, K % 32, block / per-(row,
    32) / per-row weight scales); a call breaking them takes the W8A16 path, logged once per rule."""
    if PREFILL_GEMM not in ("cuda", "auto") or _batch_invariant() or not use_fast(x) or not x.is_cuda \
            or w.dim() != 2:
        return False
    n, k = w.shape
    m = x.numel() // max(k, 1)
    if PREFILL_GEMM == "cuda" and m < FP8_VARIANT_MIN_M:
        return False
    from .cuda_fp8_gemm import decline_reason, num_sms, scale_kind
    if PREFILL_GEMM == "auto" and m < CUDA_AUTO_MIN_M and not (
            CUDA_AUTO_WIDE_MIN_M is not None and m >= CUDA_AUTO_WIDE_MIN_M
            and 4 * -(-m // 128) * -(-n // 128) >= 3 * num_sms(x.device)):
        return False
    if PREFILL_GEMM == "auto" and scale_kind(n, k, w_scale) != "block":
        return False          # auto: the measured form only (per-row scales stay on W8A16 until measured)
    reason = decline_reason(x.numel() // k, n, k, w_scale, x.device)
    return _fast_for(x, "fp8_linear_cuda", reason is None, reason or "", then="the W8A16 path")


def precompile_cuda_kernels(device):
    """Start nvcc on the CUDA FP8 GEMMs (cuda_fp8_gemm, and cuda_fp8_decode where a decode step may take it)
    in a background thread where this process may pick them (auto or cuda, the fast kernels, an SM90 GPU,
    nvcc found); -> the thread to join, else None.
    Called at model load: a cold cubin cache otherwise costs its first large prefill the whole compile
    (about a minute on a fresh H200 machine, 2026-12-02), in the middle of serving."""
    dev = torch.device(device)
    if dev.type != "cuda" or KERNELS != "fast" or PREFILL_GEMM not in ("auto", "cuda"):
        return None
    import threading
    import time

    from . import cuda_driver, cuda_fp8_gemm
    if not cuda_fp8_gemm._sm90(dev) or cuda_driver.find_nvcc() is None:
        return None

    from . import cuda_fp8_decode
    # the decode GEMM's source too where a decode step may pick it (the masked MoE form, the measured table,
    # a forced M): its ~35 forms take ~30 s of nvcc, which a first decode step would otherwise wait for
    sources = [cuda_fp8_gemm.SRC] + ([cuda_fp8_decode.SRC] if MOE_FP8_DECODE == "1" or FP8_DECODE_MAX_M > 0
                                     or cuda_fp8_decode.TABLE_PATH else [])

    def build() -> None:
        for src in sources:
            t0 = time.perf_counter()
            try:
                cuda_driver.compile_cubin(src)
            except Exception as e:  # noqa: BLE001 (the first call declines or raises with the reason, as before)
                log.warning("kernels: precompiling %s failed: %s", os.path.basename(src), str(e)[:300])
                continue
            log.info("kernels: %s ready in %.1f s", os.path.basename(src), time.perf_counter() - t0)

    thread = threading.Thread(target=build, name="cuda-fp8-nvcc", daemon=True)
    thread.start()
    return thread


def _prefill_fp8_ok(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """The FP8 x FP8 prefill GEMM takes this call: DEEPINFER_PREFILL_GEMM=fp8, at least
    FP8_PREFILL_MIN_M rows, K a multiple of 128, per-32 scales (tile or row) or one f32 per row, not
    batch-invariant mode (W8A16 keeps one formulation for every M there)."""
    k = w.shape[-1]
    if PREFILL_GEMM != "fp8" or x.numel() < FP8_PREFILL_MIN_M * k or _batch_invariant():
        return False
    return _fast_for(x, "fp8_prefill_linear", k % 128 == 0 and _fast_gemm_ok(w, w_scale),
                     "K a multiple of 128 and the W8A16 scale layouts")


@functools.lru_cache(maxsize=None)
def fp8_table(path: str) -> dict:
    """The measured choice table: {(n, k): [(m, variant, split_k), ...] ascending in m}, from the JSON that
    perf/bench_fp8_prefill.py --variants writes ({"measured": "...", "rows": [{"n", "k", "m", "variant"}]},
    variant null where W8A16 won; an optional "split_k" is the split count that won at that M, else
    None: the variant's decode_config rule). Missing file: {} (W8A16 everywhere). A malformed one raises."""
    import json
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        doc = json.load(f)
    table: dict = {}
    for r in doc["rows"]:
        v, split = r["variant"], r.get("split_k")
        if v is not None and v not in FP8_VARIANTS:
            raise ValueError(f"{path}: unknown FP8 variant {v!r} (known: {FP8_VARIANTS})")
        if split is not None and (not isinstance(split, int) or not 1 <= split <= 64):
            raise ValueError(f"{path}: split_k must be an integer in [1, 64], got {split!r}")
        table.setdefault((int(r["n"]), int(r["k"])), []).append((int(r["m"]), v, split))
    return {key: sorted(rows, key=lambda row: row[0]) for key, rows in table.items()}


def fp8_table_entry(m: int, n: int, k: int, path: str | None = None) -> tuple[str | None, int | None]:
    """(variant, split_k) of the table for an [m, k] x [n, k]^T call: the row of the largest measured
    M <= m at this (n, k) (a shape or M below every measured one: (None, None), W8A16)."""
    pick = (None, None)
    for mm, v, split in fp8_table(path or FP8_TABLE_PATH).get((n, k), ()):
        if mm <= m:
            pick = (v, split)
    return pick


def fp8_table_pick(m: int, n: int, k: int, path: str | None = None) -> str | None:
    return fp8_table_entry(m, n, k, path)[0]


def _fp8_variant_for(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> str | None:
    """The FP8 x FP8 variant this FP8 linear takes (None: W8A16): DEEPINFER_PREFILL_GEMM names one (for
    >= FP8_VARIANT_MIN_M rows), or auto and the measured table picks one for this shape; never in
    batch-invariant mode. A call whose shape breaks the variant's rules (K a multiple of 64 for the
    lagged loops, 32 otherwise; the W8A16 scale layouts) declines to W8A16 and logs it once."""
    if PREFILL_GEMM in ("w8a16", "fp8", "cuda") or _batch_invariant() or not use_fast(x):
        return None
    n, k = w.shape
    m = x.numel() // k if k else 0
    if PREFILL_GEMM == "auto":
        variant = fp8_table_pick(m, n, k)
    else:
        variant = PREFILL_GEMM if m >= FP8_VARIANT_MIN_M else None
    if variant is None:
        return None
    step = 64 if "lag" in variant else 32
    ok = k % step == 0 and _fast_gemm_ok(w, w_scale) and w.dtype == torch.float8_e4m3fn
    return variant if _fast_for(x, f"fp8_variant_linear[{variant}]", ok,
                                f"K a multiple of {step} and the W8A16 scale layouts", then="the W8A16 path") else None


# DEEPINFER_MOE_CONTIGUOUS=1: MoE steps past the masked form (prefill chunks) in the grouped contiguous
# form on the W8A16 kernel (triton_moe_contiguous) instead of the per-expert loop; DEEPINFER_PREFILL_GEMM=fp8
# takes the contiguous form on the FP8 kernel. perf/bench_fp8_prefill.py --variants prints it against the
# loop: where the H200 says it wins, flip this one line to "1" (the env still overrides either way).
MOE_CONTIGUOUS_DEFAULT = "1"   # H200, 2026-12-02: grouped W8A16 1.55x the per-expert loop (8192 x 6 pairs)
MOE_CONTIGUOUS = os.environ.get("DEEPINFER_MOE_CONTIGUOUS", MOE_CONTIGUOUS_DEFAULT) == "1"


def grouped_contiguous_ok(x: torch.Tensor, k1: int, k2: int, fp4: bool = False) -> bool:
    """The MoE's grouped contiguous form can run its two GEMMs (K = dim, then moe_inter_dim) for tensor
    x: on the FP8 prefill kernel (DEEPINFER_PREFILL_GEMM=fp8, K % 128 == 0), on an FP8 x FP8 variant
    DEEPINFER_PREFILL_GEMM names (K a multiple of 64 for the lagged loops, 32 otherwise), or on the W8A16
    one (DEEPINFER_MOE_CONTIGUOUS=1, K % 32 == 0; also where a named variant declines). FP4 stacks
    (fp4=True): the bf16 grouped GEMM on the stack dequantized per step, at any step size."""
    if fp4:
        return _fp4_contiguous_ok(x, k1, k2)
    return _contiguous_kernel(x, k1, k2) is not None


def _fp4_contiguous_ok(x: torch.Tensor, k1: int, k2: int) -> bool:
    """FP4 stacks' contiguous form: torch._grouped_mm on an SM90+ device outside graph capture (the
    scratch buffer), not batch-invariant mode, both K multiples of 32."""
    if _batch_invariant() or not x.is_cuda or not use_fast(x) or torch.cuda.is_current_stream_capturing():
        return False
    return _fast_for(x, "fp4_grouped_contiguous", hasattr(torch, "_grouped_mm")
                     and torch.cuda.get_device_capability(x.device) >= (9, 0) and k1 % 32 == 0 and k2 % 32 == 0,
                     "torch._grouped_mm on an SM90+ device, dim and moe_inter_dim multiples of 32",
                     then="the masked form or the per-expert loop")


def _contiguous_kernel(x: torch.Tensor, k1: int, k2: int) -> str | None:
    """"fp8", a variant name, "w8a16" or None (the per-expert loop): grouped_contiguous_ok's choice."""
    if _batch_invariant():
        return None
    if PREFILL_GEMM == "fp8":
        return "fp8" if _fast_for(x, "grouped_fp8_linear_contiguous", k1 % 128 == 0 and k2 % 128 == 0,
                                  "dim and moe_inter_dim multiples of 128") else None
    if PREFILL_GEMM in FP8_VARIANTS:
        step = 64 if "lag" in PREFILL_GEMM else 32
        if _fast_for(x, f"grouped_fp8_variant_contiguous[{PREFILL_GEMM}]", k1 % step == 0 and k2 % step == 0,
                     f"dim and moe_inter_dim multiples of {step}",
                     then="W8A16 (DEEPINFER_MOE_CONTIGUOUS=1) or the per-expert loop"):
            return PREFILL_GEMM
    if MOE_CONTIGUOUS and _fast_for(x, "grouped_w8a16_contiguous", k1 % 32 == 0 and k2 % 32 == 0,
                                    "dim and moe_inter_dim multiples of 32"):
        return "w8a16"
    return None


def grouped_fp8_linear_contiguous(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                                  counts: "torch.Tensor | GroupedRows") -> torch.Tensor:
    """x [P, K] bf16 FP8-rounded rows sorted by expert (counts [E] rows each, device), w [E, N, K] e4m3,
    w_scale [E, N, K/32] / [E, N/32, K/32] E8M0 or [E, N, 1] f32 -> [P, N] bf16 (DeepGEMM's grouped
    contiguous layout, with no alignment padding). Fast: one launch over every expert (no
    host read; FP8 x FP8 with DEEPINFER_PREFILL_GEMM=fp8, else W8A16). Reference: expert by expert
    (reads counts on the host). counts as grouped_rows.GroupedRows: the CUDA kernel's tile map is built
    once for all the GEMMs given the same object (a MoE layer's two projections)."""
    rows, counts = counts, counts_of(counts)
    if w.dtype == torch.uint8:                                  # FP4 stacks (fp4_layout)
        return _fp4_grouped_contiguous(x, w, w_scale, rows)
    k = w.shape[-1]
    kernel = _contiguous_kernel(x, k, k)
    if kernel is not None:
        if kernel == "fp8":
            from .triton_fp8_prefill import fp8_grouped_contiguous
            from .triton_quant import act_quant_fp8
            return fp8_grouped_contiguous(*act_quant_fp8(x), w, w_scale, counts)
        if kernel in FP8_VARIANTS:
            from .triton_fp8_variants import fp8_variant_grouped_contiguous
            from .triton_quant import act_quant_fp8
            return fp8_variant_grouped_contiguous(*act_quant_fp8(x), w, w_scale, counts, kernel)
        if kernel == "w8a16" and _bf16_grouped_contiguous_ok(x, w, w_scale):
            return _bf16_grouped_contiguous(x, w, w_scale, counts)
        if kernel == "w8a16" and _cuda_grouped_ok(x, w, w_scale):
            from .cuda_fp8_gemm import fp8_grouped_contiguous_cuda
            from .triton_quant import act_quant_fp8
            return fp8_grouped_contiguous_cuda(*act_quant_fp8(x), w, w_scale, rows)
        from .triton_moe_contiguous import w8a16_grouped_contiguous
        return w8a16_grouped_contiguous(x, w, w_scale, counts)
    return _contiguous_ref(x, counts, w.shape[1], lambda e: dequant_fp8(w[e], w_scale[e]))


def _contiguous_ref(x: torch.Tensor, counts: torch.Tensor, n: int, weight_of) -> torch.Tensor:
    """The grouped contiguous GEMM expert by expert on the reference (weight_of(e): expert e's exact weights;
    reads counts on the host)."""
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out[start:start + c] = _ref_fp8_linear(x[start:start + c], weight_of(e))
        start += c
    return out


def _fp4_grouped_contiguous(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            rows: "torch.Tensor | GroupedRows") -> torch.Tensor:
    """grouped_fp8_linear_contiguous on FP4 stacks (w [E, N, K/2] in fp4_kernel_layout, E8M0 [E, N, K/32]):
    up to FP4_W4A16_MAX_ROWS_PER_EXPERT rows an expert the packed bytes decoded in the GEMM's K loop
    (triton_fp4_contiguous), else
    the whole stack dequantized into the stream's scratch buffer (triton_dequant.dequant_fp4_bf16: every
    w * scale a bf16 value) and one bf16 grouped GEMM; elsewhere expert by expert on the reference."""
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * 2
    counts = counts_of(rows)
    if _fp4_contiguous_ok(x, k, k):
        if x.shape[0] <= FP4_W4A16_MAX_ROWS_PER_EXPERT * e:
            from .triton_fp4_contiguous import w4a16_grouped_contiguous
            return w4a16_grouped_contiguous(x, w, w_scale, rows)
        from .grouped_bf16 import bf16_grouped_contiguous
        from .triton_dequant import dequant_fp4_bf16
        buf = _bf16_scratch(x, e * n * k)
        wd = dequant_fp4_bf16(w.view(e * n, k // 2), w_scale.view(e * n, k // 32), out=buf.view(e * n, k))
        return bf16_grouped_contiguous(x, wd.view(e, n, k), counts)
    return _contiguous_ref(x, counts, n, lambda g: _fp4_dense(w[g], w_scale[g]))


def _fp4_dense(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """One FP4 stack entry (fp4_kernel_layout) as its exact float32 weights (the reference's decode)."""
    from .fp4_layout import fp4_release_layout
    from .reference import dequant_fp4_ref
    return dequant_fp4_ref(fp4_release_layout(w), w_scale)


def _cuda_grouped_ok(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """The MoE's grouped contiguous step takes the CUDA kernel: DEEPINFER_PREFILL_GEMM=cuda (32x32-block,
    per-(row, 32) or per-row scales), or auto (the default) with 32x32-block or per-row scales (the MXFP4
    experts' row-scaled [E, N, 1] stacks: H200, 2026-12-02, the whole 1 x 8192 prefill 1.20x with it, the
    per-row form 361-605 TFLOP/s at M 2,048-8,192 against W8A16's 252-330; per-(row, 32) scales ran 160-200, so they stay
    on W8A16); not batch-invariant mode; a stack breaking the kernel's rules stays on W8A16, logged once."""
    if PREFILL_GEMM not in ("cuda", "auto") or _batch_invariant() or not x.is_cuda or w.dim() != 3 \
            or w_scale.dim() != 3 or not use_fast(x):
        return False
    from .cuda_fp8_gemm import decline_reason, scale_kind
    if PREFILL_GEMM == "auto" and scale_kind(w.shape[1], w.shape[2], w_scale[0]) not in ("block", "row"):
        return False
    reason = decline_reason(x.shape[0], w.shape[1], w.shape[2], w_scale[0], x.device)
    return _fast_for(x, "grouped_fp8_contiguous_cuda", reason is None, reason or "", then="the W8A16 path")


def _ref_fp8_linear(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """act_quant + the matmul of the exactly dequantized weight wd in the dense compute dtype."""
    dt = _dense_dtype(x)
    return torch.nn.functional.linear(_ref.act_quant_ref(x).to(dt), wd.to(dt)).to(torch.bfloat16)


# Reference grouped GEMM: experts dequantized this many weight elements at a time (256 MB in fp32),
# so a layer's FP8 stack never exists densely all at once.
GROUPED_REF_CHUNK = 1 << 26


def grouped_fp8_linear_masked(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, masked_m: torch.Tensor,
                              expected_m: int | None = None) -> torch.Tensor:
    """Masked grouped FP8 GEMM (DeepGEMM's masked layout): x [G, C, K] bf16, already FP8-rounded
    (act_quant values), w [G, N, K] e4m3, w_scale [G, N, K/32] or [G, N/32, K/32] E8M0, masked_m [G]
    int32 (device) -> [G, C, N] bf16; rows >= masked_m[g] are unspecified (the Triton kernel skips
    them, the reference computes them from whatever x holds there). expected_m: a host-side guess of
    the rows per group (tile choice only; default C). No host read of masked_m on either path.
    DEEPINFER_GEMM=deepgemm: DeepGEMM's m_grouped_fp8_gemm_nt_masked on the stack's 128x128-tile form
    (prepared in place at load, f32 [G, N/128, K/128] scales, or cached on first use), as fp8_linear."""
    if w.dtype == torch.uint8:                                  # FP4 stacks (fp4_layout)
        return _fp4_grouped_masked(x, w, w_scale, masked_m, expected_m)
    tile = _dg.is_tile128(w, w_scale)
    if x.shape[1] > 0:
        if tile and deepgemm_usable(x):
            return _dg.grouped_linear_masked(x, w, w_scale, masked_m, expected_m or x.shape[1])
        if not tile and deepgemm_active(x) and _dg.shapes_ok(*w.shape[-2:]) and _fast_gemm_ok(w[0], w_scale[0]):
            pair = _dg.cached_tile128(w, w_scale)
            if pair is not None:
                return _dg.grouped_linear_masked(x, *pair, masked_m, expected_m or x.shape[1])
    if not tile and x.shape[1] > 0 and _fast_for(x, "grouped_fp8_linear_masked", _fast_gemm_ok(w[0], w_scale[0]),
                                                 _GEMM_RULE):
        from .triton_gemm import w8a16_grouped_gemm_masked as fast
        return fast(x, w, w_scale, masked_m, expected_m or x.shape[1], batch_invariant=_batch_invariant())
    G, C, _ = x.shape
    dt = _dense_dtype(x)
    deq = _dg.dequant_tile128 if tile else dequant_fp8
    out = torch.empty(G, C, w.shape[1], dtype=torch.bfloat16, device=x.device)
    step = max(1, GROUPED_REF_CHUNK // (w.shape[1] * w.shape[2]))
    for g in range(0, G, step):
        wd = deq(w[g:g + step], w_scale[g:g + step]).to(dt)                         # [g, N, K]
        out[g:g + step] = torch.bmm(x[g:g + step].to(dt), wd.transpose(1, 2)).to(torch.bfloat16)
    return out


# linear_fp32 on Triton up to this many output features (the router's 384 experts, the compressor's
# 512, DSpark's confidence head): there cuBLAS's tiles leave most SMs idle. Never the LM head (vocab
# ~129k, at its roofline on cuBLAS) nor the Markov head (vocab wide).
LINEAR_FP32_MAX_N = 8192
LINEAR_FP32_MAX_M = 128         # decode; longer batches stay on cuBLAS (batch-invariant mode: all M)


@functools.lru_cache(maxsize=None)
def _skinny_table_file(device_name: str | None = None) -> tuple[str | None, dict]:
    """(the GPU model it was measured on, {(N, K): [(measured M, tiles or None), ...] ascending}) from
    SKINNY_TABLE_PATH's table for GPU model device_name (None: the file's first table; (None, {}) if unset,
    absent or not measured there)."""
    return rows_by_shape(SKINNY_TABLE_PATH, lambda r: (r["m"], r["cfg"]), device=device_name)


def reload_skinny_table() -> None:
    """Read SKINNY_TABLE_PATH again at the next call (tests and benchmarks swap tables)."""
    _skinny_table_file.cache_clear()
    _skinny_device_table.cache_clear()


@functools.lru_cache(maxsize=None)
def _skinny_device_table(device_index: int) -> dict:
    """This GPU model's rows (tiles depend on its shared memory and SM count): none measured here means
    cuBLAS for every dense linear, said once in the log."""
    name = torch.cuda.get_device_name(device_index)
    measured, rows = _skinny_table_file(name)
    if measured is None and _skinny_table_file()[1]:
        log.info("kernels: the skinny bf16 GEMM table has no rows measured on %s: cuBLAS for the dense linears",
                 name)
    return rows


def skinny_cfg(m: int, n: int, k: int, table: dict | None = None) -> dict | None:
    """The Triton skinny kernel's tiles for an [m, k] x [n, k]^T bf16 GEMM, or None (cuBLAS): the row of
    `table` (default: the file's first table) at the smallest measured M at or above m, where the kernel won."""
    for mm, cfg in (table if table is not None else _skinny_table_file()[1]).get((n, k), ()):
        if m <= mm:
            return cfg
    return None


def _skinny(x: torch.Tensor, w: torch.Tensor) -> dict | None:
    """The skinny kernel's tiles where it takes this call: CUDA, the fast kernels, not batch-invariant mode
    (the table picks tiles by M), bf16 operands, a contiguous 2-D weight, K % 32 == 0, the GPU model the
    table was measured on, and a table win."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.dim() != 2 \
            or not w.is_contiguous() or w.shape[1] % 32 or not use_fast(x) or _batch_invariant():
        return None
    table = _skinny_device_table(x.device.index if x.device.index is not None else torch.cuda.current_device())
    n, k = w.shape
    return skinny_cfg(x.numel() // k, n, k, table) if table else None


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T for dense (bf16-held) weights, in x's dtype: the Triton skinny kernel
    (triton_gemm.bf16_skinny_linear) where the measured table says it beats cuBLAS at this M, else cuBLAS."""
    cfg = _skinny(x, w)
    if cfg is not None:
        from .triton_gemm import bf16_skinny_linear
        return bf16_skinny_linear(x.reshape(-1, x.shape[-1]), w, cfg).view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x, w)


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in fp32 arithmetic -> [..., N] fp32 (reference.linear_fp32_ref). bf16
    operands, M <= LINEAR_FP32_MAX_M rows and N <= LINEAR_FP32_MAX_N: the split-K Triton GEMM
    (triton_linear_fp32; tiles and splits from (N, K) only, so rows are batch invariant at any M,
    which batch-invariant mode uses for every M). Else cuBLAS / the CPU fp32 matmul.
    NOTE(perf): only in batch-invariant mode: on the H200 (2026-12-01, earlier run) the Triton GEMM ran the router
    shape (N 384, K 5120) at 0.68-0.79x cuBLAS's speed (9.8-12.2 vs 7.7-8.3 us at M 1-128)."""
    n, k = w.shape
    m = x.numel() // k if k else 0
    if (use_fast(x) and _batch_invariant() and x.dtype == w.dtype == torch.bfloat16 and n <= LINEAR_FP32_MAX_N
            and w.is_contiguous() and k % 16 == 0):
        from .triton_linear_fp32 import linear_fp32 as fast
        return fast(x, w)
    cfg = _skinny(x, w)
    if cfg is not None:                     # the head's logits at decode sizes
        from .triton_gemm import bf16_skinny_linear
        return bf16_skinny_linear(x.reshape(-1, x.shape[-1]), w, cfg, out_dtype=torch.float32).view(
            *x.shape[:-1], w.shape[0])
    return _ref.linear_fp32_ref(x, w)


# Widest router row and largest topk of the Triton kernel (triton_router.MAX_WIDTH / MAX_TOPK; not
# imported here, as TOPK_MAX_WIDTH below)
ROUTER_MAX_E, ROUTER_MAX_TOPK = 4096, 32


def router_topk(logits: torch.Tensor, bias: torch.Tensor, topk: int, temp: float, route_scale: float, norm: bool,
                bias_alt: torch.Tensor | None = None, alt_mask: torch.Tensor | None = None):
    """The MoE gate after its GEMM (reference.router_topk_ref): logits [T, E] fp32 -> (weights [T, topk]
    fp32, indices [T, topk] int64). One Triton program per token instead of ~10 torch launches."""
    if _fast_for(logits, "router_topk", logits.dim() == 2 and logits.dtype == torch.float32
                 and 0 < topk <= min(logits.shape[1], ROUTER_MAX_TOPK) and logits.shape[1] <= ROUTER_MAX_E,
                 f"2-D fp32 logits, at most {ROUTER_MAX_E} experts and top-{ROUTER_MAX_TOPK}"):
        from .triton_router import router_topk as fast
        return fast(logits, bias, topk, temp, route_scale, norm, bias_alt, alt_mask)
    return _ref.router_topk_ref(logits, bias, topk, temp, route_scale, norm, bias_alt, alt_mask)


def moe_route(indices: torch.Tensor, n_experts: int, contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE's routing map (reference.moe_route_ref): (counts [E] int32, slot [T*K] int64), rows of the
    masked [E, T] slab or (contiguous) of the pairs sorted by expert."""
    if use_fast(indices):
        from .triton_moe import moe_route as fast
        return fast(indices, n_experts, contiguous)
    return _ref.moe_route_ref(indices, n_experts, contiguous)


def moe_dispatch(x: torch.Tensor, slot: torch.Tensor, K: int, n_experts: int, fp8: bool = False):
    """act_quant(x) into the pairs' rows of an [E, T, d] slab (reference.moe_dispatch_ref); fp8: as e4m3 bytes
    + their scales transposed (fp8_masked_moe_gemm's input; reference.moe_dispatch_fp8_ref)."""
    if _fast_for(x, "moe_dispatch", x.shape[-1] % 32 == 0, "dim a multiple of 32"):
        from .triton_moe import moe_dispatch as fast
        return fast(x, slot, K, n_experts, fp8=fp8)
    return (_ref.moe_dispatch_fp8_ref if fp8 else _ref.moe_dispatch_ref)(x, slot, K, n_experts)


def masked_moe_fp8_takes(x: torch.Tensor, w13: torch.Tensor, r13, w2: torch.Tensor, r2) -> bool:
    """The masked MoE runs on the CUDA FP8 x FP8 form (moe_dispatch / moe_swiglu_quant with fp8=True, then
    fp8_masked_moe_gemm): MOE_FP8_DECODE on, a bf16 CUDA tensor on the fast path, not batch-invariant mode,
    both stacks FP8 with one scale a row (ExpertStacks.r13 / r2; logged once per rule where not)."""
    if MOE_FP8_DECODE != "1" or not x.is_cuda or x.dtype != torch.bfloat16 or _batch_invariant() or not use_fast(x):
        return False
    from . import cuda_fp8_decode
    reason = cuda_fp8_decode.masked_decline_reason(w13, r13, x.device) or \
        cuda_fp8_decode.masked_decline_reason(w2, r2, x.device)
    if reason is None and (x.shape[-1] % 32 or w2.shape[-1] % 32):
        reason = "dim and moe_inter_dim multiples of 32"
    if reason is None and x.shape[0] % 4:                      # the slabs' capacity C is the step's tokens
        reason = cuda_fp8_decode.MASKED_SLAB_RULE
    return _fast_for(x, "fp8_masked_moe_gemm", reason is None, reason or "", then="W8A16 (grouped_fp8_linear_masked)")


def masked_moe_w4a8_takes(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                          s2: torch.Tensor) -> bool:
    """The masked MoE on FP4 stacks runs on W4A8 (moe_dispatch / moe_swiglu_quant with fp8=True, then
    w4a8_masked_moe_gemm): DEEPINFER_W4A8=1, FP4 stacks (uint8), a bf16 tensor on the fast path, not batch-invariant
    mode, and triton_w4a8.w4a8_decline_reason None for both stacks (each row's block scales within the e4m3 range
    of one base; checked once per stack and cached), slabs of C % 4 == 0 rows; logged once per rule where not."""
    if W4A8 != "1" or w13.dtype != torch.uint8 or x.dtype != torch.bfloat16 or _batch_invariant() or not use_fast(x):
        return False
    from . import triton_w4a8
    reason = triton_w4a8.w4a8_decline_reason(w13, s13, x.device) or triton_w4a8.w4a8_decline_reason(w2, s2, x.device)
    if reason is None and x.shape[0] % 4:                      # the slabs' scale columns (moe_dispatch's layout)
        reason = "slab rows per expert (C, the step's tokens) a multiple of 4"
    return _fast_for(x, "w4a8_masked_moe_gemm", reason is None, reason or "", then="W4A16 (grouped_fp8_linear_masked)")


def w4a8_masked_moe_gemm(a: torch.Tensor, sa_t: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         masked_m: torch.Tensor, expected_m: int) -> torch.Tensor:
    """[G, C, K] e4m3 slab (+ transposed scales) x FP4 stack (fp4_kernel_layout bytes, E8M0 [G, N, K/32]) -> [G, C, N]
    bf16: triton_w4a8.w4a8_masked_moe_gemm on the fast path (where masked_moe_w4a8_takes), else the FP8 reference
    on the same values (rows past masked_m zero there, unset on the GPU)."""
    if use_fast(a):
        from .triton_w4a8 import w4a8_masked_moe_gemm as fast
        return fast(a, sa_t, w, w_scale, masked_m, expected_m)
    G, C, K = a.shape
    s = sa_t[:, :G * C].T.reshape(G, C, K // 32).repeat_interleave(32, dim=-1)
    wd = torch.stack([_fp4_dense(w[i], w_scale[i]) for i in range(G)])
    out = torch.bmm(a.float() * s, wd.transpose(1, 2)).to(torch.bfloat16)
    live = torch.arange(C, device=a.device)[None, :] < masked_m.to(a.device).long()[:, None]
    return torch.where(live[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def fp8_masked_moe_gemm(a: torch.Tensor, sa_t: torch.Tensor, w: torch.Tensor, w_rows: torch.Tensor,
                        masked_m: torch.Tensor, expected_m: int) -> torch.Tensor:
    """[G, C, K] e4m3 slab (+ transposed scales) x row-scaled e4m3 stack [G, N, K] -> [G, C, N] bf16: the
    CUDA masked form (cuda_fp8_decode.fp8_masked_moe_gemm, which raises with the rule a stack breaks) on a GPU
    on the fast path (where masked_moe_fp8_takes), else its reference (rows past masked_m zero there, unset on
    the GPU)."""
    if a.is_cuda and use_fast(a):
        from .cuda_fp8_decode import fp8_masked_moe_gemm as fast
        return fast(a, sa_t, w, w_rows, masked_m, expected_m)
    return _ref.fp8_masked_moe_gemm_ref(a, sa_t, w, w_rows, masked_m)


def moe_swiglu_quant(gu: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, limit: float,
                     inter: int, fp8: bool = False):
    """Clamped SwiGLU x routing weight, bf16, act_quant at the pairs' rows (reference.moe_swiglu_quant_ref);
    fp8: in moe_dispatch's FP8 form (reference.moe_swiglu_quant_fp8_ref)."""
    if _fast_for(gu, "moe_swiglu_quant", inter % 32 == 0, "moe_inter_dim a multiple of 32"):
        from .triton_moe import moe_swiglu_quant as fast
        return fast(gu, slot, weights, limit, inter, fp8=fp8)
    return (_ref.moe_swiglu_quant_fp8_ref if fp8 else _ref.moe_swiglu_quant_ref)(gu, slot, weights, limit, inter)


def swiglu_quant(gu: torch.Tensor, limit: float, inter: int) -> torch.Tensor:
    """The shared expert's clamped SwiGLU, bf16, act_quant (reference.swiglu_quant_ref)."""
    if _fast_for(gu, "swiglu_quant", inter % 32 == 0, "moe_inter_dim a multiple of 32"):
        from .triton_moe import swiglu_quant as fast
        return fast(gu, limit, inter)
    return _ref.swiglu_quant_ref(gu, limit, inter)


def carry_write(raw_kv, raw_score, carry_kv, carry_score, ring_write, rows=None) -> None:
    """The ratio > 1 compressor's carry ring: the step's rows (rows: those of raw_*) into its rows ring_write, in
    place (reference.carry_write_ref); a copy, so the kernel's values are the reference's."""
    if use_fast(raw_kv):
        from .triton_compress import carry_write as fast
        return fast(raw_kv, raw_score, carry_kv, carry_score, ring_write, rows)
    return _ref.carry_write_ref(raw_kv, raw_score, carry_kv, carry_score, ring_write, rows)


def compress_members(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots, group_seq,
                     ring_len: int):
    """The ratio > 1 compressor's member rows from the step's rows and the carry ring
    (reference.compress_members_ref); a gather, so the kernel's values are the reference's."""
    if use_fast(raw_kv):
        from .triton_compress import compress_members as fast
        return fast(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots, group_seq,
                    ring_len)
    return _ref.compress_members_ref(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots,
                                     group_seq, ring_len)


def compress_pool(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots, group_seq,
                  ring_len: int, weight, eps: float) -> torch.Tensor:
    """The ratio > 1 compressor's normed latents [G, D] bf16 from the step's rows and the carry ring
    (reference.compress_pool_ref): one Triton program a group where its rules hold (fp32 rows up to
    4096 wide), else the members' gather (compress_members), the softmax-weighted sum and rms_norm apart."""
    D = raw_kv.shape[-1]
    G, ratio = member_rows.shape
    # one program a group walks its members three times: long groups, few of them, leave the GPU idle (ratio 128:
    # 0.90x the apart path at 16 groups, 1.43x at 64; ratio 2 / 4: 2.8-4.9x from 16 groups; H100, 2026-12-07).
    # Batch-invariant mode keeps the kernel at every G (a group's result is its own program's either way).
    if (ratio < 64 or G >= 32 or _batch_invariant()) and _fast_for(raw_kv, "compress_pool", raw_kv.dtype == torch.float32
                                             and weight.shape == (D,) and D <= 4096, "fp32 rows up to 4096 wide"):
        from .triton_compress import compress_pool as fast
        return fast(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots, group_seq,
                    ring_len, weight, eps)
    kv, score = compress_members(raw_kv, raw_score, carry_kv, carry_score, member_rows, member_carry, ring_slots,
                                 group_seq, ring_len)
    return rms_norm(_ref.softmax_pool_ref(kv, score), weight, eps)


def window_pool(win_idx, ring_read, ring_rows: int, num_fresh: int) -> torch.Tensor:
    """The step's window lists in the in-place sources' rows, int32 (reference.window_pool_ref); integers, so
    the kernel's are the reference's."""
    if use_fast(win_idx):
        from .triton_lists import window_pool as fast
        return fast(win_idx, ring_read, ring_rows, num_fresh)
    return _ref.window_pool_ref(win_idx, ring_read, ring_rows, num_fresh)


def pool_lists(win_pool, win_len, topk, seq_of, block_tables, epb: int, base: int) -> torch.Tensor:
    """A decode layer's attention lists in pool rows: window part, then compressed picks (reference.pool_lists_ref)."""
    if use_fast(win_pool):
        from .triton_lists import pool_lists as fast
        return fast(win_pool, win_len, topk, seq_of, block_tables, epb, base)
    return _ref.pool_lists_ref(win_pool, win_len, topk, seq_of, block_tables, epb, base)


def engram_gate(x, key, value, w, eps: float, token_mask=None) -> torch.Tensor:
    """Engram's gated add after its wkv GEMM (reference.engram_gate_ref)."""
    if _fast_for(x, "engram_gate", key.stride(-1) == 1 and value.stride(-1) == 1, "unit-stride key and value rows"):
        from .triton_engram import engram_gate as fast
        return fast(x, key, value, w, eps, token_mask)
    return _ref.engram_gate_ref(x, key, value, w, eps, token_mask)


def ngram_hash(input_ids, cu_seqlens, history, token_mask, token_map, multipliers, primes, offsets,
               pad_id: int, dead: int) -> torch.Tensor:
    """Engram's n-gram hash ids of a batch's new tokens (reference.ngram_hash_ref); integers, so the
    kernel's are the reference's."""
    if use_fast(input_ids):
        from .triton_engram import ngram_hash as fast
        return fast(input_ids, cu_seqlens, history, token_mask, token_map, multipliers, primes, offsets, pad_id, dead)
    return _ref.ngram_hash_ref(input_ids, cu_seqlens, history, token_mask, token_map, multipliers, primes, offsets,
                               pad_id, dead)


def engram_rows(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Engram table rows dequantized to bf16 (reference.engram_rows_ref), ids [...] -> [..., D]."""
    if _fast_for(weight, "engram_rows", weight.shape[1] % 32 == 0, "D % 32 == 0"):
        from .triton_engram import engram_rows as fast
        return fast(weight, scale, ids)
    return _ref.engram_rows_ref(weight, scale, ids)


def moe_combine(out: torch.Tensor, slot: torch.Tensor, indices: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 sum of the routed rows in ascending expert id + shared (reference.moe_combine_ref)."""
    if use_fast(out):
        from .triton_moe import moe_combine as fast
        return fast(out, slot, indices, shared)
    return _ref.moe_combine_ref(out, slot, indices, shared)


# a block-diagonal weight held both ways (bf16 and its FP8 blocks: wo_a under dense_bf16 with decode copies) takes
# the FP8 blocks up to this many tokens: the grouped W8A16 kernel reads half the bytes, 1.41 / 1.34 / 1.06x the
# bf16 bmm at 1 / 16 / 64 tokens and 0.86x at 128 (H100, 2026-12-07, perf/bench_wo_a.py)
GROUPED_FP8_MAX_ROWS = int(os.environ.get("DEEPINFER_GROUPED_FP8_MAX_ROWS", "64"))


def grouped_takes_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """A call x [M, G, K] on a block-diagonal weight held both ways takes its FP8 blocks (grouped_w8a16) rather than
    the bf16 copy: 1..GROUPED_FP8_MAX_ROWS tokens, the fast path, not batch-invariant mode (one formulation for
    every M there), blocks the Triton kernel takes."""
    return (0 < x.shape[0] <= GROUPED_FP8_MAX_ROWS and x.dtype == torch.bfloat16 and use_fast(x)
            and not _batch_invariant() and _fast_gemm_ok(w[0], w_scale[0]))


def grouped_w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Grouped matmul on FP8 weights with no activation rounding (the block-diagonal wo_a): x [M, G, K]
    bf16 (token-major: each token's G head groups), w [G, N, K] e4m3, w_scale [G, N/32, K/32] E8M0 ->
    [M, G, N] bf16, the same exact products as the einsum of the dequantized weight, fp32 accumulated.
    Triton W8A16 reading and writing the token-major layout in place on a GPU; else that einsum."""
    if x.shape[0] > 0 and _bf16_gemm_ok(x.flatten(0, 1), w[0], w_scale[0], x.shape[0], exact_of=w_scale):
        return _bf16_grouped(x, w, w_scale)
    if x.shape[0] > 0 and _fast_for(x, "grouped_w8a16", _fast_gemm_ok(w[0], w_scale[0]), _GEMM_RULE):
        from .triton_gemm import w8a16_grouped_gemm as fast
        return fast(x, w, w_scale, batch_invariant=_batch_invariant(), token_major=True)
    dt = _dense_dtype(x)
    return grouped_mm_token_major(x.to(dt), dequant_fp8(w, w_scale).to(dt)).to(torch.bfloat16)


def _fp4_grouped_masked(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, masked_m: torch.Tensor,
                        expected_m: int | None) -> torch.Tensor:
    """grouped_fp8_linear_masked on FP4 stacks: the W4A16 kernel (packed bytes decoded in the K loop),
    else group by group on the reference's weights. Batch-invariant mode takes the reference (the W4A16
    tiles depend on the step's size)."""
    if x.shape[1] > 0 and not _batch_invariant() and _fast_for(x, "w4a16_grouped_masked", x.shape[2] % 32 == 0,
                                                                  "K a multiple of 32"):
        from .triton_gemm import w4a16_grouped_gemm_masked
        return w4a16_grouped_gemm_masked(x, w, w_scale, masked_m, expected_m or x.shape[1])
    G, C, K = x.shape
    dt = _dense_dtype(x)
    out = torch.empty(G, C, w.shape[1], dtype=torch.bfloat16, device=x.device)
    step = max(1, GROUPED_REF_CHUNK // (w.shape[1] * K))       # the FP8 stacks' reference, chunk for chunk
    for g in range(0, G, step):
        wd = torch.stack([_fp4_dense(w[i], w_scale[i]) for i in range(g, min(g + step, G))]).to(dt)
        out[g:g + step] = torch.bmm(x[g:g + step].to(dt), wd.transpose(1, 2)).to(torch.bfloat16)
    return out


def dequant_fp8(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """[..., N, K] e4m3 + E8M0 bytes (or f32 pow2) per 32x32 tile [..., N/32, K/32], per (row, 32)
    [..., N, K/32] or per row [..., N, 1] -> exact float32 values (reference.dequant_fp8_ref for the
    2-D tile case)."""
    n, k = w.shape[-2:]
    s = w_scale if w_scale.dtype == torch.float32 else _ref.e8m0_to_float(w_scale)
    if s.shape[-2] != n:                                               # one scale per 32 rows
        s = s.repeat_interleave(32, -2)[..., :n, :]
    cols = k if s.shape[-1] == 1 else 32
    return w.view(torch.float8_e4m3fn).float() * s.repeat_interleave(cols, -1)[..., :k]


def row_scaled_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor):
    """[..., N, K] e4m3 + per-(row, 32) E8M0 [..., N, K/32] -> (e4m3 w', f32 [..., N, 1]) with one pow2
    scale per row and w' * row scale == w * block scale for every element, or None where some element
    has no exact e4m3 form at its row's scale (a row's block exponents spread too far: > 14 for e2m1
    values). The row exponent puts the row's largest element at e4m3's top binade (2^8), so the
    smaller blocks shift down as little as they can. The K loop of the W8A16 kernel then needs no scale
    at all (triton_gemm.w8a16_pairs_kernel, ROW_SCALE): MXFP4 experts re-expressed once at load."""
    n, k = w.shape[-2:]
    if w_scale.shape[-2] != n or w_scale.shape[-1] != k // 32 or k % 32:
        return None
    wf = w.view(torch.float8_e4m3fn).float().unflatten(-1, (k // 32, 32))        # [..., N, K/32, 32]
    e = w_scale.view(torch.uint8).to(torch.int32) - 127                          # block exponents
    amax = wf.abs().amax(-1)
    top = torch.where(amax > 0, e + torch.frexp(amax).exponent - 1, torch.full_like(e, -1 << 20))
    row_e = (top.amax(-1, keepdim=True) - 8).clamp(-127, 127)                   # all-zero row: 2^-127

    def shifted(r):
        return wf * _pow2((e - r).clamp(-126, 127)).float()[..., None]

    # 1.875 * 2^8 is past e4m3's largest value (448): such rows take one binade less
    row_e = row_e + (shifted(row_e).abs().amax((-2, -1))[..., None] > 448).to(row_e.dtype)
    wq = shifted(row_e).to(torch.float8_e4m3fn)
    row_scale = _pow2(row_e)
    if not torch.equal(wq.double() * row_scale[..., None], wf.double() * _pow2(e)[..., None]):
        return None
    return wq.flatten(-2), row_scale.float()


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2.0 ** n as float64, built from its bits: exact on every device (CUDA's pow(2, n), which
    torch.ldexp uses, is off by an ulp for some negative n). n is clamped to [-1022, 1023]."""
    return ((n.to(torch.int64).clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


def fp4_to_fp8_weight(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weight [N, K/2] (e2m1 pairs) + E8M0 [N, K/32] -> (e4m3 [N, K], E8M0 bytes [N, K/32]).
    Exact: the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} is a subset of e4m3 and the per-(row, 32) scales
    stay as they are (triton_gemm.fp4_to_fp8_weight in plain torch, so a CPU load needs no Triton)."""
    unit = torch.full_like(scale.view(torch.uint8), 127)                   # 2^0: the bare e2m1 values
    return _ref.dequant_fp4_ref(packed, unit).to(torch.float8_e4m3fn), scale.view(torch.uint8).contiguous()


_GEMM_RULE = "K a multiple of 32 and one scale per row or 32 rows per 32 columns (or one per row)"


def _fast_gemm_ok(w: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """The Triton W8A16 GEMMs take K % 32 == 0 and, per 32 columns, one scale per row or per 32 rows,
    or one f32 scale per whole row (row_scaled_fp8_weight)."""
    n, k = w.shape
    if w_scale.shape[-1] == 1 and k > 32:
        return k % 32 == 0 and w_scale.dtype == torch.float32 and w_scale.shape[0] == n
    return k % 32 == 0 and w_scale.shape[-1] == k // 32 and n in (w_scale.shape[0], 32 * w_scale.shape[0])


def _dense_dtype(x: torch.Tensor) -> torch.dtype:
    """The dense Linear's compute dtype (deepinfer.model.layers.compute_dtype): fp32 matmuls on a
    CPU (faster there, same fp32-accumulated values), bf16 on a GPU."""
    return torch.float32 if x.device.type == "cpu" else torch.bfloat16


def _index_shape_ok(q: torch.Tensor) -> bool:
    """triton_indexer: index heads and head dim powers of two (its tl.arange tiles), head dim >= 16."""
    ih, idim = q.shape[-2:]
    return ih & (ih - 1) == 0 and idim >= 16 and idim & (idim - 1) == 0


_INDEX_RULE = "power-of-two index heads and index head dim (>= 16)"


def index_scores(q, w, keys, lens=None):
    if _fast_for(q, "index_scores", _index_shape_ok(q), _INDEX_RULE):
        from .triton_indexer import index_scores as fast
        return fast(q, w, keys, lens)
    from .triton_indexer import index_scores_ref
    return index_scores_ref(q, w, keys, lens)


_RUNS_MEMO: list = [None]    # (cu bytes, device) -> the last step's query runs: its indexer layers share them


def _index_runs(cu, max_q: int, n: int, device):
    """triton_indexer.query_runs of the step's host cu as device tensors, or None where no sequence has
    a run of queries (decode, verify) or under batch invariance (the per-token kernel's head-sum order
    must not depend on which other sequences share the step)."""
    from . import triton_indexer as ti
    if cu is None or max_q < ti.RUN_MIN or int(cu[-1]) != n or _batch_invariant():
        return None
    key = (np.asarray(cu).tobytes(), str(device), ti.RUN_BT)
    memo = _RUNS_MEMO[0]
    if memo is None or memo[0] != key:
        arrays = ti.query_runs(cu)
        pinned = device.type == "cuda"
        runs = tuple((torch.from_numpy(a).pin_memory() if pinned else torch.from_numpy(a)).to(device, non_blocking=True)
                     for a in arrays)
        memo = _RUNS_MEMO[0] = (key, runs)
    return memo[1]


def index_scores_paged(q, w, keys, seq_of, row_in_seq, max_q, lens, cu=None):
    """Batch form: query t against its sequence's keys [B, E, ID] (reference.index_scores_paged_ref);
    the Triton kernel reads each token's key range of the flattened pool (key_start). cu [B+1] (host):
    the step's query counts, so a prefill's queries go to the kernel in runs sharing their keys."""
    if _fast_for(q, "index_scores", _index_shape_ok(q), _INDEX_RULE):
        from .triton_indexer import index_scores as fast
        E = keys.shape[1]
        return fast(q, w, keys.flatten(0, 1), lens, key_start=seq_of, key_start_scale=E, num_keys=E,
                    runs=_index_runs(cu, max_q, q.shape[0], q.device))
    return _ref.index_scores_paged_ref(q, w, keys, seq_of, row_in_seq, max_q, lens)


def index_scores_pool(q, w, pool, block_tables, epb: int, E: int, seq_of, row_in_seq, max_q, lens, cu=None):
    """index_scores_paged with the keys left in the cache pool: pool [R, ID] of epb entries a block, each
    sequence's entries 0..E-1 at reference.block_rows_ref(block_tables, epb, ...); a uint8 pool holds them
    packed (reference.fp4_pack_rows_ref, unpacked to the same values). The Triton kernel reads
    them in place through the block table (no [B, E, ID] copy: at 8k context and batch 64 that copy was
    9% of the H200 decode step; no [B, E] row table either)."""
    if _fast_for(q, "index_scores", _index_shape_ok(q), _INDEX_RULE):
        from .triton_indexer import index_scores as fast
        bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        return fast(q, w, pool, lens, key_start=seq_of, num_keys=E, block_table=bt, entries_per_block=epb,
                    runs=_index_runs(cu, max_q, q.shape[0], q.device))
    entries = torch.arange(E, device=pool.device).expand(block_tables.shape[0], -1)
    rows = _ref.block_rows_ref(block_tables, epb, entries)
    keys = pool[rows]
    if keys.dtype == torch.uint8:                                  # packed FP4 rows (fp4_pack_rows_ref)
        keys = _ref.fp4_unpack_rows_ref(keys, q.shape[-1])
    return _ref.index_scores_paged_ref(q, w, keys, seq_of, row_in_seq, max_q, lens)


# Widest top-k row the Triton kernel holds in registers (triton_topk.MAX_WIDTH; not imported here:
# that module imports Triton, and a CPU-only install must still reach the references).
TOPK_MAX_WIDTH = 1 << 15
_TOPK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _topk_fast_ok(x: torch.Tensor, op: str) -> bool:
    return _fast_for(x, op, x.dim() == 2 and x.dtype in _TOPK_DTYPES and x.shape[1] <= TOPK_MAX_WIDTH,
                     f"2-D bf16/f16/f32 rows of at most {TOPK_MAX_WIDTH}")


def index_topk(score: torch.Tensor, lens: torch.Tensor, topk: int, candidates: torch.Tensor | None = None):
    """The indexer's picks (reference.index_topk_ref): score [n, E] -> [n, min(topk, E)] int64 ids
    ascending, -1 where unreachable. One Triton program per row instead of ~30 torch launches."""
    if (_topk_fast_ok(score, "index_topk") and lens.shape == score.shape[:1]
            and (candidates is None or (candidates.shape == score.shape and candidates.dtype == torch.bool))):
        from .triton_topk import index_topk as fast
        return fast(score, lens, topk, candidates)
    return _ref.index_topk_ref(score, lens, topk, candidates)


def topk_block_mask(b: torch.Tensor, k: int, block_size: int, width: int) -> torch.Tensor:
    """The candidate blocks' top-k as an entry mask (reference.topk_block_mask_ref): b [n, NB] ->
    [n, width] bool."""
    if _topk_fast_ok(b, "topk_block_mask") and width <= b.shape[1] * block_size:
        from .triton_topk import topk_block_mask as fast
        return fast(b, k, block_size, width)
    return _ref.topk_block_mask_ref(b, k, block_size, width)


def candidate_blocks(scores: torch.Tensor, lens: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k from the scores (reference.candidate_blocks_ref): one Triton program a
    row (block maxima, the pin and the top-k) where the top-k kernel runs, else the torch ops."""
    nb = -(-scores.shape[-1] // block_size) if scores.dim() == 2 else 0
    if (_topk_fast_ok(scores, "candidate_blocks") and lens.shape == scores.shape[:1] and 0 < nb <= TOPK_MAX_WIDTH
            and block_size <= 1024):
        from .triton_topk import candidate_blocks as fast
        return fast(scores, lens, k, block_size)
    return _ref.candidate_blocks_ref(scores, lens, k, block_size)


def hc_mixes_pre(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean: bool = False, deferred: bool = False):
    """(pre, post, comb, y[, mean]) (reference.hc_mixes_pre_ref); deferred: (tail, y[, mean]) with tail() ->
    (pre, post, comb), the mixes' chunk sums and Sinkhorn pass launched when called (y does not wait for them)."""
    if _fast_for(x, "hc_mixes_pre", x.shape[1] == 4 and x.shape[-1] % 64 == 0,    # 64-wide column chunks
                 "hc_mult 4 and dim a multiple of 64"):
        from .triton_mhc import hc_mixes_pre as fast
        return fast(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean, batch_invariant=_batch_invariant(),
                    deferred=deferred)
    pre, post, comb, *rest = _ref.hc_mixes_pre_ref(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps, mean)
    return ((lambda: (pre, post, comb)),) + tuple(rest) if deferred else (pre, post, comb, *rest)


def hc_post(y, res, post, comb):
    if use_fast(y):
        from .triton_mhc import hc_post as fast
        return fast(y, res, post, comb)
    return _ref.hc_post_ref(y, res, post, comb)


def hc_post_norm(y, res, post, comb, pre, weight, eps: float, quant: bool = False, mean: bool = False):
    """(hc_post(y, res, post, comb), rms_norm(hc_pre(that, pre), weight, eps), act_quant of it or None[, that's mean
    over the streams]): one Triton kernel (triton_hc_post_norm, the same bits as the ops) where its rules hold,
    else the ops."""
    if use_fast(y):
        from . import triton_hc_post_norm as fused
        if _fast_for(y, "hc_post_norm", fused.shape_ok(y, res, post, comb, pre, weight, quant),
                     "hc_mult 4, dim <= 16384 and bf16 streams", then="hc_post, the collapse and the norm apart"):
            return fused.hc_post_norm(y, res, post, comb, pre, weight, eps, quant, mean)
    out = hc_post(y, res, post, comb)
    x = _ref.hc_pre_ref(out, pre)
    normed = (out, *rms_norm_quant(x, weight, eps)) if quant else (out, rms_norm(x, weight, eps), None)
    return normed + ((out.mean(dim=1),) if mean else ())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fast_for(x, "rms_norm", x.shape[-1] <= 16384 and weight.shape == x.shape[-1:], "width <= 16384"):
        from .triton_norm import rms_norm as fast
        return fast(x, weight, eps)
    return _ref.rms_norm_ref(x, weight, eps)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x, weight, eps), act_quant of it): one Triton kernel writing both (triton_norm.rms_norm_quant,
    the same bits as the two kernels) where its rules hold, else the two ops."""
    if use_fast(x):
        from . import triton_norm
        if triton_norm.quant_shape_ok(x) and weight.shape == x.shape[-1:]:
            return triton_norm.rms_norm_quant(x, weight, eps)
    y = rms_norm(x, weight, eps)
    return y, act_quant(y)


def hc_pre_norm(x: torch.Tensor, pre: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """rms_norm(Block.hc_pre(x[rows], pre[rows]), weight, eps) (rows None: every row): one Triton kernel
    (triton_hc_collapse) where its rules hold, else the torch ops and the norm."""
    if use_fast(x):
        from . import triton_hc_collapse as fused
        if fused.shape_ok(x, pre, weight):
            return fused.hc_pre_norm(x, pre, rows, weight, eps)
    if rows is not None:
        x, pre = x[rows], pre[rows]
    return rms_norm(_ref.hc_pre_ref(x, pre), weight, eps)


def rope_fp4_quant(x: torch.Tensor, cis: torch.Tensor, block: int, dst: torch.Tensor | None = None,
                   pool: torch.Tensor | None = None) -> torch.Tensor:
    """fp4_quant(rope(x, cis), block), a new tensor (x may be handed over: the composed form rotates it in
    place); dst / pool: the rows also written to pool[dst] (packed where the pool is uint8: reference.
    fp4_pack_rows_ref). One Triton kernel with the two kernels' bits
    (triton_rope_fp4) where its rules hold, else the two ops and the write."""
    if use_fast(x):
        from . import triton_rope_fp4 as fused
        if fused.shape_ok(x, cis, block, dst, pool):
            return fused.rope_fp4_quant(x, cis, block, dst, pool)
    out = fp4_quant(rope(x, cis, inplace=True), block)
    if pool is not None:
        pool[dst] = _ref.fp4_pack_rows_ref(out) if pool.dtype == torch.uint8 else out.to(pool.dtype)
    return out


def norm_rope_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, cis: torch.Tensor,
                    ring: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """act_quant(rope(rms_norm(x, weight, eps), cis)), a new tensor: one Triton kernel with the three
    kernels' bits (triton_norm_rope_quant) where its shape rules hold, else the three ops. ring (ring [R, D],
    rows [T]): the rows also written there (ring[rows] = out), by the same kernel where it runs."""
    if use_fast(x):
        from . import triton_norm_rope_quant as fused
        if fused.shape_ok(x, cis) and fused.ring_ok(x, ring):
            return fused.norm_rope_quant(x, weight, eps, cis, ring)
    out = act_quant(rope(rms_norm(x, weight, eps), cis, inplace=True))
    if ring is not None:
        ring[0][ring[1]] = out.to(ring[0].dtype)
    return out


def rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False, inplace: bool = False) -> torch.Tensor:
    """inplace: the caller hands over x (a fresh tensor nothing else reads): the fast path rotates its rope
    dims where they are and returns x; the reference returns a new tensor (same values either way)."""
    half = cis.shape[-1]
    if _fast_for(x, "rope", cis.dim() == 2 and cis.shape[0] == x.shape[0] and half & (half - 1) == 0
                 and 2 * half <= x.shape[-1], "a power-of-two rope_head_dim / 2 and one table row per token"):
        from .triton_rope import rope as fast
        return fast(x, cis, inverse, inplace=inplace)
    return _ref.rope_ref(x, cis, inverse)
