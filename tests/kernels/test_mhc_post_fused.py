"""kernels/triton_mhc.py hc_post_mixes_pre (hc_post fused with the next sublayer's hc_mixes_pre) against
the two calls it replaces, bit for bit, and against the torch reference.

On the CPU the kernels run under Triton's interpreter in a subprocess (this file as a script: the
TRITON_INTERPRET switch must not leak into other tests); on a GPU (-m gpu) at the model's width. The
interpreter truncates float->bf16 casts where a GPU rounds, so x is checked against the reference to
1 bf16 ulp there and the mixes against the reference applied to the kernel's own x.

    TRITON_INTERPRET=1 python tests/kernels/test_mhc_post_fused.py
"""

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.kernels.reference import hc_mixes_pre_ref, hc_post_mixes_pre_ref, hc_post_ref, hc_split_sinkhorn_ref

from kernel_utils import rel_err

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20
# d % 64 == 0, and 192 / 320 not multiples of 128 (bk 64); 1,100 tokens cross the T >= 1,024 prefill variant
SMALL = [(T, d) for T in (1, 5, 64, 70) for d in (64, 128, 192, 320)]
LARGE = [(1100, 64, True, False), (1100, 192, False, True)]
MODES = [(False, False), (True, True), (False, True), (True, False)]    # (mean, batch_invariant)
# launch keywords where a program walks several column chunks (d 256, bk 64: four chunks)
VARIANTS = [{"bk": 64, "chunks_per_program": 2, "num_stages": 2, "dot": "tf32x3"},
            {"bt": 32, "bk": 64, "chunks_per_program": 4, "dot": "bf16x3"}]


def _case(T, d, device, seed=0):
    """The attention's output a [T, d], its residual res [T, 4, d] (bf16), post / comb from a Sinkhorn
    pass, and the FFN's mixes weights with the attention's pre-mix (the next collapse's weights)."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(T, d, device=device, generator=g).bfloat16()
    res = torch.randn(T, 4, d, device=device, generator=g).bfloat16()
    sc = torch.rand(3, device=device, generator=g) + 0.5
    _, post, comb = hc_split_sinkhorn_ref(torch.randn(T, 24, device=device, generator=g), sc,
                                          torch.randn(24, device=device, generator=g) * 0.3, 4, ITERS, HC_EPS)
    fn = torch.randn(24, 4 * d, device=device, generator=g) * 0.05 * (256 / d) ** 0.5
    scale = torch.rand(3, device=device, generator=g) + 0.5
    base = torch.randn(24, device=device, generator=g) * 0.3
    return (a, res, post, comb, fn, scale, base, torch.rand(T, 4, device=device, generator=g))


def _two_calls(tm, case, mean, batch_invariant, **kw):
    """What Block.forward ran before the fusion: hc_post, then hc_mixes_pre on its output."""
    a, res, post, comb, fn, scale, base, pre_prev = case
    x = tm.hc_post(a, res, post, comb)
    return (x,) + tm.hc_mixes_pre(x, fn, scale, base, pre_prev, ITERS, HC_EPS, NORM_EPS, mean, batch_invariant, **kw)


def _fused(tm, case, mean, batch_invariant, **kw):
    return tm.hc_post_mixes_pre(*case, ITERS, HC_EPS, NORM_EPS, mean, batch_invariant, **kw)


def _assert_same(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (what, i)


def _assert_near_reference(got, case, mean):
    """x within 1 bf16 ulp of hc_post_ref (the interpreter truncates); the mixes, the collapse and the mean
    as the mHC tests check hc_mixes_pre, against the reference on the kernel's own x."""
    a, res, post, comb, fn, scale, base, pre_prev = case
    x = got[0]
    want = hc_post_ref(a, res, post, comb).float()
    assert ((x.float() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all()
    ref = hc_mixes_pre_ref(x, fn, scale, base, pre_prev, ITERS, HC_EPS, NORM_EPS, mean)
    for g, w in zip(got[1:4], ref[:3]):
        assert (g - w).abs().max() < 1e-5
    for g, w in zip(got[4:], ref[3:]):
        assert rel_err(g, w) < 1e-2


def _interpret_checks():
    """Under TRITON_INTERPRET=1 (CPU; run by the test below)."""
    from deepinfer.kernels import triton_mhc as tm
    for i, (T, d) in enumerate(SMALL):
        case = _case(T, d, "cpu", seed=i)
        # every mode at T < 64; from T 64 (the interpreter's time grows with T) two per shape, each flag
        # on in one and off in the other
        for mean, bi in MODES if T < 64 else MODES[2 * (i % 2):2 * (i % 2) + 2]:
            got = _fused(tm, case, mean, bi)
            _assert_same(got, _two_calls(tm, case, mean, bi), (T, d, mean, bi))
            _assert_near_reference(got, case, mean)
    for T, d, mean, bi in LARGE:
        case = _case(T, d, "cpu")
        got = _fused(tm, case, mean, bi)
        _assert_same(got, _two_calls(tm, case, mean, bi), (T, d, mean, bi))
        _assert_near_reference(got, case, mean)
        if bi:      # a token's bits do not depend on the tokens beside it
            part = _fused(tm, tuple(t[:17] if t.shape[:1] == (T,) else t for t in case), mean, bi)
            assert all(torch.equal(w[:17], p) for w, p in zip(got, part)), (T, d)
    for kw in VARIANTS:
        case = _case(70, 256, "cpu")
        _assert_same(_fused(tm, case, True, False, **kw), _two_calls(tm, case, True, False, **kw), kw)
    empty = _fused(tm, _case(0, 64, "cpu"), True, False)
    assert [tuple(t.shape) for t in empty] == [(0, 4, 64), (0, 4), (0, 4), (0, 4, 4), (0, 64), (0, 64)]
    print("ok")


def test_hc_post_mixes_pre_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("T", [64, 2048, 8192])
def test_hc_post_mixes_pre_gpu(T, mean, batch_invariant):
    """At the model's width: the two fast calls' bits (the same tiles, chunks, dot and FMA pattern; the x
    tile read back after the CTA barrier), and the reference's values as tight as the mHC tests hold
    the two calls."""
    from deepinfer.kernels import triton_mhc as tm
    case = _case(T, 5120, "cuda")
    got = _fused(tm, case, mean, batch_invariant)
    _assert_same(got, _two_calls(tm, case, mean, batch_invariant), (T, mean, batch_invariant))
    a, res, post, comb, fn, scale, base, pre_prev = case
    assert rel_err(got[0], hc_post_ref(a, res, post, comb)) < 1e-3
    # the mixes on the kernel's own x: a 1-ulp rounding difference in x moves them past 1e-4
    ref = hc_mixes_pre_ref(got[0], fn, scale, base, pre_prev, ITERS, HC_EPS, NORM_EPS, mean)
    for g, w in zip(got[1:4], ref[:3]):
        assert (g - w).abs().max().item() < 1e-4
    for g, w in zip(got[4:], ref[3:]):
        assert rel_err(g, w) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kw", VARIANTS + [{"bt": 128, "bk": 64, "num_warps": 8, "chunks_per_program": 2,
                                            "num_stages": 2, "dot": "bf16x3"}], ids=str)
