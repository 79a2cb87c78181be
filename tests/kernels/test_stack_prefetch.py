"""The expert-stack prefetcher's bookkeeping (kernels/stack_prefetch.py) on the CPU, where it dequantizes
inline: what a take returns, and that a slot overwritten by a newer prefetch no longer answers for its
older tensor. The side-stream ordering itself needs a GPU (DEEPINFER_MOE_PREFETCH=1 there)."""

import pytest
import torch

from deepinfer.kernels.select import dequant_fp8
from deepinfer.kernels.stack_prefetch import StackPrefetcher


def _stack(seed, e=3, n=64, k=96):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) * 0.1).to(torch.float8_e4m3fn)
    s = torch.randint(118, 124, (e, n // 32, k // 32), generator=g, dtype=torch.uint8)
    return w, s


def _exact(w, s):
    return torch.stack([dequant_fp8(w[i], s[i]) for i in range(w.shape[0])]).bfloat16()


def test_prefetch_take_and_slot_reuse():
    calls = []

    def deq(w2d, s2d, out):
        calls.append(w2d.shape)
        out.copy_(dequant_fp8(w2d, s2d).bfloat16())
        return out

    p = StackPrefetcher(deq)
    a, b, c = _stack(0), _stack(1), _stack(2)
    assert p.take(a[0]) is None                                     # nothing prefetched yet
    p.prefetch(*a)
    assert torch.equal(p.take(a[0]), _exact(*a))
    p.prefetch(*b)                                                  # the other slot: a still answers
    assert torch.equal(p.take(a[0]), _exact(*a)) and torch.equal(p.take(b[0]), _exact(*b))
    p.prefetch(*c)                                                  # a's slot again: a is gone
    assert p.take(a[0]) is None
    assert torch.equal(p.take(b[0]), _exact(*b)) and torch.equal(p.take(c[0]), _exact(*c))
    other = _stack(3, n=32)                                         # another shape: its own two slots
    p.prefetch(*other)
    assert torch.equal(p.take(other[0]), _exact(*other)) and torch.equal(p.take(c[0]), _exact(*c))
    assert len(calls) == 4
    same_values = a[0].clone()                                      # equal values, another tensor: no answer
    assert p.take(same_values) is None


def test_link_next_moe_points_along_the_backbone(tiny_checkpoint):
    """A real FP8-stack load (weight_format="fp8" on the CPU): each backbone MoE layer points weakly at the
    next one; the DSpark blocks stay out; no submodule is added."""
    from deepinfer.model.loader import load_model
    from deepinfer.model.moe import MoE
    model = load_model(tiny_checkpoint, "cpu", progress=False, weight_format="fp8")
    moes = [b.ffn for b in model.layers if isinstance(b.ffn, MoE)]
    assert len(moes) >= 3 and all(m.stacks is not None for m in moes)
    for a, b in zip(moes, moes[1:]):
        assert a.next_moe() is b
    assert moes[-1].next_moe is None
    assert all(getattr(b.ffn, "next_moe", None) is None for b in model.mtp)
    assert not any(isinstance(c, MoE) for m in moes for c in m.children())   # weakrefs, not submodules


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetched_stacks_give_the_same_bits_on_cuda(tiny_checkpoint, monkeypatch):
    """The backbone's MoE layers in order on the bf16 grouped path, each dequantizing the next one's
    stacks on the side stream: the same bits as dequantizing inline, over two passes (the second takes
    stacks prefetched in the first where their slots still hold them)."""
    from deepinfer.kernels import select
    from deepinfer.model.loader import load_model
    from deepinfer.model.moe import MoE
    model = load_model(tiny_checkpoint, "cuda", progress=False, weight_format="fp8")
    moes = [b.ffn for b in model.layers if isinstance(b.ffn, MoE)]
    for m in moes:
        m.masked = False
    monkeypatch.setattr(select, "BF16_MOE_MIN_ROWS", 1)
    x = torch.randn(300, moes[0].dim, device="cuda").bfloat16()

    def run():
        outs, h = [], x
        for _ in range(2):
            for m in moes:
                h = m(h)
                outs.append(h.clone())
        return outs

    with torch.inference_mode():
        monkeypatch.setattr(select, "MOE_PREFETCH", False)
        want = run()
        monkeypatch.setattr(select, "MOE_PREFETCH", True)
        got = run()
        taken = sum(select._stack_prefetcher().take(m.stacks.masked_weights()[0]) is not None for m in moes)
    assert taken >= 1
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), i
