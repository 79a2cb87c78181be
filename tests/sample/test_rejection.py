"""Both acceptance rules are lossless (sample/rejection.py): over many seeds on a small
vocabulary, the emitted tokens follow the target's filtered distribution (chi-square), and the
test has the power to see a lossy rule. The identical rule emits exactly the plain seeded sample;
both rules are pure functions of (seed, position): the same row gives the same token in any batch."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.sample.random import DRAFT, SAMPLE, uniforms
from deepinfer.sample.sampler import Sampler, SamplingRow, filtered_probs, inverse_cdf, row_totals
from deepinfer.sampling_params import SamplingParams

V = 8
N = 6000          # seeds (one request each)


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper 0.0005 quantile of chi-square(df) (Wilson-Hilferty): a wrong rule lands far above it."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of observed tokens against p [V] (cells with expected count >= 5)."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = p.double() * len(tokens)
    keep = expected >= 5
    assert counts[~keep].sum() <= max(5.0, 0.01 * len(tokens)), "mass where p is ~0"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def normalized(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    p = filtered_probs(logits.clone()[None], [params])
    return (p / row_totals(p).float()[:, None])[0]


TARGET = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.5, 0.9, 0.0])     # p: the target model
DRAFT_L = torch.tensor([0.5, 2.5, 0.0, 1.0, 1.2, 0.8, -1.0, 0.3])    # q: a different draft model
PARAMS = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=6, top_p=0.9)]


def verify_rows(params, seeds, position, target_logits, draft_logits, sampled_rule: bool):
    """One verify row per seed at `position`: the draft (sampled from q, or greedy) and the token the
    sampler emits for that row. -> (drafts [N], tokens [N])."""
    q = normalized(draft_logits, params)
    if sampled_rule:
        drafts = inverse_cdf(q.expand(len(seeds), V).clone(), uniforms(seeds, [position] * len(seeds), DRAFT))
    else:
        drafts = torch.full((len(seeds),), int(q.argmax()))
    sampler = Sampler(V)
    rows = []
    for s, d in zip(seeds, drafts.tolist()):
        state = sampler.new_state(dataclasses_replace(params, seed=s))
        extra = dict(draft_id=d, draft_probs=q) if sampled_rule else {}
        rows.append(SamplingRow(state, (), position, lookahead=[], **extra))
    out = sampler.sample(target_logits.expand(len(seeds), V).clone(), rows, advance=False).token_ids
    return drafts, out


def dataclasses_replace(p, **kw):
    import dataclasses
    return dataclasses.replace(p, **kw)


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("sampled_rule", [True, False])
def test_emitted_token_follows_the_target(params, sampled_rule):
    p = normalized(TARGET, params)
    drafts, tokens = verify_rows(params, list(range(N)), 37, TARGET, DRAFT_L, sampled_rule)
    stat, df = chi2(tokens, p)
    assert stat < chi2_critical(df), (stat, df)
    accepted = (tokens == drafts).double().mean().item()
    q = normalized(DRAFT_L, params)
    if sampled_rule:   # acceptance = sum_v min(p, q)
        assert accepted == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.03)
    else:              # acceptance = p(greedy draft)
        assert accepted == pytest.approx(p[int(q.argmax())].item(), abs=0.03)
    # power: emitting the drafts themselves (accept always) is not the target distribution
    if sampled_rule:
        bad, bad_df = chi2(drafts, p) if (p[q > 0.01] > 0).all() else (float("inf"), 1)
        assert bad > 10 * chi2_critical(bad_df)


def test_second_token_after_an_acceptance_follows_the_target():
    """Two drafts: the token emitted at the second position (row 1), among requests whose first draft
    was accepted, follows p_1 (a different target row)."""
    params = PARAMS[0]
    target2 = torch.tensor([0.1, -0.3, 1.8, 0.4, 1.1, 0.0, 0.6, 1.4])
    seeds = list(range(2 * N))
    d1, t1 = verify_rows(params, seeds, 50, TARGET, DRAFT_L, True)
    d2, t2 = verify_rows(params, seeds, 51, target2, DRAFT_L.flip(0), True)
    kept = t1 == d1
    stat, df = chi2(t2[kept], normalized(target2, params))
    assert kept.sum() > N // 2 and stat < chi2_critical(df), (stat, df)


def test_identical_rule_emits_the_plain_sample():
    """Greedy drafts: each verify row's token is the token plain decoding draws at that position."""
    params = PARAMS[1]
    seeds = list(range(300))
    _, tokens = verify_rows(params, seeds, 12, TARGET, DRAFT_L, False)
    plain = inverse_cdf(normalized(TARGET, params).expand(len(seeds), V).clone(),
                        uniforms(seeds, [12] * len(seeds), SAMPLE))
    assert torch.equal(tokens, plain)


def test_sampled_rule_is_a_function_of_seed_and_position():
    """The same (seed, position, drafts, logits) row gives the same token alone, in a batch, reordered;
    another position gives other draws."""
    params = PARAMS[0]
    seeds = list(range(64))
    d, a = verify_rows(params, seeds, 90, TARGET, DRAFT_L, True)
    _, b = verify_rows(params, seeds[::-1], 90, TARGET, DRAFT_L, True)
    assert torch.equal(a, b.flip(0))
    _, single = verify_rows(params, seeds[5:6], 90, TARGET, DRAFT_L, True)
    assert single.item() == a[5].item()
    _, other = verify_rows(params, seeds, 91, TARGET, DRAFT_L, True)
    assert not torch.equal(a, other)


def test_rejection_never_emits_the_rejected_draft():
    """A rejected draft has p(d) < q(d), where the residual is 0: the runner's prefix comparison
    (accept while draft == token) then reads the rule correctly."""
    from deepinfer.sample.rejection import speculative_rows
    g = torch.Generator().manual_seed(0)
    m = 2000
    p = torch.softmax(torch.randn(m, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(m, V, generator=g) * 2, -1)
    d = torch.multinomial(q, 1, generator=g)[:, 0]
    u1, u2 = torch.rand(m, generator=g, dtype=torch.float64), torch.rand(m, generator=g, dtype=torch.float64)
    out = speculative_rows(p, d, q, u1, u2)
    accept = u1 * q.gather(1, d[:, None])[:, 0].double() < p.gather(1, d[:, None])[:, 0].double()
    assert torch.equal(out == d, accept)
    sure = p.gather(1, d[:, None])[:, 0] >= q.gather(1, d[:, None])[:, 0]
    assert accept[sure].all()                                 # p >= q: always accepted
