"""kernels/triton_topk.py (index_topk, topk_block_mask, candidate_blocks) against their references,
bit for bit (integer outputs: torch.equal, no tolerance).

On the CPU the kernel runs under Triton's interpreter in a subprocess (this file as a script: the
TRITON_INTERPRET switch must not leak into other tests). The cases aim at the selection rule's
corners: heavy ties at the k-th value (so the lowest-id tie break decides), -0.0 next to +0.0, rows
all -inf, rows with fewer than k finite entries, lens below / at / past the width, candidate masks,
non-power-of-two widths, strided rows.

    TRITON_INTERPRET=1 python tests/kernels/test_triton_topk.py
"""

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.kernels.reference import index_topk_ref, topk_block_mask_ref

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _rows(n, width, dtype, kind, device, seed):
    """[n, width] scores. kind: 'rand' (distinct-ish), 'ties' (small integers, signed zeros, -inf
    runs, one all -inf row, one all-equal row), 'ulps' (+-(1 + i ulp), i < 16: ties that differ
    in the last mantissa bits), 'real' (indexer-like positive bf16 values)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "rand":
        x = torch.randn(n, width, generator=g) * torch.exp(2 * torch.randn(n, 1, generator=g))
    elif kind == "ties":
        x = (torch.randn(n, width, generator=g) * 2).round()
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
        x[torch.rand(n, width, generator=g) < 0.2] = -torch.inf
        x[0] = -torch.inf
        if n > 1:
            x[1] = 1.0
        if n > 2:
            x[2, ::2] = -0.0
            x[2, 1::2] = 0.0
    elif kind == "ulps":            # neighbouring floats of both signs: the keys' low bits decide
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[dtype]
        sign = torch.where(torch.rand(n, width, generator=g) < 0.5, -1.0, 1.0)
        x = sign * (1 + torch.randint(0, 16, (n, width), generator=g) * ulp)
    else:
        x = torch.randn(n, width, generator=g).abs() * 0.3
    return x.to(dtype).to(device)


def _lens(n, width, device, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, width + 1, (n,), generator=g)
    lens[0] = width
    if n > 1:
        lens[1] = 0
    if n > 2:
        lens[2] = width + 7                    # past the width: everything reachable
    return lens.to(dtype).to(device)


def _ties_decide(x: torch.Tensor, k: int) -> bool:
    """Some row has more entries equal to its k-th largest value than picks among them: the tie rule
    (lowest id first) decides that row's picks."""
    xf = x.float()
    kth = xf.sort(-1, descending=True).values[:, k - 1:k]
    return bool(((xf == kth).sum(-1) > k - (xf > kth).sum(-1)).any())


def _check_index_topk(x, lens, k, cand=None):
    from deepinfer.kernels.triton_topk import index_topk
    got, ref = index_topk(x, lens, k, cand), index_topk_ref(x, lens, k, cand)
    assert got.dtype == ref.dtype == torch.int64 and got.shape == ref.shape
    assert torch.equal(got, ref), (x.dtype, tuple(x.shape), k, cand is not None,
                                   (got != ref).nonzero()[:5].tolist())


def _check_block_mask(b, k, bs, width):
    from deepinfer.kernels.triton_topk import topk_block_mask
    got, ref = topk_block_mask(b, k, bs, width), topk_block_mask_ref(b, k, bs, width)
    assert got.dtype == torch.bool and got.shape == ref.shape
    assert torch.equal(got, ref), (b.dtype, tuple(b.shape), k, bs, width)


