import random

from deepinfer.request import RequestStatus
from tests.engine.conftest import create_scheduler, fake_runner_output, make_request


def run_step(sched, **kw):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner_output(out, sched, **kw))


def test_chunked_prefill_mixes_with_decode():
    sched = create_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 3, max_tokens=5))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 3}
    sched.add_request(make_request("b", 40))
    out, res = run_step(sched)
    # a decodes one token, b gets the rest of the budget as a prefill chunk
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [r.request_id for r in res] == ["a"]
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    out, res = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    assert {r.request_id for r in res} == {"a", "b"}


def test_token_budget_and_seq_cap():
    sched = create_scheduler(max_num_seqs=2, max_num_batched_tokens=10, num_blocks=100)
    for i in range(4):
        sched.add_request(make_request(i, 4))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4, "1": 4}
    assert out.total_num_scheduled_tokens == 8
    assert sched.num_waiting == 2


def test_finish_length_and_stop_free_blocks():
    sched = create_scheduler()
    sched.add_request(make_request("len", 5, max_tokens=3))
    sched.add_request(make_request("stop", 5, max_tokens=10, eos_token_id=7))
    finals = {}
    while sched.has_unfinished_requests():
        for r in run_step(sched)[1]:
            if r.finished:
                finals[r.request_id] = (r.finish_reason, r.num_output_tokens)
    assert finals == {"len": ("length", 3), "stop": ("stop", 1)}
    assert sched.kv_cache.num_used_blocks == 0
    sched.kv_cache.check()


def test_preemption_by_recompute_and_fits_alone():
    # 6 blocks of 4 = 24 positions; each request needs 4 + 12 = 16 positions: they cannot all fit
    sched = create_scheduler(num_blocks=6, block_tokens=4, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(i, 4, max_tokens=12))
    done, preempted_seen = set(), 0
    for _ in range(200):
        out, res = run_step(sched)
        preempted_seen += len(out.preempted_req_ids)
        sched.kv_cache.check()
        done |= {r.request_id for r in res if r.finished}
        if not sched.has_unfinished_requests():
            break
    assert done == {"0", "1", "2"}
    assert preempted_seen > 0 and sched.stats.counters["preemptions_total"] == preempted_seen
    assert sched.kv_cache.num_used_blocks == 0


def test_preempted_request_resumes_with_all_tokens():
    sched = create_scheduler(num_blocks=4, block_tokens=4, max_num_seqs=2, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 4, max_tokens=8))
    sched.add_request(make_request("b", 4, max_tokens=8))
    resumed = None
    for _ in range(50):
        out, _ = run_step(sched)
        for nr in out.new_reqs:
            if nr.req_id == "b" and len(nr.token_ids) > 4:
                resumed = nr
        if not sched.has_unfinished_requests():
            break
    assert resumed is not None and resumed.num_computed_tokens == 0
    assert resumed.token_ids[:4] == [1, 2, 3, 4] and resumed.token_ids[4:] == [7] * (len(resumed.token_ids) - 4)


def test_spec_tokens_rollback_frees_blocks():
    sched = create_scheduler(num_blocks=16, block_tokens=4)
    sched.add_request(make_request("a", 6, max_tokens=50))
    run_step(sched)                                    # prefill: computed 6, tokens 7
    req = sched.requests["a"]
    req.spec_token_ids = [11, 12, 13, 14, 15]          # 5 drafts: positions 6..11 scheduled
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6} and out.spec_tokens == {"a": [11, 12, 13, 14, 15]}
    assert len(sched.kv_cache.block_ids["a"]) == 3     # positions 0..11
    res = sched.update_from_output(out, fake_runner_output(out, sched, accept=lambda r, d: 1))
    # 1 of 5 accepted: computed = 6 + 6 - 4 = 8, tokens = prompt 6 + [7, 11, 7]
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert res[0].new_token_ids == [11, 7]
    assert len(sched.kv_cache.block_ids["a"]) == 2     # block of positions 8..11 freed
    sched.kv_cache.check()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_reqs[0].num_computed_tokens == 8 and out.cached_reqs[0].num_blocks == 2


