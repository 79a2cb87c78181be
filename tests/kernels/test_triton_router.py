"""kernels/triton_router.py (the MoE router after its GEMM) against reference.router_topk_ref on the GPU,
bit for bit, and that reference against the torch chain moe.py Gate.forward ran (torch.topk, .sum).
The CPU side: tests/kernels/interpret_checks.py check_router_topk (Triton's interpreter)."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.reference import router_topk_ref

pytestmark = pytest.mark.gpu

K, SCALE = 6, 1.5


def _ulps(a, b) -> int:
    """Largest distance in fp32 steps between same-signed a and b (0 for empty)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max().item() if a.numel() else 0


def _chain(logits, bias, topk, temp, route_scale, norm, bias_alt=None, alt_mask=None):
    """Gate.forward's torch ops after its GEMM, as they were before router_topk."""
    scores = F.softplus(logits / temp).sqrt()
    if alt_mask is not None:
        bias = torch.where(alt_mask[:, None], bias_alt, bias)
    indices = (scores + bias).topk(topk, dim=-1)[1]
    weights = scores.gather(1, indices)
    if norm and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, indices, scores + bias


def _case(T, E, seed, quantized=False):
    """logits [T, E], bias, bias_alt [E], alt_mask [T] on CUDA; quantized: few distinct values (ties)."""
    g = torch.Generator().manual_seed(seed)
    if quantized:
        logits = torch.randint(-3, 4, (T, E), generator=g) * 0.5
        bias = torch.randint(0, 3, (E,), generator=g) * 0.25
    else:
        logits = torch.randn(T, E, generator=g) * 2
        bias = torch.randn(E, generator=g) * 0.1
    bias_alt = torch.randn(E, generator=g) * 0.1
    alt_mask = torch.rand(T, generator=g) < 0.5
    return [t.cuda() for t in (logits.float(), bias.float(), bias_alt, alt_mask)]


def _variants(bias_alt, alt_mask):
    for temp in (1.0, 1.3):                          # 1.3: torch's CUDA multiplies by fl(1 / 1.3)
        for norm in (True, False):
            for kw in ({}, dict(bias_alt=bias_alt, alt_mask=alt_mask)):
                yield temp, norm, kw


@pytest.mark.parametrize("E", [48, 256, 384])
@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_router_matches_reference(T, E):
    from deepinfer.kernels.triton_router import router_topk
    logits, bias, bias_alt, alt_mask = _case(T, E, seed=1000 * T + E)
    for temp, norm, kw in _variants(bias_alt, alt_mask):
        w, i = router_topk(logits, bias, K, temp, SCALE, norm, **kw)
        rw, ri = router_topk_ref(logits, bias, K, temp, SCALE, norm, **kw)
        assert torch.equal(i, ri), (T, E, temp, norm, bool(kw))
        assert torch.equal(w, rw), (T, E, temp, norm, bool(kw), _ulps(w, rw))
        # the reference = the old chain: the same picks in the same order where no two of a row's
        # k + 1 largest values tie; the same weights without norm. With norm, torch's .sum adds the 6
        # in its own order: each order is within 5 roundings (2^-24 each) of the exact sum of positive
        # terms, so the sums within 10, the quotients within 12 (measured on CPU: 4 ulp of the weight
        # at most, 0.2% of weights more than 2, so a 2-ulp bound would fail now and then)
        cw, ci, v = _chain(logits, bias, K, temp, SCALE, norm, **kw)
        top = v.topk(K + 1, dim=-1).values
        free = (top[:, :-1] > top[:, 1:]).all(-1)
        assert free.float().mean() > 0.9
        assert torch.equal(ri[free], ci[free]), (T, E, temp, norm, bool(kw))
        rw, cw = rw[free], cw[free]
        if norm:
            assert ((rw - cw).abs() <= 12 * 2.0 ** -24 * cw).all(), (T, E, temp, _ulps(rw, cw))
        else:
            assert torch.equal(rw, cw), (T, E, temp, bool(kw), _ulps(rw, cw))


@pytest.mark.parametrize("E", [48, 384])
def test_router_ties(E):
    """Quantized logits and bias: every row full of exact ties, broken toward the lower id; the output
    by descending value, equal values in ascending id."""
    from deepinfer.kernels.triton_router import router_topk
    T = 64
    logits, bias, bias_alt, alt_mask = _case(T, E, seed=E, quantized=True)
    for temp, norm, kw in _variants(bias_alt, alt_mask):
        w, i = router_topk(logits, bias, K, temp, SCALE, norm, **kw)
        rw, ri = router_topk_ref(logits, bias, K, temp, SCALE, norm, **kw)
        assert torch.equal(i, ri) and torch.equal(w, rw), (E, temp, norm, bool(kw))
        b = torch.where(alt_mask[:, None], bias_alt, bias) if kw else bias.expand(T, E)
        v = (F.softplus(logits / temp).sqrt() + b).gather(1, i)
        kth = v[:, -1:]
        assert ((v[:, :-1] > v[:, 1:]) | ((v[:, :-1] == v[:, 1:]) & (i[:, :-1] < i[:, 1:]))).all()
        # nothing left out beats the k-th pick, or ties it with a lower id
        full = F.softplus(logits / temp).sqrt() + b
        left = torch.ones_like(full, dtype=torch.bool).scatter_(1, i, False)
        ids = torch.arange(E, device="cuda").expand(T, E)
        assert not (left & ((full > kth) | ((full == kth) & (ids < i[:, -1:])))).any()


def test_router_extremes():
    """Over the softplus threshold (x > 20: softplus = x), exp in the denormals (x < -87: scores
    ~1e-20, where the 1e-20 of the normalization counts), and a strided logits view."""
    from deepinfer.kernels.triton_router import router_topk
    T, E = 16, 384
    g = torch.Generator().manual_seed(3)
    base = torch.randn(T, E + 64, generator=g) * 2
    base[:4, :E] = 15 + 20 * torch.rand(4, E, generator=g)                  # around the threshold
    base[4:8, :E] = -90 - 20 * torch.rand(4, E, generator=g)                # exp(-87 .. -110): denormal / 0
    base[8, :E] = -200.0                                                    # exp underflows: all scores 0
    logits = base.cuda()[:, :E]                                             # row stride E + 64
    bias = (torch.randn(E, generator=g) * 1e-3).cuda()
    for temp, norm, kw in _variants(bias, torch.zeros(T, dtype=torch.bool, device="cuda")):
        w, i = router_topk(logits, bias, K, temp, SCALE, norm, **kw)
        rw, ri = router_topk_ref(logits, bias, K, temp, SCALE, norm, **kw)
        assert torch.equal(i, ri), (temp, norm)
        assert torch.equal(w, rw), (temp, norm, _ulps(w, rw))


def test_router_dispatch():
    """select.router_topk (the name deepinfer/model/ops.py binds) runs the kernel on CUDA tensors."""
    from deepinfer.kernels import select
    from deepinfer.kernels.triton_router import router_topk
    from deepinfer.model import ops
    assert ops.router_topk is select.router_topk
    logits, bias, bias_alt, alt_mask = _case(5, 48, seed=9)
    a = select.router_topk(logits, bias, K, 1.0, SCALE, True, bias_alt, alt_mask)
    b = router_topk(logits, bias, K, 1.0, SCALE, True, bias_alt, alt_mask)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    w, i = select.router_topk(logits[:0], bias, K, 1.0, SCALE, True)
    assert w.shape == (0, K) and i.shape == (0, K)
