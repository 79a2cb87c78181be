import pytest
import torch

from deepinfer.kernels.reference import fp4_quant_ref, hc_split_sinkhorn_ref

from kernel_utils import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,d", [(1, 5120), (64, 5120), (300, 5120), (2048, 256)])
def test_hc_mixes_pre(T, d):
    """T >= 1024 takes BT=64 (once out of shared memory on the H200: the small preset's prefill)."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre, hc_mixes_pre_ref
    hc = 4
    x = torch.randn(T, hc, d, device="cuda").bfloat16()
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.3
    pre_prev = torch.rand(T, hc, device="cuda")
    out = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    ref = hc_mixes_pre_ref(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    for a, b in zip(out[:3], ref[:3]):
        assert (a - b).abs().max().item() < 1e-4
    assert rel_err(out[3], ref[3]) < 1e-3


def test_hc_mixes_pre_batch_invariant_rows():
    """batch_invariant: a token's outputs are the same bits in a 17-token call and a 1,317-token one
    (the default mode's taller tile at T >= 1,024 changes them)."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre
    hc, d, T = 4, 256, 1317
    x = torch.randn(T, hc, d, device="cuda").bfloat16()
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.3
    pre_prev = torch.rand(T, hc, device="cuda")
    whole = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, batch_invariant=True)
    part = hc_mixes_pre(x[:17], fn, scale, base, pre_prev[:17], 20, 1e-6, 1e-20, batch_invariant=True)
    for a, b in zip(whole, part):
        assert torch.equal(a[:17], b)


@pytest.mark.parametrize("T", [1, 64, 1500])
def test_hc_mixes_pre_mean_tap(T):
    """mean=True: the same four outputs, plus x.mean(dim=1) (the DSpark tap) bit for bit."""
    from deepinfer.kernels.triton_mhc import hc_mixes_pre
    hc, d = 4, 5120
    x = torch.randn(T, hc, d, device="cuda").bfloat16()
    fn = torch.randn(24, hc * d, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.3
    pre_prev = torch.rand(T, hc, device="cuda")
    plain = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20)
    *same, mean = hc_mixes_pre(x, fn, scale, base, pre_prev, 20, 1e-6, 1e-20, mean=True)
    for a, b in zip(same, plain):
        assert torch.equal(a, b)
    assert torch.equal(mean, x.mean(dim=1))


def test_sinkhorn_and_post():
    from deepinfer.kernels.triton_mhc import hc_post, hc_post_ref, hc_split_sinkhorn
    mixes = torch.randn(100, 24, device="cuda")
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
    for a, b in zip(hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6),
                    hc_split_sinkhorn_ref(mixes, scale, base, 4, 20, 1e-6)):
        assert (a - b).abs().max().item() < 1e-5
    T, d = 64, 5120
    y = torch.randn(T, d, device="cuda").bfloat16()
    res = torch.randn(T, 4, d, device="cuda").bfloat16()
    _, post, comb = hc_split_sinkhorn_ref(torch.randn(T, 24, device="cuda"), scale, base, 4, 20, 1e-6)
    assert rel_err(hc_post(y, res, post, comb), hc_post_ref(y, res, post, comb)) < 1e-3


@pytest.mark.parametrize("n,E", [(1, 4096), (64, 2048), (3, 333)])
def test_index_scores(n, E):
    from deepinfer.kernels.triton_indexer import index_scores, index_scores_ref
    q = fp4_quant_ref(torch.randn(n, 32, 128, device="cuda").bfloat16(), 32)
    k = fp4_quant_ref(torch.randn(E, 128, device="cuda").bfloat16(), 32)
    w = (torch.randn(n, 32, device="cuda") * 0.02).bfloat16()
    lens = torch.randint(1, E + 1, (n,), device="cuda")
    out, ref = index_scores(q, w, k, lens), index_scores_ref(q, w, k, lens)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin)
    assert rel_err(out[fin], ref[fin]) < 5e-3
    # the top-k picks agree (ties aside)
    kk = min(512, E)
    a = out.float().topk(kk, -1).values
    b = ref.float().topk(kk, -1).values
    assert rel_err(a[torch.isfinite(b)], b[torch.isfinite(b)]) < 5e-3


@pytest.mark.parametrize("B,E", [(1, 4096), (64, 2048), (3, 333)])
def test_index_scores_pool_reads_keys_in_place(B, E):
    """select.index_scores_pool: keys read through a row table (the model's decode path) give the
    bits of the same kernel on the gathered [B, E, ID] copy, and the reference's values."""
    from deepinfer.kernels.reference import index_scores_paged_ref
    from deepinfer.kernels.triton_indexer import index_scores
    pool = fp4_quant_ref(torch.randn(B * E + 7, 128, device="cuda").bfloat16(), 32)
    rows = torch.randperm(B * E + 7, device="cuda")[:B * E].view(B, E)
    q = fp4_quant_ref(torch.randn(B, 32, 128, device="cuda").bfloat16(), 32)
    w = (torch.randn(B, 32, device="cuda") * 0.02).bfloat16()
    lens = torch.randint(1, E + 1, (B,), device="cuda")
    seq_of = torch.arange(B, device="cuda")
    paged = index_scores(q, w, pool, lens, key_start=seq_of * E, num_keys=E, rows=rows.flatten())
    gathered = index_scores(q, w, pool[rows].flatten(0, 1), lens, key_start=seq_of * E, num_keys=E)
    assert torch.equal(paged, gathered)
    ref = index_scores_paged_ref(q, w, pool[rows], seq_of, torch.zeros_like(seq_of), 1, lens)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(paged), fin)
    assert rel_err(paged[fin], ref[fin]) < 5e-3
