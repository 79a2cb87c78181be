"""A prefill instance with nothing to run but caches held for decoders: its connector polls back off (1 ms
doubling to HOLD_POLL_MAX_S, not a 1 kHz loop), start over when anything happens, and under AsyncEngine a new
request ends the wait at once."""

from __future__ import annotations

import threading

import pytest

from deepinfer.disagg.nixl_transport import import_nixl

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from deepinfer import engine as engine_mod  # noqa: E402
from deepinfer.async_engine import AsyncEngine  # noqa: E402
from deepinfer.config import EngineArgs  # noqa: E402
from deepinfer.engine import Engine  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import build_fixture  # noqa: E402
from tests.disagg.test_handover import engine_args  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_fixture("v41-tiny-bf16", tmp_path_factory)


def run_to_hold(engine: Engine, rid: str, prompt: list[int]) -> None:
    engine.add_request(rid, prompt, ONE)
    while engine.scheduler.has_unfinished_requests():
        outs = engine.step()
        if any(o.request_id == rid and o.finished for o in outs):
            assert next(o for o in outs if o.request_id == rid).kv_transfer_params is not None
    assert rid in engine.connector.held


def test_idle_polls_back_off_while_only_holds_are_open(ckpt):
    engine = Engine(EngineArgs(**engine_args(ckpt, kv_role="prefill")))
    try:
        waits = []
        engine.idle_sleep = waits.append
        run_to_hold(engine, "a", list(range(5, 40)))
        waits.clear()
        for _ in range(8):
            assert engine.has_unfinished_requests()          # the hold keeps the loop stepping
            engine.step()
        assert waits == [0.001, 0.002, 0.004, 0.008, 0.016, engine_mod.HOLD_POLL_MAX_S,
                         engine_mod.HOLD_POLL_MAX_S, engine_mod.HOLD_POLL_MAX_S]
        # a request to run: no wait while it runs; once it is held too, the backoff starts over
        waits.clear()
        engine.add_request("b", list(range(7, 30)), ONE)
        assert engine.idle_poll_wait() is None
        while engine.scheduler.has_unfinished_requests():
            engine.step()
        assert waits == [] and "b" in engine.connector.held
        engine.step()
        engine.step()
        assert waits == [0.001, 0.002]
        # a hold that ends (its deadline here) is something happening: the next wait is the shortest again
        for h in engine.connector.held.values():
            h.deadline = 0.0
        engine.step()
        assert not engine.connector.held and not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_a_new_request_ends_an_idle_wait(ckpt, monkeypatch):
    """With the first idle wait set to ten minutes, a request sent while the engine waits beside its hold still
    runs at once: AsyncEngine's wait ends on its wakeup event."""
    monkeypatch.setattr(engine_mod, "IDLE_POLL_S", 600.0)
    monkeypatch.setattr(engine_mod, "HOLD_POLL_MAX_S", 600.0)
    eng = AsyncEngine(EngineArgs(**engine_args(ckpt, kv_role="prefill")))
    waiting = threading.Event()
    wait = eng.engine.idle_sleep
    eng.engine.idle_sleep = lambda s: (waiting.set(), wait(s))[1]
    try:
        def run(rid, prompt):
            done = threading.Event()
            outs = []
            eng.add_request(rid, prompt, ONE, lambda o: (outs.append(o), o.finished and done.set()))
            assert done.wait(120), f"{rid} got no final output"
            assert outs[-1].finish_reason == "length" and outs[-1].kv_transfer_params is not None
        run("a", list(range(5, 40)))
        assert waiting.wait(60)                              # the engine waits beside a's hold
        run("b", list(range(9, 33)))
    finally:
        eng.shutdown()
