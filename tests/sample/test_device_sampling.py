"""sample/device_sampling.py: the draws of an overlapped verify step, whose positions, drafts and draft
probabilities are device tensors, equal the Sampler's (which reads them on the host): the uniforms
bit for bit over random seeds and positions, and each row's token, for greedy, top-p / top-k /
min-p rows and rows verifying a sampled draft, mixed in one batch."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from deepinfer.sample.device_sampling import DeviceRows, device_samplable, sample_on_device, uniforms_on_device
from deepinfer.sample.random import ACCEPT, DRAFT, RESIDUAL, SAMPLE, uniforms
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import OutputConstraint, SamplingParams


def test_uniforms_on_device_equal_the_host_streams():
    rng = random.Random(0)
    seeds = [rng.getrandbits(63) for _ in range(3000)] + [0, 1, (1 << 63) - 1, (1 << 64) - 1]
    positions = [rng.randrange(0, 1 << 40) for _ in range(len(seeds) - 4)] + [0, 1, 7, 1 << 20]
    for purpose in (SAMPLE, DRAFT, ACCEPT, RESIDUAL):
        want = uniforms(seeds, positions, purpose)
        got = uniforms_on_device(seeds, torch.tensor(positions), purpose)
        assert torch.equal(got, want), purpose


def test_device_sample_equals_the_sampler():
    """A batch of 60 rows: greedy, temperature with top-p / top-k / min-p, and rows verifying a sampled
    draft with its q (the "sampled" rule), each row's token equal to Sampler.sample's."""
    V, n = 300, 60
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, V, generator=g) * 4
    q = torch.softmax(torch.randn(n, V, generator=g) * 3, dim=-1)
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.9),
             SamplingParams(temperature=1.5, top_k=20, min_p=0.02), SamplingParams(temperature=0.7)]
    sampler = Sampler(V)
    params, seeds, positions, host_rows, verifies, drafts = [], [], [], [], [], []
    for i in range(n):
        p = dataclasses.replace(kinds[i % 4], seed=100 + i)
        state = sampler.new_state(p)
        pos = 17 + 3 * i
        verify = not p.greedy and i % 3 == 0
        d = int(torch.multinomial(q[i], 1, generator=g)) if verify else 0
        extra = dict(draft_id=d, draft_probs=q[i]) if verify else {}
        host_rows.append(SamplingRow(state, (), pos, **extra))
        params.append(p)
        seeds.append(state.seed)
        positions.append(pos)
        verifies.append(verify)
        drafts.append(d)
    want = sampler.sample(logits.clone(), host_rows, advance=False).token_ids
    rows = DeviceRows(params, seeds, torch.tensor(positions), draft_ids=torch.tensor(drafts),
                      draft_probs=q, verifies=torch.tensor(verifies))
    got = sample_on_device(logits.clone(), rows)
    assert torch.equal(got, want)
    assert sum(verifies) > 5 and len(set(want.tolist())) > 20       # the rows exercise every path


def test_device_samplable():
    assert device_samplable(SamplingParams(temperature=0.8, top_p=0.9, seed=1))
    assert device_samplable(SamplingParams(temperature=0.8, logprobs=2))      # logprobs_on_device
    assert not device_samplable(SamplingParams(temperature=0.8, constraint=OutputConstraint("regex", "a+")))
    assert device_samplable(SamplingParams(temperature=0.8, presence_penalty=0.5))  # penalize_on_device
    assert not device_samplable(None)


def test_top_p_without_host_read_equals_the_host_cut():
    """filtered_probs(no_host_read=True) (overlapped steps on CUDA: every row sorted whole) keeps the
    same probabilities as the host branch, nuclei wider than TOP_P_FIRST_K included (near-flat rows)."""
    from deepinfer.sample.sampler import TOP_P_FIRST_K, filtered_probs
    g = torch.Generator().manual_seed(0)
    for scale in (0.05, 1.0, 5.0):
        x = torch.randn(12, 5000, generator=g) * scale
        params = [SamplingParams(temperature=0.7 + 0.1 * i, top_p=[0.5, 0.9, 0.99, 1.0][i % 4],
                                 top_k=[0, 50, 0, 3000][i % 4]) for i in range(12)]
        want = filtered_probs(x.clone(), params)
        assert torch.equal(filtered_probs(x.clone(), params, no_host_read=True), want)
        if scale < 0.1:
            assert int((want[2] > 0).sum()) > TOP_P_FIRST_K      # the wide-nucleus case happened


def test_logprobs_on_device_are_the_samplers():
    """logprobs_on_device: rows that ask get the sampled token's logprob and their first n alternatives of
    the raw log_softmax (the Sampler's helpers), other rows None; nothing read on the host before rows()."""
    from deepinfer.sample.device_sampling import logprobs_on_device
    from deepinfer.sample.sampler import TokenLogprob
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (6,), generator=g)
    ns = [None, 0, 3, None, 20, 5]
    params = [SamplingParams(logprobs=n) for n in ns]
    copies = []
    out = logprobs_on_device(logits, tokens, params, lambda t: copies.append(t) or t)
    assert len(copies) == 3
    rows = out.rows()
    lp = torch.log_softmax(logits, dim=-1)
    for i, n in enumerate(ns):
        if n is None:
            assert rows[i] is None
            continue
        order = torch.argsort(lp[i], descending=True)[:n].tolist()
        assert isinstance(rows[i], TokenLogprob) and rows[i].logprob == lp[i, tokens[i]].item()
        assert [t for t, _ in rows[i].top] == order and [v for _, v in rows[i].top] == lp[i, order].tolist()
    assert logprobs_on_device(logits, tokens, [SamplingParams()] * 6, lambda t: t) is None


def test_penalties_on_device_are_the_samplers():
    """penalize_on_device: a row's history split into its request's outputs on the host (counted once a
    request; two rows of one request here), the previous step's new tokens (device, -1 padded) and the
    drafts fed before it gives the Sampler's penalized logits bit for bit."""
    from deepinfer.sample.device_sampling import penalize_on_device
    from deepinfer.sample.sampler import SamplingState
    g = torch.Generator().manual_seed(5)
    V = 40
    logits = torch.randn(5, V, generator=g) * 3
    known = [[1, 2, 2], [], [7, 7, 7, 3]]          # per request
    owner = [0, 1, 2, 2]                           # per penalized row
    new = torch.tensor([[4, 2, -1], [-1, -1, -1], [9, 9, 3], [9, 9, 3]])
    look = torch.tensor([[8, 8], [0, 0], [3, 11], [3, 11]])
    look_len = [2, 0, 0, 1]
    p2 = SamplingParams(frequency_penalty=-0.75, presence_penalty=0.5)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(presence_penalty=1.0),
              p2, p2]
    rows = [0, 2, 3, 4]                            # logits row 1 asks for none
    got = penalize_on_device(logits, rows, params, [np.asarray(k, dtype=np.int64) for k in known], owner, new,
                             look, look_len)
    hist = [known[o] + [t for t in new[i].tolist() if t >= 0] + look[i, :look_len[i]].tolist()
            for i, o in enumerate(owner)]
    sampler_rows = [SamplingRow(SamplingState(p, 0), h, 0) for p, h in zip(params, hist)]
    want = logits.clone()
    sub = want[rows].clone()
    Sampler._apply_penalties(sub, sampler_rows)
    want[rows] = sub
    assert torch.equal(got, want) and not torch.equal(got, logits)
