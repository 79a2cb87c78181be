"""Prefill/decode disaggregation across rank workers (data_parallel_size > 1: gloo rank processes on
CPU, each rank's own NIXL agent over its own caches, UCX between processes): a hand-over names the
prefill rank that holds the caches, the decode places the pull on one of its ranks like a new request,
and that rank READs from the prefill rank. Under batch_invariant the tokens equal a single colocated
instance's for 2 -> 2, 1 -> 2 and 2 -> 1 ranks; every held block and slot comes back on every rank;
a pull from a silent or gone peer fails alone, an abort mid-pull frees its blocks, the decode keeps
serving (disagg/rank_connector.py, disagg/rank_transfer.py)."""

from __future__ import annotations

import glob
import os
import signal
import socket
import time

import numpy as np
import pytest

from deepinfer.disagg.nixl_transport import import_nixl

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from deepinfer.config import EngineArgs  # noqa: E402
from deepinfer.disagg.process import EngineProcess  # noqa: E402
from deepinfer.engine import Engine  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import build_fixture  # noqa: E402
from tests.disagg.test_handover import engine_args, single_instance  # noqa: E402
from tests.disagg.test_handover import hand_over_all as hand_over  # noqa: E402
from tests.disagg.test_handover_images import PARAMS as IMAGE_PARAMS  # noqa: E402
from tests.disagg.test_handover_images import REQUESTS  # noqa: E402
from tests.disagg.test_handover_images import engine_args as image_args  # noqa: E402
from tests.engine.conftest import drain  # noqa: E402

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DECODE_TIMEOUT_S = 5.0          # the silent peer's pull fails after this


