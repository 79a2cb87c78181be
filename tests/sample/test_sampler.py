"""Sampler on fixed logits: distributions (chi-square), seeded determinism, batch invariance,
penalties, logprobs. No model, no tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from deepinfer.sample import Sampler, SamplingRow
from deepinfer.sample.random import stream_uniform
from deepinfer.sampling_params import SamplingParams

V = 40


def fixed_logits(seed=0, v=V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g) * 2.0


def expected_probs(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The intended distribution, written independently of the sampler (float64 numpy, sort-based)."""
    x = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order])
        n_keep = int(np.searchsorted(mass, top_p) + 1)
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:n_keep]] = True
        p = np.where(keep, p, 0.0)
    if min_p > 0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def rows_for(params: SamplingParams, n: int, seed=1234, start=0) -> list[SamplingRow]:
    sampler = Sampler(V)
    state = sampler.new_state(SamplingParams(**{**params.__dict__, "seed": seed}))
    return [SamplingRow(state, (), start + i) for i in range(n)]


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=8),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_chi_square_20000_samples(kw):
    logits = fixed_logits()
    n = 20_000
    sampler = Sampler(V)
    rows = rows_for(SamplingParams(**kw), n)
    counts = np.zeros(V)
    for s in range(0, n, 2000):   # batches of 2000 rows of identical logits, one position each
        out = sampler.sample(logits.expand(2000, V).contiguous(), rows[s:s + 2000])
        counts += np.bincount(out.token_ids.numpy(), minlength=V)
    p = expected_probs(logits.numpy(), **kw)
    assert counts[p == 0].sum() == 0, "sampled a token the filters remove"
    keep = p > 0
    f_exp = p[keep] * n
    stat, pval = chisquare(counts[keep], f_exp)
    assert pval > 1e-3, (stat, pval, kw)


def test_greedy_is_argmax_and_ignores_seed():
    logits = torch.randn(5, V)
    s = Sampler(V)
    rows = [SamplingRow(s.new_state(SamplingParams(temperature=0, seed=i)), (), 3) for i in range(5)]
    assert torch.equal(s.sample(logits, rows).token_ids, logits.argmax(-1))


def test_same_seed_same_position_same_token_different_seed_differs():
    logits = fixed_logits(v=1000).expand(64, 1000).contiguous()
    s = Sampler(1000)
    a = s.sample(logits, [SamplingRow(s.new_state(SamplingParams(seed=7)), (), p) for p in range(64)]).token_ids
    b = s.sample(logits, [SamplingRow(s.new_state(SamplingParams(seed=7)), (), p) for p in range(64)]).token_ids
    c = s.sample(logits, [SamplingRow(s.new_state(SamplingParams(seed=8)), (), p) for p in range(64)]).token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_uniform_stream_is_uniform():
    u = np.array([stream_uniform(99, p) for p in range(20_000)])
    hist = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chisquare(hist).pvalue > 1e-3
    assert stream_uniform(1, 5) == stream_uniform(1, 5) != stream_uniform(2, 5)


@pytest.mark.parametrize("kw", CASES + [dict(temperature=0.0)])
def test_row_result_independent_of_batch(kw):
    """A request's token and logprobs are the same alone and among 1..33 other rows (full vocab)."""
    vocab = 129_280
    g = torch.Generator().manual_seed(3)
    others = torch.randn(40, vocab, generator=g) * 3
    mine = torch.randn(vocab, generator=g) * 3
    s = Sampler(vocab)
    state = s.new_state(SamplingParams(seed=11, logprobs=5, presence_penalty=0.5, **kw))
    me = SamplingRow(state, [5, 6, 6], 17)
    alone = s.sample(mine[None], [me])
    for n_other in (1, 7, 15, 33):
        pos = n_other // 2
        batch = torch.cat([others[:pos], mine[None], others[pos:n_other]])
        rows = [SamplingRow(s.new_state(SamplingParams(seed=i, top_p=0.5, logprobs=2)), [1], 9) for i in range(n_other)]
        rows.insert(pos, me)
        out = s.sample(batch, rows)
        assert out.token_ids[pos] == alone.token_ids[0]
        assert out.logprobs[pos] == alone.logprobs[0]


