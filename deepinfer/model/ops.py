"""The one place the model binds kernels (deepinfer.kernels); swap an implementation here."""

from deepinfer.kernels import (  # noqa: F401
    act_quant,
    dequant_fp4_ref as dequant_fp4,
    dequant_fp8_ref as dequant_fp8,
    e8m0_to_float,
    fp4_quant,
    hc_split_sinkhorn,
    index_scores_paged,
    rope,
    rope_freqs_ref as rope_freqs,
    sparse_attn,
)
