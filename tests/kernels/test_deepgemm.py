"""DeepGEMM with our formats mapped onto its 1x128 / 128x128 scales: how far it lands from the
exact (per-32) reference, next to the Triton path."""

import pytest
import torch

from deepinfer.kernels.reference import act_quant_ref, dequant_fp8_ref

from kernel_utils import rand_fp8_weight, rel_err

pytestmark = pytest.mark.gpu


def test_deepgemm_mapping_close_to_reference():
    from deepinfer.kernels import deepgemm
    from deepinfer.kernels.reference import e8m0_to_float
    from deepinfer.kernels.triton_quant import act_quant_fp8
    if deepgemm.load() is None:
        pytest.skip("DeepGEMM not importable")
    n, k, m = 4096, 5120, 64
    w, s = rand_fp8_weight(n, k, "cuda")
    w128, s128, changed = deepgemm.reblock_weight_128(w, e8m0_to_float(s))
    x = torch.randn(m, k, device="cuda").bfloat16()
    q, sa = act_quant_fp8(x)
    q128, sa128 = deepgemm.act_reblock_128(q, sa)
    y = deepgemm.fp8_gemm_nt(q128, sa128, w128, s128)
    ref = torch.nn.functional.linear(act_quant_ref(x).float(), dequant_fp8_ref(w, s)).bfloat16()
    err = rel_err(y, ref)
    print(f"deepgemm 128-reblocked vs exact reference: rel err {err:.2e}, weight elements moved {changed}")
    assert err < 5e-3
