"""Run under TRITON_INTERPRET=1 DEEPINFER_KERNELS=fast (CPU): kernels/triton_linear_fp32.py through
Triton's interpreter, one check per name. test_triton_linear_fp32.py runs this once and reports each
check as its own test.

    python tests/kernels/linear_fp32_checks.py [CHECK ...]     (prints one JSON line per check)
"""

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DEEPINFER_KERNELS") == "fast"

import torch  # noqa: E402

from deepinfer.kernels import select  # noqa: E402
from deepinfer.kernels import triton_linear_fp32 as tlf  # noqa: E402
from deepinfer.kernels.batch_invariant import batch_invariant_mode  # noqa: E402
from deepinfer.kernels.reference import linear_fp32_ref  # noqa: E402

# (M, N, K, cfg_override): the default config at the router's and the compressor's shapes and at
# ragged ones (N not a multiple of BN, M > MAX_M: two launches, K not a multiple of 128), plus the
# other code paths a launch can take (no split-K: straight into the output; unswapped; small tiles)
CASES = [
    (1, 384, 5120, None), (64, 384, 5120, None), (128, 512, 1280, None),   # the GPU tests take 128 x 512 x 5120
    (7, 100, 256, None), (130, 70, 96, None), (3, 1, 160, None),
    (5, 96, 512, dict(SPLIT_K=1)), (33, 96, 512, dict(SWAP=False)), (20, 130, 384, dict(BM=16, BK=32, SPLIT_K=5)),
]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def rand_case(m, n, k, seed):
    g = _gen(seed)
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    return x, w


def int_case(m, n, k, seed):
    """Small integers: every product and partial sum is an fp32 integer below 2^24, exact in any order."""
    g = _gen(seed)
    x = torch.randint(-8, 9, (m, k), generator=g).bfloat16()
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()
    assert 64 * k < 2 ** 24
    return x, w


def fp32_bound(x, w):
    """Worst-case fp32 summation error of K exact products in any order: (K - 1) u sum |x_i w_i|."""
    return (x.shape[-1] - 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)


def check_float64():
    """Random data within the fp32-accumulation bound of the float64 product (a bf16 output, a dropped
    or doubled K block or a missed row would be far outside it)."""
    for i, (m, n, k, ov) in enumerate(CASES):
        x, w = rand_case(m, n, k, seed=i)
        y = tlf.linear_fp32(x, w, ov)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        ref = x.double() @ w.double().T
        err = (y.double() - ref).abs()
        assert (err <= fp32_bound(x, w) + 1e-30).all(), (m, n, k, ov, err.max().item())
        assert err.max() > 0 or k < 512         # not vacuous: the sums do round


def check_exact():
    """Integer-valued data: equal to the float64 product bit for bit, and so are the split partials."""
    for i, (m, n, k, ov) in enumerate(CASES):
        x, w = int_case(m, n, k, seed=100 + i)
        ref = x.double() @ w.double().T
        y = tlf.linear_fp32(x, w, ov)
        assert torch.equal(y.double(), ref), (m, n, k, ov, (y.double() - ref).abs().max().item())
        if m <= tlf.MAX_M:
            ws = tlf.linear_fp32_partials(x, w, ov)
            cfg = dict(tlf.linear_fp32_config(n, k, x.device), **(ov or {}))
            assert ws.shape == (cfg["SPLIT_K"], m, n)
            assert torch.equal(ws.double().sum(0), ref), (m, n, k, ov)


def check_batch_invariant():
    """Row i alone (M = 1) equals row i of the M = 64 and M = 128 batches bit for bit, and a 300-row
    batch (three launches) equals its rows' own launches: tiles and splits never depend on M."""
    for n, k in ((384, 1280), (100, 256)):
        x, w = rand_case(300, n, k, seed=n)
        y64 = tlf.linear_fp32(x[:64], w)
        y128 = tlf.linear_fp32(x[:128], w)
        assert torch.equal(y128[:64], y64)
        for i in (0, 1, 37, 63):
            assert torch.equal(tlf.linear_fp32(x[i:i + 1], w), y64[i:i + 1]), (n, k, i)
        y300 = tlf.linear_fp32(x, w)
        assert torch.equal(y300[:128], y128)
        assert torch.equal(y300[200:203], tlf.linear_fp32(x[200:203], w))
        # the same rows in another order: each row's bits follow the row, not its position
        perm = torch.randperm(64, generator=_gen(1))
        assert torch.equal(tlf.linear_fp32(x[:64][perm], w), y64[perm])


def check_dispatch():
    """select.linear_fp32 (the model's ops.linear_fp32): the Triton path for bf16 operands with
    M <= 128 and N <= 8192, the reference otherwise (N past the limit as the LM head, M past it
    unless batch-invariant, fp32 weights); layers.linear_fp32 goes through it."""
    from deepinfer.model import layers
    calls = []
    real = tlf.linear_fp32
    tlf.linear_fp32 = lambda x, w, *a, **k: (calls.append(tuple(w.shape)), real(x, w, *a, **k))[1]
    try:
        def fast(x, w, fn=select.linear_fp32):
            calls.clear()
            y = fn(x, w)
            ref = linear_fp32_ref(x, w)
            assert y.shape == ref.shape and y.dtype == torch.float32
            return bool(calls)
        x, w = rand_case(70, 384, 256, seed=5)
        assert not fast(x, w)                                           # default: cuBLAS (faster on the H200)
        xb, _ = rand_case(129, 8, 256, seed=6)
        with batch_invariant_mode():                                    # invariant mode: Triton at any M
            assert fast(x, w) and fast(x[:1], w) and fast(x.view(7, 10, 256), w)
            assert fast(x, w, layers.linear_fp32)
            assert fast(xb, w)
            assert not fast(x[:4], rand_case(1, 8200, 256, seed=7)[1])  # N > 8192: the head's path
            assert not fast(x, w.float())                               # fp32 weight
            assert not fast(x[:, :200], rand_case(1, 384, 200, seed=8)[1])  # K % 16 != 0
        select.KERNELS = "ref"
        try:
            assert not fast(x, w)
        finally:
            select.KERNELS = "fast"
    finally:
        tlf.linear_fp32 = real


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


if __name__ == "__main__":
    for name in sys.argv[1:] or list(CHECKS):
        try:
            CHECKS[name]()
            print(json.dumps({"check": name, "ok": True}), flush=True)
        except Exception:  # noqa: BLE001
            print(json.dumps({"check": name, "ok": False, "error": traceback.format_exc()[-3000:]}), flush=True)
