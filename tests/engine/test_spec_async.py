"""DSpark speculation under async scheduling (EngineArgs(async_scheduling=True), forcible on CPU):
the same tokens as the synchronous engine under batch_invariant=True, with the greedy and the
sampled acceptance rule, a request that stops on a stop token and one aborted while a step
holding it is in flight. Steps that sample nothing (prefill chunks) are launched with the previous
one still in flight; a step that verifies / proposes drafts is resolved before the next schedule
(engine.py: its accepted counts set the next step's positions)."""

from __future__ import annotations

import pytest

from deepinfer import EngineArgs, SamplingParams
from deepinfer.engine import Engine

# a long prompt prefilled over several budget-limited steps (the overlapped ones), short ones beside it
PROMPTS = [[(7 * i) % 1000 + 10 for i in range(150)], list(range(500, 530)), [3, 4, 5], [9] * 12]


@pytest.fixture(scope="module")
def args(tiny_engine_args):
    return {**tiny_engine_args, "max_num_batched_tokens": 40, "num_cache_blocks": 96, "batch_invariant": True,
            "speculative": "dspark", "spec_policy": "threshold", "spec_confidence_threshold": 0.0}


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def sampled(n, seed):
    # the tiny model's logits are ~100 wide: temperature 8 spreads its samples
    return SamplingParams(max_tokens=n, temperature=8.0, top_p=0.95, seed=seed, ignore_eos=True)


def run(engine: Engine, plist, abort=None):
    """Step to the end; abort = (req_id, n): abort it right after the step() call in which it has
    received n tokens (under async scheduling a step holding it is then in flight)."""
    overlapped = []
    launch = engine.runner.launch

    def recording_launch(*a, **kw):
        overlapped.append(engine._in_flight is not None)
        return launch(*a, **kw)

    engine.runner.launch = recording_launch
    for i, sp in enumerate(plist):
        engine.add_request(str(i), PROMPTS[i], sp)
    got = {str(i): [] for i in range(len(plist))}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if abort is not None and len(got[abort[0]]) >= abort[1] and abort[0] not in reasons:
            in_flight = engine._in_flight is not None and abort[0] in engine._in_flight[0].num_scheduled_tokens
            engine.abort(abort[0])
            reasons[abort[0]] = "abort"
            abort = (abort[0], -1, in_flight)
        engine.kv_cache.check()
    assert engine.kv_cache.num_used_blocks == 0
    return got, reasons, sum(overlapped), abort


def engine(args, **kw):
    return Engine(EngineArgs(**args, **kw))


def test_async_engine_is_on_with_speculation_only_when_asked(args):
    assert engine(args, async_scheduling=True).async_scheduling
    assert not engine(args).async_scheduling          # CPU default: sync
    assert engine(args, async_scheduling=True).runner.proposer is not None


@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_async_speculation_equals_sync(args, rule):
    plist = [greedy(12), sampled(10, 1), sampled(9, 2), greedy(14)]
    want, _, overlapped_sync, _ = run(engine(args, spec_acceptance=rule), plist)
    a = engine(args, spec_acceptance=rule, async_scheduling=True)
    got, _, overlapped, _ = run(a, plist)
    assert got == want
    assert all(len(got[str(i)]) == p.max_tokens for i, p in enumerate(plist))
    assert overlapped_sync == 0 and overlapped > 0     # prefill chunks launched with a step in flight
    c = a.stats.snapshot()["counters"]
    assert c["spec_draft_tokens_verified_total"] > 0 and c["spec_verify_steps_total"] > 0


def test_async_speculation_with_stop_and_abort_in_flight(args):
    """Request 3 stops on a token it generates (the 5th of its plain run); request 1 is aborted
    right after its 4th token, while a step holding it is in flight; the others keep their tokens."""
    base = [greedy(12), greedy(12), sampled(9, 2), greedy(14)]
    ref, _, _, _ = run(engine(args), base)
    stop_tok = ref["3"][4]
    plist = base[:3] + [greedy(14, stop_token_ids=[stop_tok])]
    want, want_r, _, _ = run(engine(args), plist, abort=("1", 4))
    got, got_r, overlapped, ab = run(engine(args, async_scheduling=True), plist, abort=("1", 4))
    assert ab[2], "the aborted request was not in the step in flight"
    assert got_r["3"] == want_r["3"] == "stop" and got["3"] == want["3"]
    assert got["3"][-1] == stop_tok and len(got["3"]) <= 5
    assert got_r["1"] == "abort" and 4 <= len(got["1"]) < 12
    assert got["1"] == ref["1"][:len(got["1"])]
    for r in ("0", "2"):
        assert got[r] == want[r] == ref[r]
    assert overlapped > 0
