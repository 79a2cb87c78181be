"""spec/device_resolution.py: a verify step resolved with tensor ops (accepted counts, new tokens,
the next step's anchor / positions / draft slots) equals the host reference ModelRunner._accept,
on random ragged steps with drafts that partly match, prompt chunks without logits rows, plain
decode rows and replayed accepted lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.spec.device_resolution import resolve_on_device
from deepinfer.worker.model_runner import ModelRunner

K = 5


def random_step(rng: np.random.Generator, B: int, with_drafts: bool = True):
    """-> (sampled [N], fed [N] | None, num_logits, num_spec, start, q_lens): a step's shape and tokens,
    drafts that match the target's tokens for a random prefix (then differ, or run out)."""
    num_spec = rng.integers(0, K + 1, B) if with_drafts else np.zeros(B, dtype=np.int64)
    chunk = rng.random(B) < 0.2                      # a prompt chunk short of its end: no logits rows
    num_spec[chunk] = 0
    num_logits = np.where(chunk, 0, 1 + num_spec)
    q_lens = np.where(chunk, rng.integers(1, 9, B), 1 + num_spec + rng.integers(0, 3, B) * (num_spec == 0))
    start = rng.integers(0, 50, B)
    sampled, fed = [], []
    for b in range(B):
        n, k = int(num_logits[b]), int(num_spec[b])
        if not n:
            continue
        g = rng.integers(0, 20, n)
        good = rng.integers(0, k + 1)                # drafts d_1..d_good equal g_0..g_(good-1)
        d = np.where(np.arange(k) < good, g[:k], (g[:k] + 1 + rng.integers(0, 3, k)) % 20)
        sampled += g.tolist()
        fed += [int(rng.integers(0, 20))] + d.tolist()
    to = lambda a: torch.tensor(a, dtype=torch.int64)   # noqa: E731
    return to(sampled), (to(fed) if with_drafts else None), num_logits.astype(np.int64), \
        num_spec.astype(np.int64), start.astype(np.int64), q_lens.astype(np.int64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("replay", [False, True])
def test_device_resolution_equals_host_accept(seed, replay):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 12))
    sampled, fed, num_logits, num_spec, start, q_lens = random_step(rng, B)
    replayed = np.where(rng.random(B) < 0.5, rng.integers(0, K + 2, B), -1) if replay else None
    want = ModelRunner._accept(sampled.numpy(), num_logits, num_spec, fed.numpy(), replayed)
    res = resolve_on_device(sampled, fed, num_logits, num_spec, start, q_lens, replayed)
    assert res.per_request() == want
    acc = np.array([max(len(t) - 1, 0) for t in want])
    assert res.num_accepted.tolist() == acc.tolist()
    # the next step runs the anchor (the last new token) at the position after the accepted ones
    assert res.anchor.tolist() == [t[-1] if t else -1 for t in want]
    want_pos = np.where(num_logits > 0, start + q_lens - num_spec + acc, start + q_lens)
    assert res.next_pos.tolist() == want_pos.tolist()
    assert res.draft_positions(K).tolist() == (want_pos[:, None] + np.arange(1, K + 1)).tolist()
    assert (acc <= num_spec).all() and (acc[num_logits > 0] < num_logits[num_logits > 0]).all()


def test_device_resolution_without_drafts():
    """A step with no drafts at all (fed None): one token per sampling request, at start + q."""
    rng = np.random.default_rng(7)
    sampled, fed, num_logits, num_spec, start, q_lens = random_step(rng, 9, with_drafts=False)
    want = ModelRunner._accept(sampled.numpy(), num_logits, num_spec, None)
    res = resolve_on_device(sampled, fed, num_logits, num_spec, start, q_lens)
    assert res.per_request() == want
    assert res.next_pos.tolist() == (start + q_lens).tolist()


def test_every_draft_rejected_and_every_draft_accepted():
    """The two ends of the worst-case reservation: a = 0 (the trim frees k slots) and a = k."""
    g = torch.tensor([5, 6, 7, 8, 1, 2, 3])
    fed = torch.tensor([0, 5, 6, 7, 0, 9, 9])       # request 0: all 3 drafts match; request 1: none
    res = resolve_on_device(g, fed, np.array([4, 3]), np.array([3, 2]), np.array([10, 20]), np.array([4, 3]))
    assert res.num_accepted.tolist() == [3, 0]
    assert res.per_request() == [[5, 6, 7, 8], [1]]
    assert res.next_pos.tolist() == [14, 21]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_resolution_on_cuda_does_not_sync():
    """On the GPU the resolution is launched without the host waiting for the stream (sync debug
    mode "error" raises on any synchronizing call), and equals the host reference."""
    rng = np.random.default_rng(11)
    for _ in range(4):
        sampled, fed, num_logits, num_spec, start, q_lens = random_step(rng, 16)
        want = ModelRunner._accept(sampled.numpy(), num_logits, num_spec, fed.numpy())
        s, f = sampled.cuda(), fed.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            res = resolve_on_device(s, f, num_logits, num_spec, start, q_lens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert res.next_pos.is_cuda and res.per_request() == want
