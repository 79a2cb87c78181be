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
    return dict(checkpoint=str(ckpt), device="cpu", max_num_seqs=4, max_num_batched_tokens=256, block_tokens=64,
                num_cache_blocks=4 * 13, batch_invariant=True,
                model_overrides={"emulate_index_k_alias": True}, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_fixture("v41-tiny-bf16", tmp_path_factory)


@pytest.fixture(scope="module")
def pair(ckpt):
    prefill = EngineProcess(engine_args(ckpt, kv_role="prefill"), num_threads=1, name="prefill")
    decode = EngineProcess(engine_args(ckpt, kv_role="decode"), num_threads=1, name="decode")
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


def single_instance(ckpt, expected, forced: bool):
    engine = Engine(EngineArgs(**engine_args(ckpt)))
    res = {}
    for i in range(4):
        prompt = expected[f"p{i}_prompt_ids"].tolist()
        kw = dict(forced_token_ids=expected[f"p{i}_fed_tokens"].tolist()) if forced else {}
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=NUM_OUT, temperature=0, ignore_eos=True),
                           return_logits=True, **kw)
    toks, logits = {f"p{i}": [] for i in range(4)}, {f"p{i}": [] for i in range(4)}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            if o.logits is not None:
                logits[o.request_id].append(o.logits)
    return toks, {k: np.concatenate(v) for k, v in logits.items()}


def test_teacher_forced_logits_after_handover_pass_check_parity(pair, ckpt, tmp_path):
    prefill, decode = pair
    expected = np.load(ckpt / "expected.npz")
    cand = {"meta_json": np.array(json.dumps({"format": "dsv41-parity-candidate/1", "engine": "deepinfer",
                                              "batch": "prefill/decode hand-over over NIXL"}))}
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
    print("bytes pulled per request (prompt tokens, bytes):", num_bytes)
    path = tmp_path / "candidate.npz"
    np.savez(path, **cand)
    res = subprocess.run([sys.executable, str(SHARED / "tools" / "check-parity"), str(ckpt), str(path)],
                         capture_output=True, text=True)
    verdict = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-2000:]
    print(verdict)
    assert res.returncode == 0, res.stdout[-3000:]
    assert_nothing_held(prefill, decode)


def test_tokens_bit_identical_to_a_single_instance_under_batch_invariant(pair, ckpt):
    prefill, decode = pair
    expected = np.load(ckpt / "expected.npz")
    ref_tokens, ref_logits = single_instance(ckpt, expected, forced=False)
    for i in range(4):
        prompt = expected[f"p{i}_prompt_ids"].tolist()
        params = SamplingParams(max_tokens=NUM_OUT, temperature=0, ignore_eos=True)
        first, outs = handover(prefill, decode, f"bi{i}", prompt, params, return_logits=True)
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == ref_tokens[f"p{i}"], f"prompt {i}: {tokens} != {ref_tokens[f'p{i}']}"
        lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
        np.testing.assert_array_equal(lg, ref_logits[f"p{i}"])
    assert_nothing_held(prefill, decode)


def test_concurrent_handovers_with_sampling(pair, ckpt):
    """Eight requests in flight on both sides at once, seeded sampling: each equals its own
    single-instance run (the seed's per-position stream crosses the hand-over)."""
    prefill, decode = pair
    expected = np.load(ckpt / "expected.npz")
    prompts = [expected[f"p{i % 4}_prompt_ids"].tolist()[: 20 + 9 * i] for i in range(8)]
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(8)]
    firsts = [prefill.add(f"c{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    handed = [q.get(timeout=120) for q in firsts]
    streams = [decode.add(f"c{i}", p, sp, kv_transfer_params=h.kv_transfer_params)
               for i, (p, sp, h) in enumerate(zip(prompts, params, handed))]
    got = []
    for q in streams:
        toks, out = [], None
        while out is None or not out.finished:
            out = q.get(timeout=120)
            toks += out.new_token_ids
        got.append(toks)
    engine = Engine(EngineArgs(**engine_args(ckpt)))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"c{i}", p, sp)
    ref = {f"c{i}": [] for i in range(8)}
    while engine.has_unfinished_requests():
        for o in engine.step():
            ref[o.request_id] += o.new_token_ids
    assert got == [ref[f"c{i}"] for i in range(8)]
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
