"""Hot ops behind one interface. Each op has a plain-torch reference (`<op>_ref` in reference.py);
select.py picks the fast path per call (device, shape rules, batch-invariant mode) and falls back to
the reference with one log line. The model binds these names only through deepinfer/model/ops.py.

    reference.py            plain-torch references (the release's kernel semantics): what a CPU runs
    select.py               per-call dispatch, shape rules, declines, the measured FP8 pick table
    batch_invariant.py      row-by-row torch GEMMs and padded CPU transcendentals (batch_invariant=True)
    triton_*.py             Triton kernels for SM90: GEMMs (triton_gemm W8A16 / FP8, triton_fp8_prefill,
                            triton_fp8_variants, triton_moe_contiguous, triton_fp4_contiguous: the FP4
                            experts' prefill GEMM, triton_linear_fp32), attention
                            (triton_sparse_attn, triton_indexer, triton_topk, triton_lists), mHC, norm,
                            RoPE, quantization, the MoE glue and router, the Engram gate
    cuda/*.cu               CUDA C++ kernels (fp8_gemm_sm90.cu: the exact FP8 GEMM, warp-specialized)
    cuda_driver.py          nvcc at first use (cached cubins) + the driver API through ctypes
    cuda_fp8_gemm.py        the CUDA FP8 GEMM's Python side: shape rules, TMA maps, launch
    deepgemm.py, flashmla.py, optional.py
                            DeepSeek's SM90 libraries (bundled in the vllm wheel) behind our formats
"""

import os as _os

# The kernels' bit-exactness checks (GPU and sm_90 offline compiles) were written with Triton fusing a * b + c
# into FMAs, its default up to 3.9; Triton 3.10 turns that default off. Pin it so the same bits keep coming.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .reference import (  # noqa: F401,E402
    act_quant_ref,
    dequant_fp4_ref,
    hc_pre_ref,
    dequant_fp8_ref,
    e2m1_round,
    e8m0_to_float,
    fp4_quant_ref,
    fp4_unpack_rows_ref,
    hc_split_sinkhorn_ref,
    index_scores_paged_ref,
    index_topk_ref,
    pow2_ceil,
    rope_freqs_ref,
    rope_ref,
    sparse_attn_ref,
    topk_block_mask_ref,
    topk_ids_ref,
)

# The package-level names are the references; select.py holds the dispatched ones.
act_quant = act_quant_ref
fp4_quant = fp4_quant_ref
sparse_attn = sparse_attn_ref
hc_split_sinkhorn = hc_split_sinkhorn_ref
rope = rope_ref
index_scores_paged = index_scores_paged_ref