def check_interpreted():
    tie_cases = 0
    for dtype in DTYPES:
        # every width and kind in bf16 (the model's scores); the other dtypes on a spread (interpreter time)
        bf16 = dtype == torch.bfloat16
        for width in (1, 7, 100, 513, 1000, 2048) if bf16 else (7, 513, 2048):
            for kind in ("rand", "ties", "ulps") if bf16 else ("ties", "ulps"):
                n = 6
                x = _rows(n, width, dtype, kind, "cpu", seed=width)
                lens = _lens(n, width, "cpu", seed=width + 1)
                cand = torch.rand(n, width, generator=torch.Generator().manual_seed(width)) < 0.3
                cand[3 % n] = False                                      # a row with no candidate at all
                for k in sorted({1, 3, min(width, 64), width, 512}):
                    _check_index_topk(x, lens, k)
                    _check_index_topk(x, lens, k, cand)
                    tie_cases += kind != "rand" and _ties_decide(x, min(k, width))
    assert tie_cases >= 40, tie_cases                                    # the tie rule was exercised
    # indexer-sized rows (bf16, not a power of two and at 2^14), int32 lens, fewer finite than k
    for width in (8192 + 77, 16384):
        x = _rows(3, width, torch.bfloat16, "real", "cpu", seed=5)
        lens = torch.tensor([width, 300, 9000], dtype=torch.int32)
        x = x.masked_fill(torch.arange(width) >= lens[:, None].long(), -torch.inf)
        _check_index_topk(x, lens, 512)
        _check_index_topk(x, lens, 512, torch.arange(width).repeat(3, 1) % 64 < 8)
    # strided rows: a column slice of a wider buffer, and a candidate mask that is a slice too
    big = _rows(4, 300, torch.bfloat16, "ties", "cpu", seed=9)
    cand = (torch.rand(4, 320) < 0.5)[:, :300]
    _check_index_topk(big[:, 50:250], _lens(4, 200, "cpu", 3), 37, cand[:, :200])
    _check_index_topk(big[:, 50:250], _lens(4, 200, "cpu", 3, torch.int32), 37)
    # select_candidate_blocks' level one: block scores with +inf pins, -inf blocks, ties
    for dtype in DTYPES:
        for nb, kind in ((1, "ties"), (5, "ties"), (64, "ulps"), (1000, "ties"), (1000, "ulps")):
            b = _rows(5, nb, dtype, kind, "cpu", seed=nb)
            b[1:, nb // 2] = torch.inf
            for bs in (1, 3, 8):
                for k in sorted({0, 1, min(nb, 16), nb}):
                    for width in sorted({nb * bs, max(0, nb * bs - bs + 1)}):
                        _check_block_mask(b, k, bs, width)
    check_candidate_blocks("cpu")
    check_dispatch_interpreted()
    print("ok")


def check_candidate_blocks(device, widths=(1, 130, 2100)):
    """candidate_blocks (the block maxima, the pin of the newest entry's block and the block top-k in one
    program) against candidate_blocks_ref: ties, -inf runs, block sizes that do and do not divide the width,
    lens 0 / inside / at / past the width, int32 and int64 lens, k 0 to every block."""
    from deepinfer.kernels.reference import candidate_blocks_ref
    from deepinfer.kernels.triton_topk import candidate_blocks
    for dtype in DTYPES:
        for width in widths if dtype == torch.bfloat16 else widths[1:2]:
            for kind in ("ties", "ulps"):
                x = _rows(5, width, dtype, kind, device, seed=width + 3)
                for bs, ldt in ((1, torch.int64), (3, torch.int32), (8, torch.int64), (64, torch.int32)):
                    nb = -(-width // bs)
                    lens = _lens(5, width, device, seed=bs, dtype=ldt)
                    for k in sorted({0, 1, min(nb, 4), nb}):
                        got, ref = candidate_blocks(x, lens, k, bs), candidate_blocks_ref(x, lens, k, bs)
                        assert got.dtype == torch.bool and torch.equal(got, ref), (dtype, width, kind, bs, k)
    # blocks whose max is a zero tie whatever its sign (the lowest block wins): a max's choice between
    # -0.0 and +0.0 is the reduction's own (the H100's tl.max and torch's amax differed). Block 1 is all
    # -0.0 and block 2's max is +0.0: with signed keys block 2 would win.
    for dtype in DTYPES:
        z = torch.tensor([[-0.0, -0.0, -0.0, -0.0, -1.0, 0.0, -2.0, -1.0]], dtype=dtype, device=device)
        lens = torch.tensor([2], device=device)                       # pins block 0
        want = torch.tensor([[True, True, True, True, False, False, False, False]], device=device)
        assert torch.equal(candidate_blocks_ref(z, lens, 2, 2), want)
        assert torch.equal(candidate_blocks(z, lens, 2, 2), want)


def check_dispatch_interpreted():
    """With TRITON_INTERPRET=1 and DEEPINFER_KERNELS=fast, ops' CPU calls take the kernel (and the
    model's candidate path gives the reference's bits)."""
    if os.environ.get("DEEPINFER_KERNELS") != "fast":
        return
    from deepinfer.kernels import select
    from deepinfer.model import ops
    from deepinfer.model.attention import select_candidate_blocks
    x = _rows(4, 130, torch.bfloat16, "ties", "cpu", seed=1)
    assert select.use_fast(x)
    calls = []
    import deepinfer.kernels.triton_topk as tt
    saved = tt.topk_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return saved[grid]
    tt.topk_kernel = Spy()
    try:
        lens = _lens(4, 130, "cpu", 2)
        assert torch.equal(ops.index_topk(x, lens, 20), index_topk_ref(x, lens, 20))
        s = x.float().masked_fill(torch.arange(130) >= lens[:, None].clamp_max(130), -torch.inf)
        keep = select_candidate_blocks(s, lens.clamp_max(130), 4, 8)
        assert len(calls) == 2, calls
    finally:
        tt.topk_kernel = saved
    select.KERNELS = "ref"
    try:
        assert torch.equal(keep, select_candidate_blocks(s, lens.clamp_max(130), 4, 8))
    finally:
        select.KERNELS = "fast"


def test_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip().endswith("ok"), r.stdout[-2000:]


def test_cpu_dispatch_is_the_reference():
    """Without the interpreter, ops on CPU tensors land on the references (and attention's names
    are the ops' names)."""
    from deepinfer.model import attention, ops
    x = _rows(5, 300, torch.bfloat16, "ties", "cpu", seed=0)
    lens = _lens(5, 300, "cpu", 1)
    cand = torch.rand(5, 300) < 0.4
    assert torch.equal(ops.index_topk(x, lens, 64, cand), index_topk_ref(x, lens, 64, cand))
    assert torch.equal(attention.index_topk(x, lens, 64), index_topk_ref(x, lens, 64))
    assert torch.equal(ops.topk_block_mask(x, 10, 8, 2390), topk_block_mask_ref(x, 10, 8, 2390))


def test_reference_rule_on_a_small_case():
    """The rule itself, spelled out: ids ascending, ties to the lowest id, -1 in place for -inf or
    id >= lens (so a broken reference cannot pass the kernel tests by agreeing with a broken kernel)."""
    inf = float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, -inf, 3.0, 0.0, -0.0],
                      [-inf, -inf, -inf, -inf, -inf, -inf, -inf],
                      [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]]).bfloat16()
    got = index_topk_ref(x, torch.tensor([7, 7, 3]), 4)
    assert got.tolist() == [[0, 1, 2, 4], [-1, -1, -1, -1], [0, 1, 2, -1]]
    got = index_topk_ref(x, torch.tensor([2, 7, 7]), 5)
    assert got.tolist() == [[0, 1, -1, -1, -1], [-1, -1, -1, -1, -1], [0, 1, 2, 3, 4]]
    assert index_topk_ref(x[:1], torch.tensor([7]), 6).tolist() == [[0, 1, 2, 4, 5, 6]]
    assert index_topk_ref(x[:1, 4:], torch.tensor([3]), 2).tolist() == [[0, 1]]      # +0.0 above -0.0
    assert index_topk_ref(x[:1, [0, 6, 5]], torch.tensor([3]), 1).tolist() == [[0]]