def test_spec_tokens_all_rejected_and_truncated_by_budget():
    sched = create_scheduler(num_blocks=16, block_tokens=4, max_num_batched_tokens=3)
    sched.add_request(make_request("a", 3, max_tokens=50))
    run_step(sched)
    req = sched.requests["a"]
    req.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.spec_tokens == {"a": [11, 12]}
    sched.update_from_output(out, fake_runner_output(out, sched, accept=lambda r, d: 0))
    assert req.num_computed_tokens == 4 and req.output_token_ids == [7, 7]
    assert len(sched.kv_cache.block_ids["a"]) == 1


def test_abort_any_moment_frees_everything():
    rng = random.Random(0)
    sched = create_scheduler(num_blocks=12, block_tokens=4, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(40):
        sched.add_request(make_request(i, rng.randint(1, 20), max_tokens=rng.randint(1, 10)))
    aborted, finished = set(), set()
    while sched.has_unfinished_requests():
        if rng.random() < 0.3:
            rid = rng.choice(list(sched.requests))
            outs = sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            assert outs[0].finish_reason == "abort"
            aborted.add(rid)
        for r in run_step(sched)[1]:
            assert r.request_id not in aborted
            if r.finished:
                finished.add(r.request_id)
        sched.kv_cache.check()
    assert aborted | finished == {str(i) for i in range(40)} and not aborted & finished
    assert sched.kv_cache.num_used_blocks == 0


def test_prefill_only_steps_take_the_larger_budget():
    """No running request decodes: the step takes up to max_prefill_only_tokens of prompt chunks. Once one
    decodes, steps go back to max_num_batched_tokens (its inter-token latency is the step's time)."""
    sched = create_scheduler(max_num_batched_tokens=16, max_prefill_only_tokens=48, num_blocks=100)
    sched.add_request(make_request("a", 30, max_tokens=5))
    sched.add_request(make_request("b", 40, max_tokens=5))
    out, res = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 30, "b": 18} and out.total_num_scheduled_tokens == 48
    assert [r.request_id for r in res] == ["a"]                       # a's prompt is done: it decodes now
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}             # mixed: the plain budget
    sched.add_request(make_request("c", 50))
    out, _ = run_step(sched)
    assert out.total_num_scheduled_tokens <= 16 and out.num_scheduled_tokens["a"] == 1


def test_prefill_only_budget_defaults_and_rules():
    import pytest

    from deepinfer.config import PREFILL_ONLY_TOKENS_CUDA, EngineArgs
    a = EngineArgs(max_num_batched_tokens=2048)
    assert a.prefill_only_tokens("cuda") == PREFILL_ONLY_TOKENS_CUDA and a.prefill_only_tokens("cpu") == 2048
    assert EngineArgs(max_num_batched_tokens=16384).prefill_only_tokens("cuda:0") == 16384    # never below
    assert EngineArgs(max_prefill_only_tokens=4096).prefill_only_tokens("cpu") == 4096
    with pytest.raises(ValueError, match="max_prefill_only_tokens"):
        EngineArgs(max_num_batched_tokens=2048, max_prefill_only_tokens=1024)
    sched = create_scheduler(max_num_batched_tokens=16)                # None: the plain budget
    sched.add_request(make_request("a", 40))
    assert sched.schedule().total_num_scheduled_tokens == 16


def test_prefill_only_budget_off_follows_the_plain_budget():
    """Without a prefill-only budget a step takes max_num_batched_tokens as it is now (a caller lowering it
    gets chunks of the new size)."""
    sched = create_scheduler(max_num_batched_tokens=32)
    sched.max_num_batched_tokens = 8
    sched.add_request(make_request("a", 40))
    assert sched.schedule().total_num_scheduled_tokens == 8
