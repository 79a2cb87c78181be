"""Hot ops behind one interface. Each op has a plain-torch reference (`<op>_ref` in reference.py);
fast device paths plug in here later and are chosen by device. The model binds these names only
through deepinfer/model/ops.py."""

from .reference import (  # noqa: F401
    act_quant_ref,
    dequant_fp4_ref,
    dequant_fp8_ref,
    e2m1_round,
    e8m0_to_float,
    fp4_quant_ref,
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

# The dispatched names: today every device gets the torch reference.
act_quant = act_quant_ref
fp4_quant = fp4_quant_ref
sparse_attn = sparse_attn_ref
hc_split_sinkhorn = hc_split_sinkhorn_ref
rope = rope_ref
index_scores_paged = index_scores_paged_ref
