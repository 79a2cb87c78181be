"""Per-call dispatch: the Triton fast path for CUDA tensors on a capable GPU, the torch reference
otherwise. Same names and contracts as the references; deepinfer/model/ops.py binds these names, so on a CPU
every call lands on the torch reference.

Knobs (environment, read once):
    DEEPINFER_KERNELS=ref        the torch references (default)
    DEEPINFER_KERNELS=fast       the Triton fast paths on CUDA. Opt-in until the whole model with
                                 every op bound (tests/kernels/test_model_fast_path.py) has passed on
                                 the H200 again: each op passed alone, the batched model did not run
                                 there yet.
    DEEPINFER_BATCH_INVARIANT=1  fixed-split configs in the GEMMs (attention and mHC are batch
                                 invariant by construction: their splits depend on L / d only)
    TRITON_INTERPRET=1           with DEEPINFER_KERNELS=fast, CPU tensors take the fast paths too,
                                 through Triton's interpreter (tests/kernels/fast_model_smoke.py: the
                                 whole model's dispatch and shapes checked on a CPU, slowly)
"""

from __future__ import annotations

import functools
import os

import torch

from . import reference as _ref

KERNELS = os.environ.get("DEEPINFER_KERNELS", "ref")
if KERNELS not in ("ref", "fast"):
    raise ValueError(f"DEEPINFER_KERNELS must be 'ref' or 'fast', got {KERNELS!r}")
BATCH_INVARIANT = os.environ.get("DEEPINFER_BATCH_INVARIANT", "0") == "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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


def use_fast(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return INTERPRET and KERNELS == "fast"
    return _fast_ok(t.device.index if t.device.index is not None else torch.cuda.current_device())


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
    if use_fast(x):
        from .triton_quant import act_quant as fast
        return fast(x, block)
    return _ref.act_quant_ref(x, block)


def fp4_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    if use_fast(x):
        from .triton_quant import fp4_quant as fast
        return fast(x, block)
    return _ref.fp4_quant_ref(x, block)


def sparse_attn(q, kv, sink, idxs, scale, block: int = 64):
    if use_fast(q) and block == 64:
        from .triton_sparse_attn import sparse_attn as fast
        return fast(q, kv, sink, idxs, scale)
    return _ref.sparse_attn_ref(q, kv, sink, idxs, scale, block)


def hc_split_sinkhorn(mixes, scale, base, hc, iters, eps):
    if use_fast(mixes) and (2 + hc) * hc <= 32:
        from .triton_mhc import hc_split_sinkhorn as fast
        return fast(mixes, scale, base, hc, iters, eps)
    return _ref.hc_split_sinkhorn_ref(mixes, scale, base, hc, iters, eps)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP8-weight Linear (w [N, K] e4m3, w_scale [N/32, K/32] E8M0 or f32): Triton 32-block GEMM
    on capable GPUs, else act_quant + fp32 matmul of the exactly dequantized weight."""
    if use_fast(x):
        from .triton_gemm import fp8_linear as fast
        return fast(x, w, w_scale, batch_invariant=BATCH_INVARIANT)
    if w_scale.dtype == torch.float32:
        s = w_scale.repeat_interleave(32, 0)[: w.shape[0]].repeat_interleave(32, 1)[:, : w.shape[1]]
        wf = w.float() * s
    else:
        wf = _ref.dequant_fp8_ref(w, w_scale)
    return torch.nn.functional.linear(_ref.act_quant_ref(x).float(), wf).to(torch.bfloat16)


def index_scores(q, w, keys, lens=None):
    if use_fast(q):
        from .triton_indexer import index_scores as fast
        return fast(q, w, keys, lens)
    from .triton_indexer import index_scores_ref
    return index_scores_ref(q, w, keys, lens)


def index_scores_paged(q, w, keys, seq_of, row_in_seq, max_q, lens):
    """Batch form: query t against its sequence's keys [B, E, ID] (reference.index_scores_paged_ref);
    the Triton kernel reads each token's key range of the flattened pool (key_start)."""
    if use_fast(q):
        from .triton_indexer import index_scores as fast
        E = keys.shape[1]
        return fast(q, w, keys.flatten(0, 1), lens, key_start=seq_of * E, num_keys=E)
    return _ref.index_scores_paged_ref(q, w, keys, seq_of, row_in_seq, max_q, lens)


def hc_mixes_pre(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps):
    if use_fast(x) and x.shape[1] == 4 and x.shape[-1] % 64 == 0:   # the kernel reads 64-wide column chunks
        from .triton_mhc import hc_mixes_pre as fast
        return fast(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps)
    return _ref.hc_mixes_pre_ref(x, fn, scale, base, pre_prev, iters, hc_eps, norm_eps)


def hc_post(y, res, post, comb):
    if use_fast(y):
        from .triton_mhc import hc_post as fast
        return fast(y, res, post, comb)
    return _ref.hc_post_ref(y, res, post, comb)
