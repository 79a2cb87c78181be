"""kernels/batch_invariant.py: row results independent of the batch (CPU torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels.batch_invariant import batch_invariant_mode


def _rows_differ(f, x, row=3, sizes=(1, 2, 7, 16, 33)) -> list[int]:
    """Batch sizes at which row `row` of f(batch) differs from f(that row alone)."""
    alone = f(x[row:row + 1])[0]
    bad = []
    for m in sizes:
        y = x[:max(m, 1)].clone()
        y[m // 2] = x[row]
        if not torch.equal(f(y)[m // 2], alone):
            bad.append(m)
    return bad


def test_plain_cpu_fp32_linear_is_not_batch_invariant():
    """The measured reason for the mode (MKL/oneDNN: GEMV at M=1, blocked GEMM otherwise)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1024, 256, generator=g), torch.randn(40, 256, generator=g)
    assert _rows_differ(lambda a: F.linear(a, w), x)


def test_linear_einsum_mm_bmm_invariant_in_mode():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 256, generator=g)
    x = torch.randn(40, 256, generator=g)
    keys = torch.randn(50, 64, generator=g)
    q = torch.randn(40, 4, 64, generator=g)
    wo = torch.randn(2, 8, 64, generator=g)
    o = torch.randn(40, 2, 64, generator=g)
    with torch.inference_mode(), batch_invariant_mode():
        assert not _rows_differ(lambda a: F.linear(a, w, None), x)
        assert not _rows_differ(lambda a: a @ w.T, x)
        assert not _rows_differ(lambda a: torch.addmm(torch.ones(1024), a, w.T), x)
        assert not _rows_differ(lambda a: torch.einsum("nhd,ed->nhe", a, keys), q)
        assert not _rows_differ(lambda a: torch.einsum("tgd,grd->tgr", a, wo), o)
        y = F.linear(x, w)
    assert torch.allclose(y, F.linear(x, w), atol=1e-4)   # same math, other rounding order


# each padded transcendental with inputs in its domain (kernels/batch_invariant._UNARY)
_ELEMENTWISE = {
    "sigmoid": torch.sigmoid, "exp": torch.exp, "log": lambda v: torch.log(v.abs() + 0.1),
    "rsqrt": lambda v: torch.rsqrt(v.abs() + 0.1), "sqrt": lambda v: torch.sqrt(v.abs()), "tanh": torch.tanh,
    "silu": F.silu, "expm1": torch.expm1, "log1p": lambda v: torch.log1p(v.abs()), "erf": torch.erf,
    "softplus": F.softplus, "softplus_beta": lambda v: F.softplus(v, beta=2.0, threshold=10.0),
    "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "pow": lambda v: v.abs() ** 1.5,
    "exp2": torch.exp2,
}


def _tail_dependent(f, x) -> list[int]:
    """Lengths n at which f(x[:n])'s last element differs from the same element of f(x): the element
    fell in the CPU kernel's scalar tail (other last-ulp transcendentals than its vectorized body)."""
    full = f(x)
    return [n for n in range(1, x.numel() + 1) if not torch.equal(f(x[:n])[n - 1], full[n - 1])]


def test_elementwise_transcendentals_do_not_depend_on_the_tensor_length_in_mode():
    """Whatever the CPU (which ops differ between a kernel's body and its tail depends on its vector units
    and libm: on an AVX-512 Xeon softplus, gelu, pow, exp2, sigmoid and silu did), every op the model uses
    gives an element the same bits at any tensor length inside the mode: a token's value does not depend on
    how many others share the step."""
    g = torch.Generator().manual_seed(5)
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        x = (torch.randn(200, generator=g) * 3).to(dt)
        for name, f in _ELEMENTWISE.items():
            with torch.inference_mode(), batch_invariant_mode():
                assert not _tail_dependent(f, x), (name, dt)
    # the mode's values are the plain op's (its vectorized body): same function, no other formula
    x = torch.randn(1000, generator=g)
    with torch.inference_mode(), batch_invariant_mode():
        y = F.softplus(x)
    assert torch.equal(y[:992], F.softplus(x)[:992])


def test_long_tensors_stay_invariant_with_several_threads():
    """Past torch's parallel grain each thread's share of an elementwise call ends in its own scalar tail,
    at a place set by the tensor's length; in the mode long tensors go in single-thread pieces."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(90_000, generator=g) * 3
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with torch.inference_mode(), batch_invariant_mode():
            full = F.softplus(x)
            for n in (40_001, 65_537, 77_777, 89_999):
                assert torch.equal(F.softplus(x[:n]), full[:n]), n
    finally:
        torch.set_num_threads(threads)
