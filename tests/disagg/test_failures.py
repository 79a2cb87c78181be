"""Bad input and failures around a hand-over: the request fails with a clear error, every block
and ring slot comes back on both sides, and the other requests keep going.

One prefill (holds expire after 1 s) and one decode (pulls time out after 3 s) process for the module."""

from __future__ import annotations

import socket
import time

import pytest

from deepinfer.disagg.nixl_transport import import_nixl

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from deepinfer.disagg.process import EngineProcess  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

PROMPT = [0, 19, 7, 300, 52, 11, 9, 1000, 4, 77] * 3


def args(ckpt, **kw) -> dict:
    return dict(checkpoint=str(ckpt), device="cpu", max_num_seqs=4, max_num_batched_tokens=64, block_tokens=8,
                num_cache_blocks=64, **kw)


@pytest.fixture(scope="module")
def decode(tiny_checkpoint):
    d = EngineProcess(args(tiny_checkpoint, kv_role="decode", kv_transfer_timeout_s=3.0), num_threads=1, name="decode")
    yield d
    d.close()


@pytest.fixture(scope="module")
def prefill(tiny_checkpoint):
    """A prefill that holds for 30 s (the tests that need it to expire or die start their own)."""
    p = start_prefill(tiny_checkpoint, timeout_s=30.0)
    yield p
    p.close()


def start_prefill(ckpt, timeout_s=1.0):
    return EngineProcess(args(ckpt, kv_role="prefill", kv_transfer_timeout_s=timeout_s), num_threads=1, name="prefill")


def prefill_once(prefill, rid, prompt=PROMPT, max_tokens=6):
    out = list(prefill.stream(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))[-1]
    assert out.kv_transfer_params is not None, out
    return out.kv_transfer_params


def run(engine, rid, prompt=PROMPT, max_tokens=6, **kw):
    return list(engine.stream(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **kw))


def wait_free(engine, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.state()
        if (s["cache_blocks_used"], s["ring_slots_used"], s["held"], s["loading"]) == (0, 0, 0, 0) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def assert_free(engine) -> None:
    s = wait_free(engine)
    assert (s["cache_blocks_used"], s["ring_slots_used"], s["held"], s["loading"]) == (0, 0, 0, 0), s


def test_blocks_that_no_longer_exist(decode, tiny_checkpoint):
    """The prefill freed the request's caches (no decode came within its timeout) and may have
    reused them: the decode's pull reads the slot's tag, sees it changed, and fails."""
    prefill = start_prefill(tiny_checkpoint, timeout_s=1.0)
    try:
        kv = prefill_once(prefill, "stale")
        time.sleep(1.5)
        assert_free(prefill)                        # freed at its deadline
        assert prefill.state()["stats"]["counters"]["kv_holds_expired_total"] == 1
        run(prefill, "reuse")                       # its slot and blocks now hold another request's state
        outs = run(decode, "stale", kv_transfer_params=kv)
        assert outs[-1].finish_reason == "error" and "no longer exist" in outs[-1].error, outs[-1]
        assert [t for o in outs for t in o.new_token_ids] == []
        assert_free(decode)
        good = run(decode, "good", kv_transfer_params=prefill_once(prefill, "good"))
        assert good[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in good) == 6
        assert_free(decode)
        assert_free(prefill)
    finally:
        prefill.close()


def test_transfer_timeout_from_a_silent_peer(decode, prefill):
    """A peer that accepts connections and never answers: the pull times out with the peer named,
    while a plain request on the same decode instance runs to the end."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        kv = prefill_once(prefill, "silent")
        kv = {**kv, "engine_id": "deepinfer-prefill-silent", "port": silent.getsockname()[1]}
        t0 = time.monotonic()
        q = decode.add("silent", PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       kv_transfer_params=kv)
        other = run(decode, "other", max_tokens=12)
        assert other[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in other) == 12
        out = q.get(timeout=60)
        assert out.finish_reason == "error" and "timed out" in out.error and str(kv["port"]) in out.error, out
        assert time.monotonic() - t0 >= 2.5
        assert_free(decode)
    finally:
        silent.close()


def test_prefill_goes_down_mid_request(decode, tiny_checkpoint):
    """The prefill process dies after handing over: the pull fails (error or timeout), nothing leaks
    on the decode side, and the decode instance keeps serving."""
    prefill = start_prefill(tiny_checkpoint, timeout_s=30.0)
    kv = prefill_once(prefill, "orphan")
    prefill.kill()
    outs = run(decode, "orphan", kv_transfer_params=kv)
    assert outs[-1].finish_reason == "error" and kv["engine_id"] in outs[-1].error, outs[-1]
    assert_free(decode)
    assert run(decode, "after", max_tokens=4)[-1].finish_reason == "length"
    assert decode.state()["stats"]["counters"]["kv_transfer_failures_total"] >= 1


def test_abort_while_pulling_frees_the_blocks(decode, prefill):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        kv = {**prefill_once(prefill, "ab"), "engine_id": "deepinfer-prefill-gone", "port": silent.getsockname()[1]}
        q = decode.add("ab", PROMPT, SamplingParams(max_tokens=6, temperature=0), kv_transfer_params=kv)
        time.sleep(0.3)
        assert decode.state()["loading"] == 1
        decode.abort("ab")
        out = q.get(timeout=30)
        assert out.finish_reason == "abort", out
        assert_free(decode)
    finally:
        silent.close()


@pytest.mark.parametrize("bad, message", [
    ({"engine_id": "x"}, "missing"),
    ("not an object", "must be an object"),
])
def test_malformed_params_are_refused(decode, bad, message):
    outs = run(decode, f"bad-{message}", kv_transfer_params=bad)
    assert outs[-1].finish_reason == "error" and message in outs[-1].error, outs[-1]
    assert_free(decode)


def test_params_of_another_layout_are_refused(decode, prefill):
    kv = {**prefill_once(prefill, "lay"), "layout": "0123456789abcdef"}
    outs = run(decode, "lay", kv_transfer_params=kv)
    assert outs[-1].finish_reason == "error" and "cache layout" in outs[-1].error, outs[-1]
    kv = prefill_once(prefill, "short")
    outs = run(decode, "short", prompt=PROMPT[:-1], kv_transfer_params=kv)
    assert outs[-1].finish_reason == "error" and "positions" in outs[-1].error, outs[-1]
    assert_free(decode)


def test_first_token_ends_the_request_without_a_pull(decode, prefill):
    """max_tokens=1 on the decode side: the prefill's token is the whole answer; the prefill is told
    to free at once (no wait for its timeout)."""
    kv = prefill_once(prefill, "one")
    pulled = decode.state()["stats"]["counters"]["kv_transfer_bytes_total"]
    freed = prefill.state()["stats"]["counters"]["kv_transfers_total"]     # frees on a decode's word
    outs = run(decode, "one", max_tokens=1, kv_transfer_params=kv)
    assert [o.new_token_ids for o in outs] == [[kv["first_token_id"]]] and outs[-1].finish_reason == "length"
    deadline = time.monotonic() + 10
    while prefill.state()["stats"]["counters"]["kv_transfers_total"] == freed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.state()["stats"]["counters"]["kv_transfers_total"] == freed + 1
    assert_free(decode)
    assert decode.state()["stats"]["counters"]["kv_transfer_bytes_total"] == pulled
