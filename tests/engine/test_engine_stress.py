"""2,000 requests of random lengths through the AsyncEngine on the real tiny model, 20% aborted at
random moments, a cache small enough to force preemption: every request ends exactly once, no
token arrives after abort() returns, and no cache block is in use at the end."""

import random
import threading
import time

from deepinfer import AsyncEngine, EngineArgs, SamplingParams, UnknownRequestError

N = 2000
MAX_IN_FLIGHT = 96


def test_two_thousand_requests_with_aborts_and_preemption(tiny_checkpoint):
    rng = random.Random(1234)
    eng = AsyncEngine(EngineArgs(checkpoint=str(tiny_checkpoint), device="cpu", max_num_seqs=48,
                                 max_num_batched_tokens=256, block_tokens=8, num_cache_blocks=40))
    lock = threading.Lock()
    tokens: dict[str, int] = {}
    finals: dict[str, object] = {}
    abort_returned: set[str] = set()
    violations: list[str] = []
    slots = threading.Semaphore(MAX_IN_FLIGHT)

    def make_cb(rid):
        def cb(out):
            with lock:
                if rid in finals:
                    violations.append(f"{rid}: output after its final")
                if rid in abort_returned and out.new_token_ids:
                    violations.append(f"{rid}: tokens after abort")
                tokens[rid] += len(out.new_token_ids)
                if out.finished:
                    finals[rid] = out
                    slots.release()
        return cb

    t0 = time.monotonic()
    try:
        to_abort = []
        for i in range(N):
            rid = f"r{i}"
            slots.acquire()
            with lock:
                tokens[rid] = 0
            prompt = [rng.randrange(3, 120000) for _ in range(rng.randint(1, 24))]
            params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0, ignore_eos=True)
            eng.add_request(rid, prompt, params, make_cb(rid))
            if rng.random() < 0.2:
                to_abort.append((rid, rng.randint(0, 30)))  # abort after a random number of later submissions
            for j, (a_rid, delay) in enumerate(list(to_abort)):
                if delay <= 0:
                    to_abort.remove((a_rid, delay))
                    try:
                        eng.abort(a_rid)
                        with lock:
                            abort_returned.add(a_rid)
                    except UnknownRequestError:
                        pass  # finished before the abort: allowed
                else:
                    to_abort[to_abort.index((a_rid, delay))] = (a_rid, delay - 1)
            if rng.random() < 0.05:
                time.sleep(0.002)  # let the loop run steps between submissions
        for a_rid, _ in to_abort:
            try:
                eng.abort(a_rid)
                with lock:
                    abort_returned.add(a_rid)
            except UnknownRequestError:
                pass
        deadline = time.monotonic() + 600
        while len(finals) < N and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        eng.shutdown()
    elapsed = time.monotonic() - t0

    assert not violations, violations[:5]
    assert len(finals) == N, f"{N - len(finals)} requests never finished"
    reasons = {}
    for rid, out in finals.items():
        reasons[out.finish_reason] = reasons.get(out.finish_reason, 0) + 1
        assert out.finish_reason in ("length", "abort"), (rid, out)
        if rid in abort_returned:
            assert out.finish_reason == "abort", (rid, out)
        if out.finish_reason == "length":
            assert tokens[rid] == out.num_output_tokens
    stats = eng.stats()
    print(f"{N} requests in {elapsed:.1f}s: {reasons}, preemptions={stats['counters']['preemptions_total']}")
    assert reasons.get("abort", 0) >= 0.1 * N
    assert stats["counters"]["preemptions_total"] > 0
    assert eng.engine.kv_cache.num_used_blocks == 0 and stats["gauges"]["cache_blocks_used"] == 0
    eng.engine.kv_cache.check()
    assert not eng.engine.scheduler.requests and eng.num_in_flight() == 0
