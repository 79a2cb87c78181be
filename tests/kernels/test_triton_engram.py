"""kernels/triton_engram.py against its references: the GPU at the full-width shape (-m gpu) and Triton's
interpreter on the CPU (a subprocess: TRITON_INTERPRET is read at import).

The gated add (reference.engram_gate_ref): the gate's fp32 sums run in another order than torch's, so a few
outputs may round to the neighbouring bf16 value (on the GPU: under 1% of them); none may move further than
that and a few-ulp change of the gate. The n-gram hash (ngram_hash_ref) and the table rows (engram_rows_ref):
the same integers and bits."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter


def _case(T, hc, d, device, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, hc, d, generator=g) * 2).bfloat16()
    kv = torch.randn(T, (hc + 1) * d, generator=g).bfloat16()
    key, value = kv.split([hc * d, d], dim=-1)
    w = torch.rand(hc, d, generator=g) + 0.5
    mask = (torch.rand(T, generator=g) > 0.3) if masked else None
    to = lambda t: None if t is None else t.to(device)   # noqa: E731
    return to(x), to(key), to(value), to(w), to(mask)


def check(device):
    from deepinfer.kernels.reference import engram_gate_ref
    from deepinfer.kernels.triton_engram import engram_gate
    shapes = [(1, 4, 5120), (64, 4, 5120), (5, 4, 96)] if device == "cuda" else [(3, 4, 96), (2, 2, 1500)]
    for T, hc, d in shapes:
        for masked in (False, True):
            x, key, value, w, mask = _case(T, hc, d, device, masked, seed=T + d)
            got = engram_gate(x, key, value, w, 1e-6, mask)
            want = engram_gate_ref(x, key, value, w, 1e-6, mask)
            diff = got != want       # (the interpreter truncates float -> bf16 casts: any entry may be an ulp off)
            assert device != "cuda" or diff.float().mean().item() < 0.01, (T, d, masked, diff.float().mean().item())
            # an ulp of the result, plus what a gate a few fp32 ulps off moves it by (near cancellation
            # of x and gate * value the result is tiny and its ulp smaller than that)
            tol = want.float().abs() * 2 ** -7 + value.float().abs()[:, None, :] * 2 ** -18
            assert ((got.float() - want.float()).abs() <= tol).all(), (T, d, masked)
            if mask is not None:                         # masked tokens: the stream unchanged
                assert torch.equal(got[~mask], x[~mask])


def _hash_case(device, seed, n_seqs, masked):
    """A ragged batch (chunks of 0..6 new tokens, some sequences mid-prompt with history, BEFORE / DEAD
    markers in the history, dead tokens in the chunk) hashed with the real prime layout and multipliers at
    a non-power-of-two head count."""
    import numpy as np
    from deepinfer.model.engram import BEFORE, DEAD, engram_primes, hash_multipliers
    g = np.random.default_rng(seed)
    layers, ng, heads, vocab, cvocab = [1, 4, 6], 4, 3, 1000, 500
    primes = engram_primes(layers, ng, heads, vocab)
    flat = [[p for order in layer for p in order] for layer in primes]
    offsets = np.stack([np.cumsum([0] + f[:-1]) for f in flat])
    lens = g.integers(0, 7, n_seqs)
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = g.integers(0, 2000, cu[-1])
    hist = g.integers(0, 2000, (n_seqs, ng - 1))
    for b in range(n_seqs):                        # a start at position p < ng - 1: BEFORE fills the rest
        p = g.integers(0, 6)
        if p < ng - 1:
            hist[b, :ng - 1 - p] = BEFORE
        if g.random() < 0.3:
            hist[b, g.integers(0, ng - 1)] = DEAD  # an image span just before the chunk
    mask = torch.from_numpy(g.random(cu[-1]) > 0.2) if masked else None
    token_map = g.integers(0, cvocab, 2000)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int64).to(device)   # noqa: E731
    return (t(ids), t(cu), t(hist), None if mask is None else mask.to(device), t(token_map),
            t(hash_multipliers(layers, ng, cvocab)), t(primes), t(offsets), int(token_map[7]), DEAD)


def check_hash(device):
    from deepinfer.kernels.reference import ngram_hash_ref
    from deepinfer.kernels.triton_engram import ngram_hash
    for seed, (n_seqs, masked) in enumerate([(1, False), (3, True), (7, False), (33, True), (5, True)]):
        args = _hash_case(device, seed, n_seqs, masked)
        want = ngram_hash_ref(*args)
        got = ngram_hash(*args)
        assert got.dtype == torch.int64 and torch.equal(got, want), (seed, n_seqs, masked)
    # a strided history (a column slice of a wider buffer) and no tokens at all
    ids, cu, hist, mask, *rest = _hash_case(device, 9, 4, True)
    wide = torch.cat([hist, hist], 1)[:, :hist.shape[1]]
    assert torch.equal(ngram_hash(ids, cu, wide, mask, *rest), ngram_hash_ref(ids, cu, hist, mask, *rest))
    empty = ngram_hash(ids[:0], torch.zeros_like(cu), hist, None, *rest)
    assert empty.shape == (0, 3, 9)


def check_rows(device):
    """Every e4m3 code of a row under scales 2^-20..2^20 and both ids layouts (a strided [T, cols] view of the
    hash ids, a flat vector), D = 256 and 96 (a masked tile)."""
    from deepinfer.kernels.reference import engram_rows_ref
    from deepinfer.kernels.triton_engram import engram_rows
    g = torch.Generator().manual_seed(3)
    for D in (256, 96):
        R = 300
        codes = torch.randint(0, 256, (R, D), generator=g, dtype=torch.uint8)
        codes[0, :min(D, 256)] = torch.arange(min(D, 256), dtype=torch.uint8)
        codes[codes == 0x7F] = 0x7E                # e4m3fn's NaN codes: not in a table
        codes[codes == 0xFF] = 0xFE
        weight = codes.view(torch.float8_e4m3fn).to(device)
        scale = torch.randint(107, 148, (R, D // 32), generator=g, dtype=torch.uint8).to(device)
        hashes = torch.randint(0, R, (9, 2, 5), generator=g).to(device)
        for ids in (hashes[:, 1], hashes[:, 0, 2], hashes[:0, 1]):
            got, want = engram_rows(weight, scale, ids), engram_rows_ref(weight, scale, ids)
            assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), (D, ids.shape)


@pytest.mark.gpu
def test_engram_gate_cuda():
    check("cuda")


@pytest.mark.gpu
def test_engram_hash_and_rows_cuda():
    check_hash("cuda")
    check_rows("cuda")


def test_engram_gate_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    check_hash("cpu")
    check_rows("cpu")
    print("engram gate, hash, rows: ok")
