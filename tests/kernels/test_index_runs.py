"""The indexer's prefill form (kernels/triton_indexer.py `runs`: a sequence's queries scored in runs that
share their key tile, head by head) against the reference (reference.index_scores_paged_ref), under
Triton's interpreter on the CPU (a subprocess: the interpreter is chosen at import) and on the GPU:
sequences shorter than a run's minimum (per-token programs), one query, runs with a remainder, several
runs per sequence, keys read through a row table, causal lengths whose key blocks are wholly masked.
Also the host split (query_runs) and the dispatcher's choice (select: runs only for prefills, never
under batch invariance)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def case(q_lens, E, ih, idim, device, seed):
    """A step of sequences with q_lens new queries each, E index keys per sequence (in a shuffled pool),
    causal lengths: the last query of a sequence sees all E keys, earlier ones fewer (some none)."""
    from deepinfer.kernels.reference import fp4_quant_ref
    g = torch.Generator().manual_seed(seed)
    B, T = len(q_lens), int(sum(q_lens))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    q = fp4_quant_ref(torch.randn(T, ih, idim, generator=g).bfloat16(), 32)
    w = (torch.randn(T, ih, generator=g) * 0.02).bfloat16()
    pool = fp4_quant_ref(torch.randn(B * E + 5, idim, generator=g).bfloat16(), 32)
    rows = torch.randperm(B * E + 5, generator=g)[:B * E].view(B, E)
    seq_of = torch.from_numpy(np.repeat(np.arange(B), q_lens))
    row_in_seq = torch.arange(T) - torch.from_numpy(cu[:-1])[seq_of]
    lens = (E - (torch.from_numpy(np.repeat(q_lens, q_lens)) - 1 - row_in_seq) // 4).clamp_min(0)
    to = lambda t: t.to(device)  # noqa: E731
    return cu, to(q), to(w), to(pool), to(rows), to(seq_of), to(row_in_seq), to(lens)


def check(device, shapes) -> int:
    from deepinfer.kernels import triton_indexer as ti
    from deepinfer.kernels.reference import fp4_pack_rows_ref, index_scores_paged_ref
    n, tol = 0, 2e-2 if device == "cpu" else 5e-3     # the interpreter's fp32 dot against the CPU einsum
    for seed, (q_lens, E, ih, idim) in enumerate(shapes):
        cu, q, w, pool, rows, seq_of, row_in_seq, lens = case(q_lens, E, ih, idim, device, seed)
        runs = tuple(torch.from_numpy(a).to(device) for a in ti.query_runs(cu))
        got = ti.index_scores(q, w, pool, lens, key_start=seq_of * E, num_keys=E, rows=rows.flatten(), runs=runs)
        per_token = ti.index_scores(q, w, pool, lens, key_start=seq_of * E, num_keys=E, rows=rows.flatten())
        packed = fp4_pack_rows_ref(pool)            # the cache's packed FP4 rows: the same bits in both forms
        assert torch.equal(got, ti.index_scores(q, w, packed, lens, key_start=seq_of * E, num_keys=E,
                                                rows=rows.flatten(), runs=runs))
        assert torch.equal(per_token, ti.index_scores(q, w, packed, lens, key_start=seq_of * E, num_keys=E,
                                                      rows=rows.flatten()))
        # select.index_scores_pool's form: the product in the kernel, int32 lens read as they are
        assert torch.equal(got, ti.index_scores(q, w, pool, lens.to(torch.int32), key_start=seq_of, key_start_scale=E,
                                                num_keys=E, rows=rows.flatten(), runs=runs))
        ref = index_scores_paged_ref(q.cpu(), w.cpu(), pool.cpu()[rows.cpu()], seq_of.cpu(), row_in_seq.cpu(),
                                     int(max(q_lens)), lens.cpu())
        fin = torch.isfinite(ref)
        for out in (got, per_token):
            assert torch.equal(torch.isfinite(out.cpu()), fin), (q_lens, E)
            assert rel_err(out.cpu()[fin], ref[fin]) < tol, (q_lens, E, rel_err(out.cpu()[fin], ref[fin]))
        # runs only regroup the head sum: within a bf16 rounding of the per-token kernel everywhere
        f = fin.to(device)
        d, ref_mag = (got.float() - per_token.float()).abs()[f], per_token.float().abs()[f]
        assert (d <= ref_mag * 2 ** -7 + 1e-3 * ref_mag.max()).all(), (q_lens, E)
        n += 1
    return n


CPU_SHAPES = [([70, 3, 1, 16], 40, 4, 32), ([1], 9, 2, 32), ([129], 33, 8, 32), ([16, 15, 64], 130, 4, 64)]
GPU_SHAPES = [([4096], 1024, 32, 128), ([2048, 1, 1, 700, 5, 1000], 600, 32, 128), ([333, 17], 777, 16, 64),
              ([1] * 8 + [64] * 4, 256, 32, 128)]


def test_query_runs_cover_every_query_once():
    from deepinfer.kernels.triton_indexer import query_runs
    cu = np.array([0, 70, 73, 74, 74, 90, 300])          # lens 70, 3, 1, 0, 16, 210
    t0, cnt, singles = query_runs(cu, bt=64, min_len=16)
    assert t0.tolist() == [0, 64, 74, 90, 154, 218, 282] and cnt.tolist() == [64, 6, 16, 64, 64, 64, 18]
    assert singles.tolist() == [70, 71, 72, 73]
    covered = np.concatenate([np.arange(a, a + c) for a, c in zip(t0, cnt)] + [singles])
    assert np.array_equal(np.sort(covered), np.arange(300))
    t0, cnt, singles = query_runs(np.array([0, 1, 2]))    # decode: no runs
    assert t0.size == 0 and cnt.size == 0 and singles.tolist() == [0, 1]


def test_index_runs_under_interpreter():
    code = ("import sys; sys.path.insert(0, %r); import test_index_runs as t; print(t.check('cpu', t.CPU_SHAPES))"
            % os.path.dirname(__file__))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == str(len(CPU_SHAPES))


def test_select_takes_runs_only_for_prefills(monkeypatch):
    from deepinfer.kernels import batch_invariant, select
    dev = torch.device("cpu")
    assert select._index_runs(None, 512, 512, dev) is None                     # static decode form
    assert select._index_runs(np.array([0, 1, 2, 3]), 1, 3, dev) is None       # decode / verify
    assert select._index_runs(np.array([0, 512]), 512, 500, dev) is None       # rows not the step's cu
    runs = select._index_runs(np.array([0, 3, 515]), 512, 515, dev)
    assert [r.tolist() for r in runs] == [[3, 67, 131, 195, 259, 323, 387, 451], [64] * 8, [0, 1, 2]]
    with batch_invariant.batch_invariant_mode():
        assert select._index_runs(np.array([0, 512]), 512, 512, dev) is None


@pytest.mark.gpu
def test_index_runs_on_gpu():
    assert check("cuda", GPU_SHAPES) == len(GPU_SHAPES)
