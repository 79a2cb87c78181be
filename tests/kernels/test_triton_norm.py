"""kernels/triton_norm.py (rms_norm) and kernels/triton_rope.py (rope) against rms_norm_ref / rope_ref.

On the CPU the kernels run under Triton's interpreter in a subprocess (this file as a script: the
TRITON_INTERPRET switch must not leak into other tests). The interpreter truncates float->bf16 casts
where a GPU rounds, so bf16 outputs are checked to 1 bf16 ulp there; fp32 RoPE is exact.

    TRITON_INTERPRET=1 python tests/kernels/test_triton_norm.py
"""

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.kernels.reference import rms_norm_ref, rope_ref

NORM_DIMS = (512, 1024, 4096, 7168)
NORM_ROWS = (1, 3, 70)
# (x shape, rope_head_dim): attention q [T, H, D], kv / compressed latent [T, D], indexer q [T, IH, ID]
ROPE_SHAPES = (((5, 64, 512), 64), ((5, 512), 64), ((3, 8, 128), 64), ((70, 512), 64),
               ((9, 3, 96), 32), ((33, 12, 128), 64))   # rows that straddle tokens, H not a power of two


def _norm_case(rows, d, dtype, strided, device, seed):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(rows, 3 * d, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    big = big.to(device=device, dtype=dtype)
    x = big[:, d:2 * d] if strided else big[:, :d].contiguous()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device)
    return x, w


def _rope_case(shape, rd, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    ang = torch.rand(shape[0], rd // 2, generator=g) * 100
    return x, torch.polar(torch.ones_like(ang), ang).to(device)


def _within_bf16_ulp(y, ref, ulps=1):
    """|y - ref| <= ulps bf16 ulp of ref, elementwise (plus a hair for the fp32 reduction order)."""
    y, ref = y.float(), ref.float()
    return bool(((y - ref).abs() <= ulps * 2.0 ** -7 * ref.abs() * 1.001 + 1e-30).all())


def check_interpreted():
    from deepinfer.kernels.triton_norm import rms_norm
    from deepinfer.kernels.triton_rope import rope
    for d in NORM_DIMS:
        for rows in NORM_ROWS:
            for dtype in (torch.bfloat16, torch.float32):
                for strided in (False, True):
                    x, w = _norm_case(rows, d, dtype, strided, "cpu", seed=d + rows)
                    assert x.is_contiguous() != (strided and rows > 1)
                    y, ref = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
                    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
                    if dtype == torch.float32:
                        torch.testing.assert_close(y, ref, rtol=4e-7, atol=0)
                    else:
                        assert _within_bf16_ulp(y, ref), (d, rows, strided)
    x, w = _norm_case(4, 512, torch.bfloat16, False, "cpu", seed=1)
    assert _within_bf16_ulp(rms_norm(x.view(2, 2, 512), w.bfloat16(), 1e-20),
                            rms_norm_ref(x.view(2, 2, 512), w.bfloat16(), 1e-20))
    for shape, rd in ROPE_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for inverse in (False, True):
                x, cis = _rope_case(shape, rd, dtype, "cpu", seed=len(shape) + shape[-1])
                y, ref = rope(x, cis, inverse), rope_ref(x, cis, inverse)
                assert y.dtype == dtype and y.shape == x.shape
                assert torch.equal(y[..., :-rd], ref[..., :-rd])            # pass-through dims: copied
                if dtype == torch.float32:
                    assert torch.equal(y, ref), (shape, inverse)
                else:
                    assert _within_bf16_ulp(y, ref), (shape, inverse)
    from deepinfer.kernels import triton_rope
    for shape, rd in ROPE_SHAPES:                    # in place (bf16: the packed form): the same values in x
        for inverse in (False, True):
            x, cis = _rope_case(shape, rd, torch.bfloat16, "cpu", seed=7)
            want, nope = rope(x, cis, inverse), x[..., :-rd].clone()
            assert triton_rope._pairs_ok(x.reshape(shape[0], -1, shape[-1]), rd // 2)
            got = rope(x, cis, inverse, inplace=True)
            assert got.data_ptr() == x.data_ptr() and torch.equal(got, want) and torch.equal(x[..., :-rd], nope)
            y = _rope_case(shape, rd, torch.bfloat16, "cpu", seed=7)[0]
            triton_rope.PACKED = False                                         # the split form in place
            try:
                assert torch.equal(rope(y.clone(), cis, inverse, inplace=True), want)
            finally:
                triton_rope.PACKED = True
            odd = torch.empty(y.numel() + 1, dtype=y.dtype)[1:].view(shape)    # 2-byte aligned: declines
            odd.copy_(y)
            assert not triton_rope._pairs_ok(odd.reshape(shape[0], -1, shape[-1]), rd // 2)
            assert torch.equal(rope(odd, cis, inverse, inplace=True), want)
    q = torch.randn(4, 8, 2, 128)[:, :, 0]                                     # strided heads [4, 8, 128]
    _, cis = _rope_case((4, 128), 64, torch.float32, "cpu", seed=3)
    assert torch.equal(rope(q, cis, True), rope_ref(q, cis, True))
    print("ok")


def test_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_cpu_dispatch_is_the_reference():
    """Without the interpreter, ops on CPU tensors land on the references bit for bit."""
    from deepinfer.model import ops
    x, w = _norm_case(5, 512, torch.bfloat16, True, "cpu", seed=0)
    assert torch.equal(ops.rms_norm(x, w, 1e-20), rms_norm_ref(x, w, 1e-20))
    x, cis = _rope_case((5, 4, 512), 64, torch.bfloat16, "cpu", seed=0)
    assert torch.equal(ops.rope(x, cis, True), rope_ref(x, cis, True))


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", NORM_DIMS)
def test_rms_norm_gpu(d, dtype, strided):
    from deepinfer.kernels.triton_norm import rms_norm
    for rows in (1, 7, 64, 70, 1000):
        x, w = _norm_case(rows, d, dtype, strided, "cuda", seed=d + rows)
        y, ref = rms_norm(x, w, 1e-20), rms_norm_ref(x, w, 1e-20)
        if dtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)
        else:
            assert _within_bf16_ulp(y, ref)
            assert (y != ref).float().mean().item() < 0.01                # rare 1-ulp flips only


@pytest.mark.gpu
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,rd", ROPE_SHAPES + (((64, 64, 512), 64),))
def test_rope_gpu_bit_exact(shape, rd, dtype, inverse):
    from deepinfer.kernels.triton_rope import rope
    x, cis = _rope_case(shape, rd, dtype, "cuda", seed=shape[0])
    ref = rope_ref(x, cis, inverse)
    assert torch.equal(rope(x, cis, inverse), ref)
    got = rope(x, cis, inverse, inplace=True)                                  # only the rope dims touched
    assert got.data_ptr() == x.data_ptr() and torch.equal(got, ref)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_interpreted()