def test_cpu_row_sum_is_not_batch_invariant_but_cumsum_is():
    """Why the sampler never uses .sum(): measured fact on CPU torch (documents the design)."""
    x = torch.randn(16, 129_280, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.cumsum(x[:4], -1)[0], torch.cumsum(x[:1], -1)[0])
    assert torch.equal(torch.softmax(x[:4], -1)[0], torch.softmax(x[:1], -1)[0])
    assert torch.equal(torch.log_softmax(x[:4], -1)[0], torch.log_softmax(x[:1], -1)[0])


def test_penalties():
    logits = torch.zeros(1, V)
    logits[0, 3] = 1.0
    s = Sampler(V)
    st = s.new_state(SamplingParams(temperature=0, presence_penalty=0.6, frequency_penalty=0.3))
    # token 3 seen twice: 1 - 0.6 - 0.6 = -0.2 < 0 -> argmax moves to an unseen token (0)
    assert s.sample(logits, [SamplingRow(st, [3, 3], 5)]).token_ids.item() == 0
    assert s.sample(logits, [SamplingRow(st, [4], 5)]).token_ids.item() == 3


def test_logprobs_raw_and_top():
    logits = fixed_logits().expand(2, V).contiguous()
    s = Sampler(V)
    rows = [SamplingRow(s.new_state(SamplingParams(temperature=0.5, seed=1, logprobs=3)), (), 0),
            SamplingRow(s.new_state(SamplingParams(temperature=0.5, seed=1)), (), 0)]
    out = s.sample(logits, rows)
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.logprob == pytest.approx(ref[out.token_ids[0]].item())
    assert [t for t, _ in lp.top] == torch.topk(ref, 3).indices.tolist()
    assert out.logprobs[1] is None
    zero = s.sample(logits[:1], [SamplingRow(s.new_state(SamplingParams(logprobs=0, seed=2)), (), 0)])
    assert zero.logprobs[0].top == []


def test_top_p_wide_nucleus_falls_back_to_full_sort():
    """Flat logits over 5000 tokens: top_p=0.9 needs ~4500 candidates (> the first 1024)."""
    vocab = 5000
    logits = torch.zeros(1, vocab)
    logits[0, :100] = -20.0                     # 100 near-impossible tokens are cut by top_p
    s = Sampler(vocab)
    st = s.new_state(SamplingParams(top_p=0.9, seed=3))
    toks = torch.cat([s.sample(logits.expand(500, vocab), [SamplingRow(st, (), i * 500 + j) for j in range(500)]).token_ids
                      for i in range(4)])
    assert (toks >= 100).all()
    assert len(set(toks.tolist())) > 1000


@pytest.mark.parametrize("vocab", [1000, 5003])
def test_chi_square_multi_block_vocab(vocab):
    """Many 128-token CDF blocks (and a padded last one): rare tokens lumped into one bin."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(vocab, generator=g) * 3.0
    n = 20_000
    sampler = Sampler(vocab)
    rows = rows_for(SamplingParams(temperature=1.0), n, seed=77)
    counts = np.zeros(vocab)
    for s in range(0, n, 500):
        out = sampler.sample(logits.expand(500, vocab).contiguous(), rows[s:s + 500])
        counts += np.bincount(out.token_ids.numpy(), minlength=vocab)
    p = expected_probs(logits.numpy())
    big = p * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big] * n, p[~big].sum() * n)
    assert chisquare(obs, exp).pvalue > 1e-3


def test_constraint_without_tokenizer_is_refused_cleanly():
    from deepinfer.sample import InvalidConstraintError
    from deepinfer.sampling_params import OutputConstraint

    with pytest.raises(InvalidConstraintError, match="tokenizer.json"):
        Sampler(V).check(SamplingParams(constraint=OutputConstraint("regex", "a+")))
