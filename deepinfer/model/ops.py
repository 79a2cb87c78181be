"""The one place the model binds kernels (deepinfer.kernels); swap an implementation here.

The hot ops come from kernels/select.py: per call, the Triton fast path for CUDA tensors on a GPU of
compute capability >= 8.9 (perf/H200_NOTES.md; validated end to end on the bf16 fixture by
tests/kernels/test_model_fast_path.py), the torch reference otherwise, so the CPU runs exactly the
references. Weight formats (FP8 linears, FP4 experts) stay as the loader made them.
"""

from deepinfer.kernels import (  # noqa: F401
    dequant_fp4_ref as dequant_fp4,
    hc_pre_ref as hc_pre,
    e8m0_to_float,
    fp4_unpack_rows_ref as fp4_unpack_rows,
    rope_freqs_ref as rope_freqs,
    topk_ids_ref as topk_ids,
)
from deepinfer.kernels.grouped_rows import GroupedRows  # noqa: F401
from deepinfer.kernels.select import (  # noqa: F401
    act_quant,
    candidate_blocks,
    carry_write,
    compress_pool,
    dense_linear,
    dequant_fp8,
    engram_gate,
    engram_rows,
    fp4_quant,
    fp4_to_fp8_weight,
    fp8_decode_linear,
    fp8_decode_takes,
    fp8_linear,
    fp8_masked_moe_gemm,
    grouped_contiguous_ok,
    grouped_fp8_linear_contiguous,
    grouped_fp8_linear_masked,
    grouped_mm_token_major,
    grouped_takes_fp8,
    grouped_w8a16,
    hc_mixes_pre,
    hc_pre_norm,
    hc_post,
    hc_split_sinkhorn,
    index_scores_paged,
    index_scores_pool,
    index_topk,
    linear_fp32,
    masked_moe_fp8_takes,
    masked_moe_w4a8_takes,
    moe_combine,
    moe_dispatch,
    moe_route,
    moe_swiglu_quant,
    ngram_hash,
    norm_rope_quant,
    pool_lists,
    rms_norm,
    rms_norm_quant,
    rope,
    rope_fp4_quant,
    router_topk,
    row_scaled_fp8_weight,
    sparse_attn,
    sparse_attn_in_place,
    sparse_prefill_gathers,
    swiglu_quant,
    topk_block_mask,
    w4a8_masked_moe_gemm,
    window_pool,
)