def pd_args(ckpt, role: str, ranks: int, **kw) -> dict:
    return engine_args(ckpt, kv_role=role, data_parallel_size=ranks, worker_threads=1, batch_invariant=True, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_fixture("v41-tiny-bf16", tmp_path_factory)


@pytest.fixture(scope="module")
def instance(ckpt):
    """instance(role, ranks, **engine_args) -> the module's EngineProcess of that kind (started once)."""
    started: dict[tuple, EngineProcess] = {}

    def get(role: str, ranks: int, **kw) -> EngineProcess:
        key = (role, ranks, tuple(sorted(kw.items())))
        if key not in started:
            if role == "decode":
                kw.setdefault("kv_transfer_timeout_s", DECODE_TIMEOUT_S)
            started[key] = EngineProcess(pd_args(ckpt, role, ranks, **kw), num_threads=1, name=f"{role}-{ranks}")
        return started[key]
    yield get
    for p in started.values():
        p.close()


@pytest.fixture(scope="module")
def single_with_images(tiny_checkpoint):
    """tests/disagg/test_handover_images.py's requests on a single colocated instance: tokens by id."""
    engine = Engine(EngineArgs(**image_args(tiny_checkpoint)))
    toks = {}
    for rid, (prompt, images) in REQUESTS.items():
        engine.add_request(rid, prompt, IMAGE_PARAMS, images=images)
        toks.update(drain(engine)[0])
    return toks


@pytest.fixture(scope="module")
def reference(ckpt):
    """Four prompts (18 and 145 tokens, two of 12 and 17) and a single colocated instance's tokens."""
    expected = np.load(ckpt / "expected.npz")
    long = expected["p2_prompt_ids"].tolist()
    prompts = {"p0": expected["p0_prompt_ids"].tolist(), "p1": expected["p1_prompt_ids"].tolist(),
               "s0": long[:12], "s1": long[5:22]}
    tokens, _ = single_instance(ckpt, prompts, {rid: PARAMS for rid in prompts})
    return prompts, tokens


def counters(p: EngineProcess) -> dict:
    return p.state()["stats"]["counters"]


def rank_tokens(p: EngineProcess) -> list[int]:
    """Tokens each rank of the instance generated (the prefill's first token is not among them)."""
    s = p.state()
    ranks = s["stats"]["gauges"].get("ranks")           # set by the first step of a multi-rank engine
    if len(s["rank_blocks_used"]) == 1:
        return [s["stats"]["counters"]["generation_tokens_total"]]
    return [r["generation_tokens_total"] for r in ranks] if ranks else [0] * len(s["rank_blocks_used"])


def wait_free(p: EngineProcess, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = p.state()
        if (s["ring_slots_used"], s["held"], s["loading"]) == (0, 0, 0) and not any(s["rank_blocks_used"]) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def assert_free(*procs: EngineProcess) -> None:
    """Every block and ring slot back on every rank; nothing held or being pulled."""
    for p in procs:
        s = wait_free(p)
        assert (s["ring_slots_used"], s["held"], s["loading"], s["requests"]) == (0, 0, 0, 0), s
        assert s["rank_blocks_used"] == [0] * len(s["rank_blocks_used"]), s


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), pids


def hand_over_all(prefill, decode, prompts: dict, params=PARAMS) -> tuple[dict, dict]:
    return hand_over(prefill, decode, prompts, params)


@pytest.mark.parametrize("prefill_ranks, decode_ranks, pipelined", [(2, 2, False), (1, 2, False), (2, 1, False),
                                                                    (2, 2, True)])
def test_tokens_equal_a_single_instance(instance, reference, prefill_ranks, decode_ranks, pipelined):
    """The hand-over names the prefill rank holding the caches (its own agent); the decode spreads the
    pulls over its ranks; the tokens are a single instance's; the holds are freed by the decode's word.
    pipelined: both instances under async scheduling (the GPU default: the round trip follows the
    pipelined step, the ranks already running the next)."""
    kw = {"async_scheduling": True} if pipelined else {}
    prefill, decode = instance("prefill", prefill_ranks, **kw), instance("decode", decode_ranks, **kw)
    assert prefill.state()["async_scheduling"] == decode.state()["async_scheduling"] == pipelined
    prompts, ref = reference
    freed, before = counters(prefill)["kv_transfers_total"], rank_tokens(decode)
    kvs, tokens = hand_over_all(prefill, decode, prompts)
    assert tokens == ref
    agents = {kv["engine_id"] for kv in kvs.values()}
    if prefill_ranks == 2:
        assert len(agents) == 2 and {a.split("-")[2] for a in agents} == {"rank0", "rank1"}, agents
    else:
        assert len(agents) == 1
    after = rank_tokens(decode)
    assert all(a > b for a, b in zip(after, before)), (before, after)   # every decode rank took pulls
    assert sum(after) - sum(before) == sum(len(t) - 1 for t in ref.values())
    assert_free(prefill, decode)
    c = counters(prefill)
    assert c["kv_transfers_total"] == freed + len(prompts) and c["kv_holds_expired_total"] == 0


def test_replay_mode_across_ranks(instance, reference):
    """kv_transfer_window=False on a 2-rank decode: only the full blocks below H move, the window is
    replayed on the rank that pulled; prompts of 18 and 145 tokens replay from 0, so under
    batch_invariant the tokens are a single instance's; the bytes are whole blocks only."""
    prompts, ref = reference
    prefill, decode = instance("prefill", 2), instance("decode", 2, kv_transfer_window=False)
    short = {rid: prompts[rid] for rid in ("p0", "p1")}
    kvs, tokens = hand_over_all(prefill, decode, short)
    assert tokens == {rid: ref[rid] for rid in short}
    c = counters(decode)
    assert c["kv_transfer_replayed_tokens_total"] == 18 + 145
    window_bytes = sum(kv["num_bytes"] for kv in kvs.values())
    assert 0 < c["kv_transfer_bytes_total"] < window_bytes / 4
    assert c["kv_transfer_bytes_total"] % (145 // 64 * 64) == 0          # 2 full blocks of p1, none of p0
    assert_free(prefill, decode)


def test_a_hold_past_its_deadline_is_freed_on_its_rank_and_a_late_pull_fails_alone(ckpt, instance, reference):
    """A prefill on 2 ranks whose holds expire after 1.5 s: the held rank frees (its tag zeroed first),
    the late decode's pull reads a changed tag and fails with "no longer exist"; a hand-over from
    another prefill runs to the end on the same decode meanwhile. Then that prefill is killed after a
    hand-over: the pull fails naming its rank's agent, the decode frees everything and keeps serving."""
    prompts, ref = reference
    decode = instance("decode", 2)
    short = EngineProcess(pd_args(ckpt, "prefill", 2, kv_transfer_timeout_s=1.5), num_threads=1, name="prefill-short")
    try:
        stale = list(short.stream("stale", prompts["s0"], PARAMS))[-1].kv_transfer_params
        time.sleep(2.0)
        assert_free(short)
        assert counters(short)["kv_holds_expired_total"] == 1
        good = instance("prefill", 2).add("good", prompts["s1"], PARAMS)
        q = decode.add("stale", prompts["s0"], PARAMS, kv_transfer_params=stale)
        _, tokens = hand_over_all(instance("prefill", 2), decode, {"good2": prompts["s1"]})
        assert tokens["good2"] == ref["s1"]
        out = q.get(timeout=60)
        assert out.finish_reason == "error" and "no longer exist" in out.error and stale["engine_id"] in out.error, out
        kv = good.get(timeout=300).kv_transfer_params      # pulled late, still held: fine
        assert [t for o in decode.stream("good", prompts["s1"], PARAMS, kv_transfer_params=kv)
                for t in o.new_token_ids] == ref["s1"]
        assert_free(short, decode, instance("prefill", 2))
        orphan = list(short.stream("orphan", prompts["p0"], PARAMS))[-1].kv_transfer_params
        ranks = short.state()["rank_pids"]
        assert len(ranks) == 2, ranks
        short.kill()
        wait_gone(ranks)                                   # rank workers follow their engine process (0.5 s)
        assert not glob.glob(f"/dev/shm/deepinfer-*-{short.proc.pid}-*")   # and remove its /dev/shm names
        outs = list(decode.stream("orphan", prompts["p0"], PARAMS, kv_transfer_params=orphan))
        assert outs[-1].finish_reason == "error" and orphan["engine_id"] in outs[-1].error, outs[-1]
        assert_free(decode)
        plain = list(decode.stream("after", prompts["s1"], PARAMS))
        assert plain[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in plain) == 6
    finally:
        short.close()


def test_a_silent_or_gone_peer_fails_that_pull_alone(instance, reference):
    """Two pulls whose params name a peer that never answers (a socket that accepts, then nothing) and
    one that is gone (nothing listens): each fails with its peer named, while a hand-over and a plain
    request on the same 2-rank decode run to the end; nothing stays allocated."""
    prompts, ref = reference
    prefill, decode = instance("prefill", 2), instance("decode", 2)
    kvs, _ = hand_over_all(prefill, decode, {"model": prompts["s0"]})
    kv = kvs["model"]                                      # a real hand-over's layout and addresses
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone_port = s.getsockname()[1]
    failures = counters(decode)["kv_transfer_failures_total"]
    try:
        t0 = time.monotonic()
        qs = {name: decode.add(name, prompts["s0"], PARAMS,
                               kv_transfer_params={**kv, "engine_id": f"deepinfer-prefill-rank1-{name}", "port": port})
              for name, port in (("silent", silent.getsockname()[1]), ("gone", gone_port))}
        _, tokens = hand_over_all(prefill, decode, {"alive": prompts["p0"]})
        assert tokens["alive"] == ref["p0"]
        plain = list(decode.stream("plain", prompts["s1"], PARAMS))
        assert plain[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in plain) == 6
        for name, q in qs.items():
            out = q.get(timeout=60)
            assert out.finish_reason == "error" and f"deepinfer-prefill-rank1-{name}" in out.error, out
        assert time.monotonic() - t0 >= DECODE_TIMEOUT_S - 0.5     # the silent one waited out its deadline
        assert counters(decode)["kv_transfer_failures_total"] == failures + 2
        assert_free(prefill, decode)
    finally:
        silent.close()


def test_abort_during_a_pull_frees_the_blocks(instance, reference):
    prompts, _ = reference
    prefill, decode = instance("prefill", 2), instance("decode", 2)
    kvs, _ = hand_over_all(prefill, decode, {"model2": prompts["p1"]})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        kv = {**kvs["model2"], "engine_id": "deepinfer-prefill-rank0-unanswered", "port": silent.getsockname()[1]}
        q = decode.add("ab", prompts["p1"], PARAMS, kv_transfer_params=kv)
        deadline = time.monotonic() + 10
        while not any(decode.state()["rank_blocks_used"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        s = decode.state()
        assert s["loading"] == 1 and sum(s["rank_blocks_used"]) == 3, s      # 145 tokens: 3 blocks on its rank
        decode.abort("ab")
        out = q.get(timeout=30)
        assert out.finish_reason == "abort", out
        assert_free(decode)
    finally:
        silent.close()


def test_a_rank_that_dies_mid_pull_fails_the_pull_with_the_engine(instance, reference):
    """A decode rank worker killed while a pull waits on a silent peer (under async scheduling): the engine
    dies (EngineDeadError) and the pulling request gets its final output with the reason, not silence."""
    prompts, _ = reference
    prefill = instance("prefill", 2)
    # the pipelined decode of test_tokens_equal_a_single_instance[2-2-True], done with by now: it will not survive
    decode = instance("decode", 2, async_scheduling=True)
    kvs, _ = hand_over_all(prefill, decode, {"model3": prompts["s0"]})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        kv = {**kvs["model3"], "engine_id": "deepinfer-prefill-rank0-unanswered", "port": silent.getsockname()[1]}
        q = decode.add("doomed", prompts["s0"], PARAMS, kv_transfer_params=kv)
        deadline = time.monotonic() + 10
        while decode.state()["loading"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(decode.state()["rank_pids"][1], signal.SIGKILL)
        out = q.get(timeout=60)
        assert out.finish_reason == "error" and "EngineDeadError" in out.error and "rank 1" in out.error, out
    finally:
        silent.close()


def test_the_first_token_ends_the_request_without_a_pull(instance, reference):
    """max_tokens=1 on the decode side: the prefill's token is the answer; a decode rank's agent tells
    the prefill rank to free at once."""
    prompts, _ = reference
    prefill, decode = instance("prefill", 2), instance("decode", 2)
    freed, pulled = counters(prefill)["kv_transfers_total"], counters(decode)["kv_transfer_bytes_total"]
    kv = list(prefill.stream("one", prompts["s0"], PARAMS))[-1].kv_transfer_params
    outs = list(decode.stream("one", prompts["s0"], SamplingParams(max_tokens=1, temperature=0),
                              kv_transfer_params=kv))
    assert [o.new_token_ids for o in outs] == [[kv["first_token_id"]]] and outs[-1].finish_reason == "length"
    deadline = time.monotonic() + 10
    while counters(prefill)["kv_transfers_total"] == freed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counters(prefill)["kv_transfers_total"] == freed + 1
    assert counters(decode)["kv_transfer_bytes_total"] == pulled
    assert_free(prefill, decode)


def test_rank_workers_take_a_kv_role_and_the_prefill_balanced_cp(ckpt):
    EngineArgs(**pd_args(ckpt, "prefill", 2))
    EngineArgs(**pd_args(ckpt, "decode", 2))
    EngineArgs(**pd_args(ckpt, "prefill", 2, context_parallel_size=2, cp_min_prompt_tokens=64))
    with pytest.raises(ValueError, match="context_parallel_size"):       # nothing to split on a decode instance
        EngineArgs(**pd_args(ckpt, "decode", 2, context_parallel_size=2, cp_min_prompt_tokens=64))


@pytest.mark.parametrize("decode_ranks", [2, 1])
def test_a_prefill_under_balanced_cp_hands_over_the_owners_caches(instance, reference, decode_ranks):
    """A prefill instance whose long prompts are split over its ranks by balanced CP (the 145-token prompt:
    every rank prefills its mirrored chunks, the owner keeps the caches) hands over from the owner rank: the
    decode's tokens are a single instance's, the borrowed blocks and the holds all come back."""
    prefill = instance("prefill", 2, context_parallel_size=2, cp_min_prompt_tokens=64)
    decode = instance("decode", decode_ranks)
    prompts, ref = reference
    before = prefill.state()["cp_prefills"]
    kvs, tokens = hand_over_all(prefill, decode, prompts)
    assert tokens == ref
    long = [rid for rid, p in prompts.items() if len(p) - 1 >= 64]
    assert long and prefill.state()["cp_prefills"] - before == len(long)       # the long prompts took CP
    assert_free(prefill, decode)


def test_images_hand_over_across_ranks(tiny_checkpoint, single_with_images):
    """The tiny preset's vision tower: the prefill ranks encode and run the images, the decode ranks pull
    and go on without encoding any; the tokens equal a single instance's (an image ending the prompt,
    one mid-prompt, one early in a long prompt)."""
    kw = dict(data_parallel_size=2, worker_threads=1)
    prefill = EngineProcess(image_args(tiny_checkpoint, kv_role="prefill", **kw), num_threads=1, name="prefill-img")
    decode = EngineProcess(image_args(tiny_checkpoint, kv_role="decode", **kw), num_threads=1, name="decode-img")
    try:
        firsts = {rid: prefill.add(rid, prompt, IMAGE_PARAMS, images=images)
                  for rid, (prompt, images) in REQUESTS.items()}
        agents = set()
        for rid, (prompt, images) in REQUESTS.items():
            kv = firsts[rid].get(timeout=300).kv_transfer_params
            agents.add(kv["engine_id"])
            outs = list(decode.stream(rid, prompt, IMAGE_PARAMS, images=images, kv_transfer_params=kv))
            assert outs[-1].finish_reason == "length", outs[-1]
            assert sum((o.new_token_ids for o in outs), []) == single_with_images[rid], rid
        assert len(agents) == 2, agents
        assert counters(prefill)["images_encoded_total"] == 3 and counters(decode)["images_encoded_total"] == 0
        assert_free(prefill, decode)
    finally:
        prefill.close()
        decode.close()
