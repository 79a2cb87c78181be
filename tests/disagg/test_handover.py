"""Prefill on one engine process, decode on another, the caches moved by NIXL (UCX over TCP /
shared memory on CPU): teacher-forced logits after the hand-over pass the shared fixture's rule,
and under batch_invariant the tokens (and logits) equal a single instance's bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from deepinfer.disagg.nixl_transport import import_nixl  # noqa: E402

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from deepinfer.config import EngineArgs  # noqa: E402
from deepinfer.disagg.process import EngineProcess  # noqa: E402
from deepinfer.engine import Engine  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import SHARED, build_fixture  # noqa: E402

NUM_OUT = 17


def engine_args(ckpt, **kw) -> dict:
    return dict(checkpoint=str(ckpt), device="cpu", max_num_seqs=8, max_num_batched_tokens=256, block_tokens=64,
                num_cache_blocks=8 * 13, model_overrides={"emulate_index_k_alias": True}, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_fixture("v41-tiny-bf16", tmp_path_factory)


def start_pair(ckpt, **kw):
    prefill = EngineProcess(engine_args(ckpt, kv_role="prefill", **kw), num_threads=1, name="prefill")
    decode = EngineProcess(engine_args(ckpt, kv_role="decode", **kw), num_threads=1, name="decode")
    return prefill, decode


@pytest.fixture(scope="module")
def pair(ckpt):
    prefill, decode = start_pair(ckpt)
    yield prefill, decode
    prefill.close()
    decode.close()


@pytest.fixture(scope="module")
def pair_bi(ckpt):
    """Both instances under batch_invariant (row-by-row GEMMs on CPU: short prompts only)."""
    prefill, decode = start_pair(ckpt, batch_invariant=True)
    yield prefill, decode
    prefill.close()
    decode.close()


def handover(prefill, decode, rid, prompt, params, **kw):
    """-> (prefill's final output, decode's outputs)"""
    first = list(prefill.stream(rid, prompt, params, **kw))
    assert len(first) == 1 and first[0].finish_reason == "length", first
    kv = first[0].kv_transfer_params
    assert kv is not None and kv["num_tokens"] == len(prompt)
    outs = list(decode.stream(rid, prompt, params, kv_transfer_params=kv, **kw))
    assert outs[-1].finish_reason in ("length", "stop"), outs[-1]
    assert outs[0].new_token_ids == first[0].new_token_ids   # the decode stream starts with the prefill's token
    return first[0], outs


def single_instance(ckpt, prompts: dict, params: dict, return_logits=False, batch_invariant=True,
                    one_at_a_time=False):
    """The same requests on one kv_role="both" instance, all at once (or each alone, in turn).
    -> (tokens, logits) by id"""
    engine = Engine(EngineArgs(**engine_args(ckpt, batch_invariant=batch_invariant)))
    toks, logits = {rid: [] for rid in prompts}, {rid: [] for rid in prompts}
    for batch in ([[r] for r in prompts] if one_at_a_time else [list(prompts)]):
        for rid in batch:
            engine.add_request(rid, prompts[rid], params[rid], return_logits=return_logits)
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.request_id] += o.new_token_ids
                if o.logits is not None:
                    logits[o.request_id].append(o.logits)
    return toks, {k: np.concatenate(v) if v else None for k, v in logits.items()}


@pytest.fixture(scope="module")
def short_prompts_bi(ckpt):
    """p0 and p1 (18 and 145 tokens), 8 greedy tokens, and a single instance's run of them under
    batch_invariant: (prompts, params, tokens, logits)."""
    expected = np.load(ckpt / "expected.npz")
    prompts = {f"p{i}": expected[f"p{i}_prompt_ids"].tolist() for i in (0, 1)}
    params = {rid: SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) for rid in prompts}
    return (prompts, params) + single_instance(ckpt, prompts, params, return_logits=True)


def teacher_forced_candidate(prefill, decode, ckpt, batch: str) -> tuple[dict, list]:
    """The fixture's four prompts (18, 145, 300, 695 tokens) handed over, teacher-forced, as a
    check-parity candidate. -> (candidate arrays, [(prompt tokens, bytes pulled)])"""
    expected = np.load(ckpt / "expected.npz")
    cand = {"meta_json": np.array(json.dumps({"format": "dsv41-parity-candidate/1", "engine": "deepinfer",
                                              "batch": batch}))}
    num_bytes = []
    for i in range(4):
        prompt = expected[f"p{i}_prompt_ids"].tolist()
        params = SamplingParams(max_tokens=NUM_OUT, temperature=0, ignore_eos=True)
        kw = dict(forced_token_ids=expected[f"p{i}_fed_tokens"].tolist(), return_logits=True)
        first, outs = handover(prefill, decode, f"tf{i}", prompt, params, **kw)
        num_bytes.append((len(prompt), first.kv_transfer_params["num_bytes"]))
        lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
        assert lg.shape[0] == NUM_OUT
        cand[f"p{i}_prefill_logits"] = lg[0].astype(np.float32)
        cand[f"p{i}_decode_logits"] = lg[1:].astype(np.float32)
        cand[f"p{i}_fed_tokens"] = expected[f"p{i}_fed_tokens"]
        cand[f"p{i}_prompt_ids"] = expected[f"p{i}_prompt_ids"]
        cand[f"p{i}_tokens"] = lg.argmax(-1).astype(np.int64)
    return cand, num_bytes


def check_parity(ckpt, cand: dict, tmp_path) -> str:
    """The shared checker on a candidate: its verdict line (asserts PASS)."""
    path = tmp_path / "candidate.npz"
    np.savez(path, **cand)
    res = subprocess.run([sys.executable, str(SHARED / "tools" / "check-parity"), str(ckpt), str(path)],
                         capture_output=True, text=True)
    verdict = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-2000:]
    print(verdict)
    assert res.returncode == 0, res.stdout[-3000:]
    return verdict


def test_teacher_forced_logits_after_handover_pass_check_parity(pair, ckpt, tmp_path):
    prefill, decode = pair
    cand, num_bytes = teacher_forced_candidate(prefill, decode, ckpt, "prefill/decode hand-over over NIXL")
    print("bytes pulled per request (prompt tokens, bytes):", num_bytes)
    check_parity(ckpt, cand, tmp_path)
    assert_nothing_held(prefill, decode)


def test_replay_mode_passes_check_parity_on_long_prompts(ckpt, tmp_path):
    """kv_transfer_window=False on prompts past the window: the decode pulls only the full blocks
    below H (the prompt rounded down to a 64-token block) and rebuilds the window by replaying
    [H - 128, n]. For the 300- and 695-token prompts that replay starts at 128 and 512, so the
    compressed / index entries of 2 and 4 window lengths come from the prefill's blocks and the
    window rows and the compressors' carry come from the replay: approximate by design (the replay
    recomputes what the window held), so judged by the fixture's rule, not bit for bit."""
    prefill, decode = start_pair(ckpt, kv_transfer_window=False)
    try:
        cand, num_bytes = teacher_forced_candidate(prefill, decode, ckpt, "P/D hand-over, replay mode (blocks only)")
        check_parity(ckpt, cand, tmp_path)
        assert_nothing_held(prefill, decode)
        c = decode.state()["stats"]["counters"]
        lengths = [n for n, _ in num_bytes]
        replayed = [n - max(0, n // 64 * 64 - 128) for n in lengths]   # [H - 128, n], H = n rounded down to a block
        assert replayed == [18, 145, 172, 183]
        assert c["kv_transfer_replayed_tokens_total"] == sum(replayed)
        blocks = sum(n // 64 for n in lengths)                         # 0 + 2 + 4 + 10 full blocks below H
        window_bytes = sum(b for _, b in num_bytes)                    # what the window mode would pull
        assert 0 < c["kv_transfer_bytes_total"] < window_bytes / 2   # 0.34x in the 2026-12-02 run
        assert c["kv_transfer_bytes_total"] % blocks == 0               # whole blocks, nothing else
    finally:
        prefill.close()
        decode.close()


def test_tokens_bit_identical_to_a_single_instance_under_batch_invariant(pair_bi, short_prompts_bi):
    prefill, decode = pair_bi
    prompts, params, ref_tokens, ref_logits = short_prompts_bi
    for rid, prompt in prompts.items():
        first, outs = handover(prefill, decode, rid, prompt, params[rid], return_logits=True)
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == ref_tokens[rid], f"{rid}: {tokens} != {ref_tokens[rid]}"
        lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
        np.testing.assert_array_equal(lg, ref_logits[rid])
    assert_nothing_held(prefill, decode)


def test_window_mode_is_exact_without_batch_invariant(pair, ckpt):
    """Pulling the window rings and carry (kv_transfer_window=True, the default) replays nothing: one
    request at a time, the hand-over gives the single instance's logits bit for bit even without
    batch_invariant (same shapes on both sides: the prompt alone, then one decode row)."""
    prefill, decode = pair
    expected = np.load(ckpt / "expected.npz")
    prompts = {f"exact{i}": expected[f"p{i}_prompt_ids"].tolist() for i in (0, 1)}
    params = {rid: SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for rid in prompts}
    ref_tokens, ref_logits = single_instance(ckpt, prompts, params, return_logits=True, batch_invariant=False,
                                             one_at_a_time=True)
    for rid, prompt in prompts.items():
        first, outs = handover(prefill, decode, rid, prompt, params[rid], return_logits=True)
        assert [t for o in outs for t in o.new_token_ids] == ref_tokens[rid]
        lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
        np.testing.assert_array_equal(lg, ref_logits[rid])
    assert_nothing_held(prefill, decode)


def test_replay_mode_bit_identical_and_moves_only_blocks(ckpt, short_prompts_bi):
    """kv_transfer_window=False: the decode pulls the full blocks below H (a block boundary) and
    replays [H - 128, n]. Prompts of 18 and 145 tokens replay from 0 with the compressed entries
    below H pulled, so under batch_invariant the tokens and logits equal a single instance's; the
    bytes pulled are the blocks' only (no ring rows, no carry)."""
    prefill, decode = start_pair(ckpt, batch_invariant=True, kv_transfer_window=False)
    try:
        prompts, params, ref_tokens, ref_logits = short_prompts_bi
        window_bytes = 0
        for rid, prompt in prompts.items():
            first, outs = handover(prefill, decode, rid, prompt, params[rid], return_logits=True)
            window_bytes += first.kv_transfer_params["num_bytes"]
            assert [t for o in outs for t in o.new_token_ids] == ref_tokens[rid]
            lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
            np.testing.assert_array_equal(lg, ref_logits[rid])
        assert_nothing_held(prefill, decode)
        c = decode.state()["stats"]["counters"]
        assert c["kv_transfers_total"] == 2
        assert c["kv_transfer_replayed_tokens_total"] == 18 + 145 + 0   # both replay from 0
        full_blocks = (18 // 64 + 145 // 64) * 64                     # blocks below H: 0 and 2 of 64
        assert 0 < c["kv_transfer_bytes_total"] < window_bytes / 4    # 0.14x in the 2026-12-02 run
        assert c["kv_transfer_bytes_total"] % full_blocks == 0
    finally:
        prefill.close()
        decode.close()


def hand_over_all(prefill, decode, prompts: dict, params) -> tuple[dict, dict]:
    """Every prompt to the prefill at once, each to the decode as soon as its prefill ends (in order; the
    prefill keeps running the others meanwhile). params: one SamplingParams, or one a request id.
    -> (kv_transfer_params by id, the decode's tokens by id)"""
    per = params if isinstance(params, dict) else dict.fromkeys(prompts, params)
    firsts = {rid: prefill.add(rid, p, per[rid]) for rid, p in prompts.items()}
    kvs, streams = {}, {}
    for rid, q in firsts.items():
        out = q.get(timeout=300)
        assert out.finish_reason == "length" and out.kv_transfer_params is not None, out
        kvs[rid] = out.kv_transfer_params
        streams[rid] = decode.add(rid, prompts[rid], per[rid], kv_transfer_params=kvs[rid])
    tokens = {}
    for rid, q in streams.items():
        toks, out = [], None
        while out is None or not out.finished:
            out = q.get(timeout=300)
            toks += out.new_token_ids
        assert out.finish_reason == "length", out
        tokens[rid] = toks
    return kvs, tokens


def test_concurrent_handovers_with_sampling(pair_bi, ckpt):
    """Eight requests in flight on both sides at once, each handed over as soon as its prefill
    ends, seeded sampling: each equals its run on a single instance (the seed's per-position
    stream crosses the hand-over)."""
    prefill, decode = pair_bi
    expected = np.load(ckpt / "expected.npz")
    long = expected["p2_prompt_ids"].tolist()
    prompts = {f"c{i}": long[3 * i: 3 * i + 12 + 5 * i] for i in range(8)}
    params = {rid: SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    _, got = hand_over_all(prefill, decode, prompts, params)
    ref, _ = single_instance(ckpt, prompts, params)
    assert got == ref
    assert_nothing_held(prefill, decode)


def assert_nothing_held(prefill, decode, timeout_s: float = 10.0) -> None:
    """Every block and ring slot back in both pools (the prefill frees on the decode's notification)."""
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = prefill.state(), decode.state()
        if (p["cache_blocks_used"], p["ring_slots_used"], p["held"], d["cache_blocks_used"], d["ring_slots_used"],
                d["loading"]) == (0, 0, 0, 0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (p["cache_blocks_used"], p["ring_slots_used"], p["held"]) == (0, 0, 0), p
    assert (d["cache_blocks_used"], d["ring_slots_used"], d["loading"]) == (0, 0, 0), d
    assert p["stats"]["counters"]["kv_holds_expired_total"] == 0


def test_a_prefill_instance_with_prefix_caching_hands_over_a_hit(ckpt):
    """kv_role="prefill" with enable_prefix_caching: a prompt that extends one handed over before hits
    the prefill instance's cache (the window snapshot the first left: exact) while the first is still
    held for its pull (its blocks shared by both holds), each decode pulls its own, and under
    batch_invariant the tokens and logits equal a cold single instance's; every held block goes back
    once pulled."""
    expected = np.load(ckpt / "expected.npz")
    base = expected["p1_prompt_ids"].tolist()                          # 145 tokens: 2 full blocks of 64
    prompts = {"turn1": base, "turn2": base + expected["p0_prompt_ids"].tolist()}
    params = {rid: SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for rid in prompts}
    ref_tokens, ref_logits = single_instance(ckpt, prompts, params, return_logits=True, one_at_a_time=True)
    prefill = EngineProcess(engine_args(ckpt, kv_role="prefill", batch_invariant=True, enable_prefix_caching=True),
                            num_threads=1, name="prefill")
    decode = EngineProcess(engine_args(ckpt, kv_role="decode", batch_invariant=True), num_threads=1, name="decode")
    try:
        firsts = {rid: list(prefill.stream(rid, prompt, params[rid], return_logits=True))[-1]
                  for rid, prompt in prompts.items()}
        assert prefill.state()["held"] == 2                              # turn1 still held when turn2 hit it
        assert {rid: f.num_cached_tokens for rid, f in firsts.items()} == {"turn1": 0, "turn2": len(base)}
        for rid, prompt in prompts.items():
            first = firsts[rid]
            outs = list(decode.stream(rid, prompt, params[rid], return_logits=True,
                                      kv_transfer_params=first.kv_transfer_params))
            assert [t for o in outs for t in o.new_token_ids] == ref_tokens[rid], rid
            lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
            np.testing.assert_array_equal(lg, ref_logits[rid])
        assert_nothing_held(prefill, decode)
        c = prefill.state()["stats"]["counters"]
        assert c["prefix_cache_hits_total"] == len(base) and c["prefix_cache_snapshot_hits_total"] == 1
    finally:
        prefill.close()
        decode.close()


def test_a_decode_instance_refuses_prefix_caching(ckpt):
    with pytest.raises(ValueError, match="kv_role 'decode' does not combine with enable_prefix_caching"):
        EngineArgs(**engine_args(ckpt, kv_role="decode", enable_prefix_caching=True))
