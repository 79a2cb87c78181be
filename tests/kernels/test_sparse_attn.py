import pytest
import torch

from deepinfer.kernels.reference import act_quant_ref, sparse_attn_ref

from kernel_utils import rel_err

pytestmark = pytest.mark.gpu


def _case(n, H, L, D=512, M=4096):
    """Random queries over FP8-rounded kv rows, a fifth of the list entries empty (-1) and query 1 with
    nothing to see."""
    q = torch.randn(n, H, D, device="cuda").bfloat16()
    kv = act_quant_ref(torch.randn(M, D, device="cuda").bfloat16())
    sink = torch.randn(H, device="cuda")
    idx = torch.randint(0, M, (n, L), device="cuda", dtype=torch.int32)
    idx[torch.rand(n, L, device="cuda") < 0.2] = -1
    if n > 1:
        idx[1] = -1
    return q, kv, sink, idx


@pytest.mark.parametrize("n,H,L", [(1, 64, 640), (64, 64, 640), (5, 64, 70), (3, 16, 1000), (2, 64, 64)])
def test_sparse_attn(n, H, L):
    from deepinfer.kernels.triton_sparse_attn import sparse_attn
    D = 512
    q, kv, sink, idx = _case(n, H, L, D)
    out = sparse_attn(q, kv, sink, idx, D ** -0.5)
    ref = sparse_attn_ref(q, kv, sink, idx, D ** -0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 4e-3


def test_sparse_attn_batch_invariant():
    from deepinfer.kernels.triton_sparse_attn import sparse_attn
    D, M, H, L = 512, 8192, 64, 640
    q = torch.randn(64, H, D, device="cuda").bfloat16()
    kv = torch.randn(M, D, device="cuda").bfloat16()
    sink = torch.randn(H, device="cuda")
    idx = torch.randint(0, M, (64, L), device="cuda", dtype=torch.int32)
    full = sparse_attn(q, kv, sink, idx, D ** -0.5)
    assert torch.equal(sparse_attn(q[:1], kv, sink, idx[:1], D ** -0.5), full[:1])
    assert torch.equal(sparse_attn(q[:16], kv, sink, idx[:16], D ** -0.5), full[:16])


def test_sparse_attn_sources_in_place():
    """The window ring, the fresh rows and the compressed pool read in place (a tuple of kv tensors)
    give the bits of the same rows concatenated, at decode shapes with splits."""
    from deepinfer.kernels.triton_sparse_attn import sparse_attn
    D, H, L, n = 512, 64, 640, 64
    kv = torch.randn(12000, D, device="cuda").bfloat16()
    q = torch.randn(n, H, D, device="cuda").bfloat16()
    sink = torch.randn(H, device="cuda")
    idx = torch.randint(-1, kv.shape[0], (n, L), device="cuda", dtype=torch.int32)
    full = sparse_attn(q, kv, sink, idx, D ** -0.5)
    assert torch.equal(sparse_attn(q, (kv[:8192], kv[8192:8256], kv[8256:]), sink, idx, D ** -0.5), full)
    assert torch.equal(sparse_attn(q, (kv[:100], kv[100:]), sink, idx, D ** -0.5), full)


def test_flashmla_v4_fits_window_kv():
    """FlashMLA (V4 584-B record) against the reference on window-style (FP8 per 32) KV: close, and
    how close is reported; compressed FP4 KV does not fit the record exactly (see flashmla.py)."""
    from deepinfer.kernels import flashmla
    if flashmla.load() is None:
        pytest.skip("FlashMLA not importable")
    D, M, H, L, b = 512, 4096, 64, 640, 8
    kv = act_quant_ref(torch.randn(M, D, device="cuda").bfloat16())
    cache = flashmla.pack_v4(kv)
    assert torch.equal(flashmla.unpack_v4(cache)[:M], kv) or rel_err(flashmla.unpack_v4(cache)[:M], kv) < 1e-3
    q = torch.randn(b, H, D, device="cuda").bfloat16()
    sink = torch.randn(H, device="cuda")
    idx = torch.randint(0, M, (b, L), device="cuda", dtype=torch.int32)
    out, _ = flashmla.sparse_decode(q, cache, idx, sink, D ** -0.5)
    ref = sparse_attn_ref(q, flashmla.unpack_v4(cache), sink, idx, D ** -0.5)
    err = rel_err(out, ref)
    print(f"flashmla vs reference rel err {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("n,H,L,pieces", [(300, 64, 640, 3), (512, 128, 70, 1), (257, 64, 1000, 2), (256, 64, 192, 2)])
def test_flashmla_sparse_prefill(n, H, L, pieces, monkeypatch):
    """Prefill-sized sparse attention through select on FlashMLA's sparse prefill kernel (lists padded to
    128, 192 among them: a multiple of 64 the kernel refuses; kv given in pieces, a query with nothing to
    see) against the reference, as the Triton kernel is."""
    from deepinfer.kernels import select
    if not select._flashmla_ok(0):
        pytest.skip("FlashMLA sparse prefill not importable on this GPU")
    monkeypatch.setattr(select, "SPARSE_PREFILL", "flashmla")
    D, M = 512, 4096
    q, kv, sink, idx = _case(n, H, L, D, M)
    cuts = [0, 1000, 3000, M][:pieces] + [M]
    src = tuple(kv[a:b] for a, b in zip(cuts, cuts[1:])) if pieces > 1 else kv
    assert select._flashmla_prefill_ok(q, src)
    out = select.sparse_attn(q, src, sink, idx, D ** -0.5)
    ref = sparse_attn_ref(q, kv, sink, idx, D ** -0.5)
    assert not torch.isnan(out).any()
    assert out[1].abs().max() == 0
    assert rel_err(out, ref) < 4e-3


@pytest.mark.parametrize("n,H,L,bps", [(64, 64, 640, 4), (64, 64, 640, None), (128, 64, 640, None), (3, 16, 1000, 4),
                                       (5, 64, 70, 4)])
def test_sparse_attn_unrope(n, H, L, bps):
    """The inverse RoPE in the store (unrope=cis, Attention.out's) gives triton_rope's bits on the output:
    the whole-list store and the combine kernel's, through select too."""
    from deepinfer.kernels import select, triton_rope
    from deepinfer.kernels.triton_sparse_attn import sparse_attn
    D = 512
    q, kv, sink, idx = _case(n, H, L, D)
    ang = torch.rand(n, 32, device="cuda") * 6.28
    cis = torch.polar(torch.ones_like(ang), ang)
    plain = sparse_attn(q, kv, sink, idx, D ** -0.5, blocks_per_split=bps)
    want = triton_rope.rope(plain.clone(), cis, inverse=True, inplace=True)
    got = sparse_attn(q, kv, sink, idx, D ** -0.5, blocks_per_split=bps, unrope=cis)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if bps is None:
        assert torch.equal(select.sparse_attn(q, kv, sink, idx, D ** -0.5, unrope=cis), got)
