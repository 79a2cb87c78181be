"""The indexer's decode form (kernels/triton_indexer.py index_scores_decode_kernel: one program per query
and run of NB key blocks) against the one-block-per-program kernel (index_scores_kernel, bit for bit:
the same arithmetic per block, so batch invariance does not depend on NB) and the reference
(reference.index_scores_paged_ref). Under Triton's interpreter on the CPU (a subprocess: the
interpreter is chosen at import) and on the GPU: index heads other than 64, head dims 64 and 128, E
not a multiple of the 128-key block, lens short / long / zero, E far past every lens (a CUDA graph
sized for a longer context), keys in place through a row table or contiguous, no lens, one query,
grids whose last program holds fewer than NB blocks, the queries a prefill's runs leave over."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def case(lens, E, ih, idim, device, seed):
    """One decode query per sequence, E index-key entries per sequence in a shuffled pool (rows [B, E])."""
    from deepinfer.kernels.reference import fp4_quant_ref
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q = fp4_quant_ref(torch.randn(B, ih, idim, generator=g).bfloat16(), 32)
    w = (torch.randn(B, ih, generator=g) * 0.02).bfloat16()
    pool = torch.randn(B * E + 5, idim, generator=g)
    pool[::7] *= 2.0 ** 24          # block scales past 2 (E8M0 bytes > 128) and near the bottom of the range:
    pool[3::7] *= 2.0 ** -110       # the packed decode must cover every scale a row can carry
    pool = fp4_quant_ref(pool.bfloat16(), 32)
    rows = torch.randperm(B * E + 5, generator=g)[:B * E].view(B, E)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(w), to(pool), to(rows), to(torch.tensor(lens, dtype=torch.int32))


def check(device, shapes, nbs) -> int:
    """Per shape: the decode form at every NB in nbs (None: the host's choice) equals the old kernel's
    bits, paged and on the gathered copy, with and without lens; and the reference within tolerance."""
    from deepinfer.kernels import triton_indexer as ti
    from deepinfer.kernels.reference import fp4_pack_rows_ref, index_scores_paged_ref
    tol = 2e-2 if device == "cpu" else 5e-3          # the interpreter's fp32 dot against the CPU einsum
    n = 0
    for seed, (lens, E, ih, idim) in enumerate(shapes):
        q, w, pool, rows, ln = case(lens, E, ih, idim, device, seed)
        B = len(lens)
        seq_of = torch.arange(B, device=device)
        ks = seq_of * E
        for lens_arg in (ln, None):
            old = ti.index_scores(q, w, pool, lens_arg, key_start=ks, num_keys=E, rows=rows.flatten(), blocks_per_program=0)
            for nb in nbs:
                new = ti.index_scores(q, w, pool, lens_arg, key_start=ks, num_keys=E, rows=rows.flatten(),
                                      blocks_per_program=nb)
                assert torch.equal(new, old), (lens, E, ih, idim, nb, lens_arg is None)
        gathered = ti.index_scores(q, w, pool[rows].flatten(0, 1), ln, key_start=ks, num_keys=E)
        assert torch.equal(gathered, ti.index_scores(q, w, pool[rows].flatten(0, 1), ln, key_start=ks, num_keys=E,
                                                     blocks_per_program=0)), (lens, E)
        paged = ti.index_scores(q, w, pool, ln, key_start=ks, num_keys=E, rows=rows.flatten())
        assert torch.equal(paged, gathered), (lens, E)
        # the cache's packed FP4 rows (reference.fp4_pack_rows_ref) give the bf16 rows' bits in every form
        packed = fp4_pack_rows_ref(pool)
        for nb in (0, None):
            assert torch.equal(ti.index_scores(q, w, packed, ln, key_start=ks, num_keys=E, rows=rows.flatten(),
                                               blocks_per_program=nb), paged), (lens, E, nb, "packed")
        assert torch.equal(ti.index_scores(q, w, packed[rows].flatten(0, 1), ln, key_start=ks, num_keys=E), gathered)
        ref = index_scores_paged_ref(q, w, pool[rows], seq_of, torch.zeros_like(seq_of), 1, ln)
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(paged), fin), (lens, E)
        if fin.any():
            assert rel_err(paged[fin], ref[fin]) < tol, (lens, E, rel_err(paged[fin], ref[fin]))
        n += 1
    return n


def check_leftover_queries(device) -> None:
    """A prefill's runs hand the queries they leave over (tokens) to the per-token form: those rows only."""
    from deepinfer.kernels import triton_indexer as ti
    q, w, pool, rows, ln = case([5, 0, 130, 300, 77], 300, 8, 32, device, 11)
    ks = torch.arange(5, device=device) * 300
    tokens = torch.tensor([3, 0, 2], dtype=torch.int32, device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    full = ti.index_scores(q, w, pool, ln, key_start=ks, num_keys=300, rows=rows.flatten(), blocks_per_program=0)
    for nb in (None, 2):
        got = ti.index_scores(q, w, pool, ln, key_start=ks, num_keys=300, rows=rows.flatten(), runs=(none, none, tokens),
                              blocks_per_program=nb)
        assert torch.equal(got[[0, 2, 3]], full[[0, 2, 3]])


# (lens, E, index heads, head dim)
CPU_SHAPES = [([0, 5, 300, 128, 129, 1], 300, 16, 64),     # E not a multiple of 128, lens 0 / inside a block / edges
              ([37], 1000, 8, 32),                         # one query, E far past lens (graph sizing)
              ([200, 0, 600, 64], 600, 4, 128),
              ([513, 700], 700, 64, 128)]                  # the release's heads and head dim
CPU_NBS = [None, 3, 16]       # None: 1 at these sizes; 3: the last program's run is short; 16: past E
GPU_SHAPES = [([8192 // 4] * 128, 4096, 64, 128),          # batch-128 decode, a graph sized for 16k
              ([1], 4096, 64, 128), ([3000, 17, 0, 4096] * 4, 4096, 64, 128),
              ([100, 1000, 2000], 2222, 32, 128), ([777] * 9, 1500, 16, 64)]
GPU_NBS = [None, 1, 2, 4, 8, 16, 5]


def test_decode_blocks_per_program():
    from deepinfer.kernels.triton_indexer import DECODE_NB_MAX, decode_blocks_per_program as nb
    assert nb(1, 32, 132) == 1 and nb(16, 32, 132) == 1        # small batches: one block each fills the SMs
    assert nb(128, 32, 132) == 8 and nb(64, 32, 132) == 4
    assert nb(128, 4, 132) == 1 and nb(4096, 4, 132) == 4       # never more than the blocks there are
    assert nb(1024, 1 << 12, 132) == DECODE_NB_MAX
    for n in (1, 7, 128):
        for blocks in (1, 3, 32, 100):
            b = nb(n, blocks, 132)
            assert b & (b - 1) == 0 and (b == 1 or n * -(-blocks // b) >= 2 * 132)


def test_index_decode_under_interpreter():
    code = ("import sys; sys.path.insert(0, %r); import test_index_decode as t; t.check_leftover_queries('cpu'); "
            "print(t.check('cpu', t.CPU_SHAPES, t.CPU_NBS))" % os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == str(len(CPU_SHAPES))


@pytest.mark.gpu
def test_index_decode_on_gpu():
    check_leftover_queries("cuda")
    assert check("cuda", GPU_SHAPES, GPU_NBS) == len(GPU_SHAPES)
