"""DSpark's overlapped verify steps with prefix caching on (the tiny model on CPU, batch_invariant=True, the
oracle proposer of test_spec_overlap.py): the scheduler no longer resolves every step first when the cache
is on. A request that ends while an overlapped step holding it is in flight leaves its window snapshot
(saved at the start of the next step, after the one in flight wrote past its end), and the next turn of
each conversation resumes from that snapshot with a cold run's tokens; with a host tier, blocks evicted
by an overlapped step's reservations are offloaded by that step (its copies run before its forward)."""

from __future__ import annotations

import pytest

from deepinfer import EngineArgs
from deepinfer.engine import Engine
from tests.engine.conftest import greedy
from tests.engine.test_spec_overlap import N_OUT, PROMPTS, numbered, oracle_drafts, run

pytestmark = pytest.mark.usefixtures("one_thread")

EXTRA = [[11, 12, 13], [200, 201], [77] * 5, [5, 6, 7, 8]]      # each conversation's next user turn
STOPPER = "3"        # stops on a token found while an overlapped step holds it


@pytest.fixture(scope="module")
def turns(spec_args):
    """(turn-1 prompts, sampling, the synchronous engine's turn-1 tokens, turn-2 prompts and a cold
    synchronous run's turn-2 tokens), speculation on and no prefix cache in either reference."""
    p1 = numbered(PROMPTS)
    ref1 = run(Engine(EngineArgs(**spec_args)), [greedy(N_OUT) for _ in p1], prompts=p1)[0]
    stop_tok = ref1[STOPPER][8]
    plist = [greedy(N_OUT, stop_token_ids=[stop_tok]) if rid == STOPPER else greedy(N_OUT) for rid in p1]
    ended = {rid: ref1[rid][:ref1[rid].index(stop_tok) + 1] if rid == STOPPER else ref1[rid] for rid in p1}
    p2 = numbered([p1[str(i)] + ended[str(i)] + EXTRA[i] for i in range(len(PROMPTS))], first=len(PROMPTS))
    ref2 = run(Engine(EngineArgs(**spec_args)), [greedy(N_OUT) for _ in p2], prompts=p2)[0]
    return p1, plist, ref1, ended, p2, ref2


def _two_turns(engine: Engine, turns, warm: dict[str, list[int]] | None = None,
               later: dict[str, list[int]] | None = None):
    """Turn 1 then turn 2 on the oracle's drafts; warm: requests run first, later: requests the test runs
    afterwards (the drafts of both all wrong)."""
    p1, plist, ref1, ended, p2, ref2 = turns
    others = {**(warm or {}), **(later or {})}
    oracle_drafts(engine, {**ref1, **ref2, **{rid: [] for rid in others}}, {**p1, **p2, **others})
    if warm:
        run(engine, [greedy(2) for _ in warm], prompts=warm)
    got1, reasons, _, stopped_in_overlap = run(engine, plist, prompts=p1)
    overlapped_turn1 = engine.num_verify_steps_overlapped
    got2 = run(engine, [greedy(N_OUT) for _ in p2], prompts=p2)[0]
    return got1, reasons, stopped_in_overlap, overlapped_turn1, got2


def test_overlap_with_prefix_caching_resumes_from_snapshots(spec_args, turns):
    p1, plist, ref1, ended, p2, ref2 = turns
    a = Engine(EngineArgs(**spec_args, enable_prefix_caching=True, async_scheduling=True))
    assert a.args.spec_async_overlap and a.runner.overlapped is not None
    got1, reasons, stopped_in_overlap, overlapped_turn1, got2 = _two_turns(a, turns)
    assert got1 == ended and reasons[STOPPER] == "stop"
    assert STOPPER in stopped_in_overlap, "the stop was not found with an overlapped step holding it in flight"
    assert overlapped_turn1 >= 4, "no verify step overlapped with the prefix cache on"
    c = a.stats.snapshot()["counters"]
    assert c["prefix_cache_snapshots_saved_total"] >= len(p1)
    assert c["prefix_cache_snapshot_hits_total"] == len(p2), "a turn 2 did not resume from its snapshot"
    assert got2 == ref2                                   # the snapshot hits give a cold run's tokens
    assert a.num_verify_steps_overlapped > overlapped_turn1
    a.kv_cache.check()


def test_overlapped_steps_carry_the_host_tiers_offloads(spec_args, turns):
    """A device pool of 24 blocks filled with idle cached blocks by earlier requests: the overlapped steps'
    worst-case reservations evict them, so those steps carry offloads, which they run before their
    forward; the turns' tokens stay the references'."""
    p1, plist, ref1, ended, p2, ref2 = turns
    a = Engine(EngineArgs(**{**spec_args, "num_cache_blocks": 24}, enable_prefix_caching=True,
                          async_scheduling=True, host_cache_bytes=1 << 20))
    carried = []
    launch = a.runner.launch_overlapped

    def launch_overlapped(sched_out, prev):
        carried.extend(c.kind for c in sched_out.block_copies)
        return launch(sched_out, prev)
    a.runner.launch_overlapped = launch_overlapped
    warm = numbered([[1000 + 31 * i + j for j in range(40)] for i in range(4)], first=100)  # leave idle cached blocks
    again = numbered([p + [9, 10] for p in warm.values()], first=200)
    got1, reasons, _, overlapped_turn1, got2 = _two_turns(a, turns, warm, later=again)
    assert "offload" in carried, "no overlapped step carried a host-tier offload"
    assert got1 == ended and got2 == ref2
    # the warm requests again: their blocks come back from the host tier (the copies those steps made)
    cold = run(Engine(EngineArgs(**spec_args)), [greedy(4) for _ in again], prompts=again)[0]
    assert run(a, [greedy(4) for _ in again], prompts=again)[0] == cold
    c = a.stats.snapshot()["counters"]
    assert c["prefix_cache_host_offloads_total"] >= carried.count("offload") > 0
    assert c["prefix_cache_host_hits_total"] > 0
    a.kv_cache.check()
    a.kv_cache.host.check()