@pytest.mark.gpu
def test_candidate_blocks_gpu():
    check_candidate_blocks("cuda", widths=(1, 7, 130, 1000, 2100, 8192, 8192 + 77))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["real", "rand", "ties", "ulps"])
@pytest.mark.parametrize("with_cand", [False, True])
def test_index_topk_gpu_decode_size(kind, with_cand):
    """The H200 decode shape: 64 rows of 8192 bf16 scores, k 512, -inf past each row's lens."""
    from deepinfer.kernels.triton_topk import index_topk
    n, E, k = 64, 8192, 512
    x = _rows(n, E, torch.bfloat16, kind, "cuda", seed=E)
    lens = _lens(n, E, "cuda", seed=1)
    lens[3] = 100                                                  # fewer finite entries than k
    x = x.masked_fill(torch.arange(E, device="cuda") >= lens[:, None], -torch.inf)
    cand = None
    if with_cand:
        cand = torch.rand(n, E, device="cuda") < 0.25
        cand[5] = False
    got, ref = index_topk(x, lens, k, cand), index_topk_ref(x, lens, k, cand)
    assert torch.equal(got, ref), (got != ref).nonzero()[:5].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 100, 4097, 8192, 12345, 16384, 32768])
def test_index_topk_gpu_widths(dtype, width):
    from deepinfer.kernels.triton_topk import index_topk
    for kind in ("rand", "ties", "ulps"):
        x = _rows(70, width, dtype, kind, "cuda", seed=width)
        lens = _lens(70, width, "cuda", seed=width, dtype=torch.int32)
        for k in sorted({1, min(width, 512), width, 2048}):
            got, ref = index_topk(x, lens, k), index_topk_ref(x, lens, k)
            assert torch.equal(got, ref), (kind, k, (got != ref).nonzero()[:5].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("nb,bs,k", [(1024, 8, 256), (2048, 8, 2048), (1000, 8, 16), (4096, 4, 512), (37, 3, 5)])
def test_topk_block_mask_gpu(nb, bs, k):
    from deepinfer.kernels.triton_topk import topk_block_mask
    for kind, dtype in (("real", torch.bfloat16), ("ties", torch.bfloat16), ("ulps", torch.bfloat16),
                        ("rand", torch.float32), ("ulps", torch.float32)):
        b = _rows(64, nb, dtype, kind, "cuda", seed=nb)
        b[:, nb // 3] = torch.inf
        for width in (nb * bs, nb * bs - bs + 1):
            assert torch.equal(topk_block_mask(b, k, bs, width), topk_block_mask_ref(b, k, bs, width))


@pytest.mark.gpu
def test_ops_dispatch_gpu():
    """ops binds the kernel for CUDA tensors (same bits as the reference, through the model's names)."""
    from deepinfer.kernels import select
    from deepinfer.model import ops
    x = _rows(64, 8192, torch.bfloat16, "real", "cuda", seed=3)
    lens = _lens(64, 8192, "cuda", seed=3)
    assert torch.equal(ops.index_topk(x, lens, 512), index_topk_ref(x, lens, 512))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_interpreted()