def test_hc_post_mixes_pre_variants_gpu(kw):
    """Programs that walk several chunks, pipelined (num_stages 2): the mixes' loads wait for the barrier."""
    from deepinfer.kernels import triton_mhc as tm
    case = _case(1100, 5120, "cuda")
    _assert_same(_fused(tm, case, False, False, **kw), _two_calls(tm, case, False, False, **kw), kw)


def test_select_falls_back_to_the_two_calls_on_cpu():
    """On a CPU the dispatcher is the references' composition, which is the two dispatched calls."""
    from deepinfer.kernels import select
    case = _case(9, 96, "cpu")
    for mean in (False, True):
        got = select.hc_post_mixes_pre(*case, ITERS, HC_EPS, NORM_EPS, mean)
        x = select.hc_post(*case[:4])
        _assert_same(got, (x,) + select.hc_mixes_pre(x, *case[4:], ITERS, HC_EPS, NORM_EPS, mean), mean)
        _assert_same(got, hc_post_mixes_pre_ref(*case, ITERS, HC_EPS, NORM_EPS, mean), mean)


def _unfused_forward(layer, x, pre_mix, attn_fn, tap):
    """Block.forward as it was before the fusion (hc_post, then the FFN's mixes_pre)."""
    from deepinfer.model import ops
    a_pre, a_post, a_comb, xa, *mean = layer.mixes_pre(x, "attn", pre_mix, tap is not None)
    if tap is not None:
        tap.append(mean[0])
    a = attn_fn(layer.attn_norm(xa))
    x1 = ops.hc_post(a, x, a_post, a_comb)
    f_pre, f_post, f_comb, xf = layer.mixes_pre(x1, "ffn", a_pre)
    y = layer.ffn(layer.ffn_norm(xf), None)
    return ops.hc_post(y, x1, f_post, f_comb), f_pre


def test_block_forward_unchanged_by_the_fusion(tiny_model):
    """The tiny preset's blocks on the CPU (references): the fused Block.forward gives the unfused bits,
    the DSpark tap included."""
    torch.manual_seed(0)
    d, hc = tiny_model.args.dim, tiny_model.args.hc_mult
    w = torch.randn(d, d) / d ** 0.5
    attn_fn = lambda xn: (xn.float() @ w).bfloat16()     # noqa: E731  (a stand-in attention: no caches)
    x = torch.randn(11, hc, d).bfloat16()
    pre = torch.softmax(torch.randn(11, hc), -1)
    for layer in tiny_model.layers:
        tap, want_tap = [], []
        got = layer(x, pre, attn_fn, tap=tap)
        want = _unfused_forward(layer, x, pre, attn_fn, want_tap)
        _assert_same(got, want, layer.layer_id)
        _assert_same(tap, want_tap, layer.layer_id)
        x, pre = got


if __name__ == "__main__":
    _interpret_checks()
