"""DSpark speculation under async scheduling (EngineArgs(async_scheduling=True), forcible on CPU):
the same tokens as the synchronous engine under batch_invariant=True, with the greedy and the
sampled acceptance rule, a request that stops on a stop token and one aborted while a step
holding it is in flight. Steps that sample nothing (prefill chunks) are launched with the previous
one still in flight; here the requests are short (max_tokens 6-9: under the worst-case reservation
any of them may be done) and a long prompt is prefilled beside them, so each verify step is resolved
before the next schedule (engine.py) and Engine.num_verify_steps_overlapped stays 0; verify steps
that overlap (greedy and sampled requests): test_spec_overlap.py."""

from __future__ import annotations

import pytest

from deepinfer import EngineArgs
from deepinfer.engine import Engine
from tests.engine.conftest import greedy, sampled

pytestmark = pytest.mark.usefixtures("one_thread")

# a long prompt prefilled over several budget-limited steps (the overlapped ones), short ones beside it
PROMPTS = [[(7 * i) % 1000 + 10 for i in range(60)], list(range(500, 520)), [3, 4, 5], [9] * 12]


@pytest.fixture(scope="module")
def args(spec_args):
    return spec_args


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


PLIST = {"identical": lambda: [greedy(8), sampled(7, 1), sampled(6, 2), greedy(9)],
         "sampled": lambda: [greedy(8), sampled(7, 1), sampled(6, 2), greedy(9)]}


@pytest.fixture(scope="module")
def sync_runs(args):
    """rule -> (tokens, engine) of the synchronous engine (the reference)."""
    cache = {}

    def get(rule):
        if rule not in cache:
            e = engine(args, spec_acceptance=rule)
            cache[rule] = run(e, PLIST[rule]())[0], e
        return cache[rule]
    return get


@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_async_speculation_equals_sync(args, sync_runs, rule):
    want, sync_engine = sync_runs(rule)
    assert not sync_engine.async_scheduling               # a CPU engine is synchronous unless asked
    a = engine(args, spec_acceptance=rule, async_scheduling=True)
    assert a.async_scheduling
    got, _, overlapped, _ = run(a, PLIST[rule]())
    assert got == want
    assert all(len(got[str(i)]) == p.max_tokens for i, p in enumerate(PLIST[rule]()))
    assert overlapped > 0                                  # prefill chunks launched with a step in flight
    # short requests and a long prefill beside them: each verify step waits for the one before it
    # (spec/overlap.py; verify steps that overlap: test_spec_overlap.py)
    assert a.num_resolved_before_schedule > 0 and a.num_verify_steps_overlapped == 0
    assert sync_engine.num_resolved_before_schedule == sync_engine.num_verify_steps_overlapped == 0
    c = a.stats.snapshot()["counters"]
    assert c["spec_draft_tokens_verified_total"] > 0 and c["spec_verify_steps_total"] > 0


def test_async_speculation_with_stop_and_abort_in_flight(args, sync_runs):
    """Request 3 stops on a token it generates (the 4th of its plain run); request 1 is aborted
    right after its 3rd token, while a step holding it is in flight; the others keep their tokens."""
    ref = sync_runs("identical")[0]
    stop_tok = ref["3"][3]
    plist = PLIST["identical"]()
    plist[3] = greedy(9, stop_token_ids=[stop_tok])
    want, want_r, _, _ = run(engine(args), plist, abort=("1", 3))
    got, got_r, overlapped, ab = run(engine(args, async_scheduling=True), plist, abort=("1", 3))
    assert ab[2], "the aborted request was not in the step in flight"
    assert got_r["3"] == want_r["3"] == "stop" and got["3"] == want["3"]
    assert got["3"][-1] == stop_tok and len(got["3"]) <= 4
    assert got_r["1"] == "abort" and 3 <= len(got["1"]) < 7
    assert got["1"] == ref["1"][:len(got["1"])]
    for r in ("0", "2"):
        assert got[r] == want[r] == ref[r]
    assert overlapped > 0
