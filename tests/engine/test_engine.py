"""The engine and its public API on the real tiny model (CPU): bad input, abort, async API."""

import asyncio
import threading

import pytest

from deepinfer import AsyncEngine, EngineArgs, InvalidRequestError, LLM, SamplingParams, UnknownRequestError
from deepinfer.engine import Engine

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_engine_args):
    return Engine(EngineArgs(**tiny_engine_args))


def run_all(engine):
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    return finals


def test_bad_input_raises_to_caller_and_engine_keeps_serving(engine):
    engine.add_request("good", [5, 6, 7], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="context limit"):
        engine.add_request("long", [5] * (engine.max_model_len + 1), GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    bad = SamplingParams(max_tokens=3)
    bad.max_tokens = 0  # mutated after validation: the engine checks again
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("zero", [5], bad)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("oov", [10**9], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", [1], GREEDY)
    with pytest.raises(UnknownRequestError):
        engine.abort("nope")
    finals = run_all(engine)
    assert finals["good"].finish_reason == "length" and finals["good"].num_output_tokens == 4
    assert engine.kv_cache.num_used_blocks == 0


def test_abort_mid_generation_frees_everything(engine):
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("b", [9, 8, 7], GREEDY)
    for _ in range(3):
        engine.step()
    out = engine.abort("a")
    assert out.finish_reason == "abort" and out.new_token_ids == []
    finals = run_all(engine)
    assert "a" not in finals and finals["b"].finish_reason == "length"
    assert engine.kv_cache.num_used_blocks == 0
    engine.kv_cache.check()


def test_step_fault_fails_only_that_step(engine, monkeypatch):
    engine.add_request("x", [4, 5], GREEDY)
    orig = engine.runner.launch

    def boom(sched_out):
        monkeypatch.setattr(engine.runner, "launch", orig)
        raise RuntimeError("device fault")
    monkeypatch.setattr(engine.runner, "launch", boom)
    finals = run_all(engine)
    assert finals["x"].finish_reason == "error" and "device fault" in finals["x"].error
    engine.add_request("y", [4, 5], GREEDY)
    assert run_all(engine)["y"].finish_reason == "length"
    assert engine.stats.snapshot()["counters"]["requests_finished_error"] >= 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_async_scheduling_matches_sync_teacher_forced(tiny_engine_args, device):
    """The pipelined step feeds device-side tokens; teacher-forced logits must equal the sync ones."""
    import numpy as np
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    prompts = [[11, 12, 13, 14, 15], list(range(100, 130)), [7]]
    forced = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36], [41, 42, 43, 44, 45, 46]]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    res = {}
    for mode in (False, True):
        llm = LLM(**{**tiny_engine_args, "async_scheduling": mode, "device": device})
        res[mode] = llm.generate(prompts, params, forced_token_ids=forced, return_logits=True)
    for s, a, f in zip(res[False], res[True], forced):
        assert s.token_ids[:6] == a.token_ids[:6] == f
        assert s.logits.shape == a.logits.shape == (7, s.logits.shape[1])
        np.testing.assert_allclose(a.logits, s.logits, atol=0.05 * float(s.logits.std()))


def test_llm_generate_and_stats(tiny_engine_args):
    llm = LLM(**tiny_engine_args)
    outs = llm.generate([[3, 4, 5], [6] * 20], [GREEDY, SamplingParams(max_tokens=2, temperature=0)])
    assert [len(o.token_ids) for o in outs] == [4, 2] and outs[0].finish_reason == "length"
    snap = llm.stats()
    assert snap["counters"]["generation_tokens_total"] == 6
    assert snap["counters"]["prompt_tokens_total"] == 23
    assert snap["histograms"]["time_to_first_token_seconds"]["count"] == 2
    assert snap["histograms"]["inter_token_latency_seconds"]["count"] == 4
    assert snap["gauges"]["cache_blocks_used"] == 0 and snap["gauges"]["cache_blocks_total"] == 64


def test_async_engine_generate_stream_callback_abort(tiny_engine_args):
    eng = AsyncEngine(EngineArgs(**tiny_engine_args))
    try:
        async def agen():
            deltas = [o async for o in eng.generate([3, 4, 5], GREEDY, "ag")]
            with pytest.raises(InvalidRequestError):
                async for _ in eng.generate([], GREEDY, "bad"):
                    pass
            return deltas
        deltas = asyncio.run(agen())
        assert sum(len(d.new_token_ids) for d in deltas) == 4
        assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[-1].num_prompt_tokens == 3 and deltas[-1].num_output_tokens == 4

        streamed = list(eng.stream("st", [8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
        assert sum(len(d.new_token_ids) for d in streamed) == 3

        got, done = [], threading.Event()

        def cb(out):
            got.append(out)
            if out.finished:
                done.set()
        eng.add_request("cb", [5] * 10, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), cb)
        while not got:
            done.wait(0.01)
        eng.abort("cb")
        n_at_abort = sum(len(o.new_token_ids) for o in got)
        assert done.wait(30)
        assert got[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in got) == n_at_abort  # nothing after the abort
        with pytest.raises(UnknownRequestError):
            eng.abort("cb")
        assert eng.num_in_flight() == 0
        assert eng.stats()["gauges"]["cache_blocks_used"] == 0
    finally:
        eng.shutdown()


def test_sampler_path_seeded_and_logprobs(tiny_engine_args):
    llm = LLM(**{**tiny_engine_args, "max_num_seqs": 4})
    p = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7, logprobs=2, ignore_eos=True)
    a = llm.generate([[3, 4, 5], [9] * 12], p)
    b = llm.generate([[9] * 12], p)
    assert a[1].token_ids == b[0].token_ids            # same seed, other batch: same tokens
    assert len(a[0].logprobs) == 5 and len(a[0].logprobs[0].top) == 2
    g = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True))
    assert len(g[0].logprobs) == 3 and g[0].logprobs[0].logprob <= 0


def test_draft_verification_and_rollback_on_the_real_model(tiny_engine_args):
    """Drafts (k per step) verified in one step: accepted ones kept, rejected positions rolled back
    (num_computed_tokens lowered, blocks past them freed); greedy output equals plain decoding."""
    args = {**tiny_engine_args, "block_tokens": 8}
    prompt = list(range(500, 530))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(**args).generate([prompt], params)[0].token_ids

    engine = Engine(EngineArgs(**args))
    engine.add_request("s", prompt, params)
    got = []
    step = 0
    while engine.has_unfinished_requests():
        req = engine.scheduler.requests.get("s")
        if req is not None and req.num_output_tokens:
            n = req.num_output_tokens
            good = plain[n:n + 1 + step % 3]            # 1-3 right drafts ...
            req.spec_token_ids = good + [7, 8, 9][:4 - len(good)]   # ... then wrong ones: 4 drafts
        for out in engine.step():
            got += out.new_token_ids
        if req is not None and req.status.name == "RUNNING":
            assert req.num_tokens - req.num_computed_tokens == 1   # rejected positions rolled back
            blocks = len(engine.kv_cache.block_ids["s"])
            assert blocks == engine.kv_cache.num_blocks_for(req.num_computed_tokens)
        engine.kv_cache.check()
        step += 1
    assert got == plain, (got, plain)
    assert step < len(plain), "drafts were not accepted (no fewer steps than tokens)"
    assert engine.kv_cache.num_used_blocks == 0


@pytest.mark.gpu
def test_dense_weights_bf16_matches_fp8_on_cuda(tiny_engine_args):
    """EngineArgs.dense_weights="bf16" (dense FP8 linears held dequantized, act_quant + cuBLAS, decode graphs
    included) against the FP8 kernels: the same products summed in another order, so teacher-forced
    logits agree to rounding noise, prefill (300 tokens: the bf16 prefill path too) and decode alike."""
    import numpy as np
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    prompts = [list(range(100, 400)), [7, 8, 9]]
    forced = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    res = {}
    for w in ("fp8", "bf16"):
        llm = LLM(**{**tiny_engine_args, "device": "cuda", "dense_weights": w})
        res[w] = llm.generate(prompts, params, forced_token_ids=forced, return_logits=True)
    for a, b in zip(res["fp8"], res["bf16"]):
        assert a.token_ids[:6] == b.token_ids[:6]
        np.testing.assert_allclose(b.logits, a.logits, atol=0.05 * float(a.logits.std()))


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_auto_dense_weights_keep_the_tables_copies_on_cuda(tiny_engine_args, tmp_path, monkeypatch, eager, shared_dir):
    """dense_weights="auto" on CUDA: bf16 dense weights plus the FP8 decode copies of the linears this GPU model's
    decode table says pay (here a table naming only wq_b's shape). Each copy's decode-sized call is the bf16
    path's product of the same rounded rows to the FP8 MMA's rounding; the engine's teacher-forced logits are
    bf16 alone's within the release fixture's rule statistics (the tiny preset rounds every linear's input to
    FP8, so a last-bit difference can flip a routing or index top-k pick: chaotic at the last bit, as the
    fixtures' calibration measured; an allclose cannot tell that from a defect, the op-level check can)."""
    import json
    import sys
    from pathlib import Path

    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
    import random_configs as rc
    from deepinfer.kernels import cuda_fp8_decode as cfd
    from deepinfer.model import ops
    from deepinfer.model.args import ModelArgs
    from deepinfer.model.layers import Linear
    from deepinfer.model.loader import expected_tensors
    args = ModelArgs.from_checkpoint(tiny_engine_args["checkpoint"])
    n, k = next(shape for name, (_, shape) in expected_tensors(args).items() if name.endswith("attn.wq_b.weight"))
    row = dict(n=n, k=k, m=64, entry="fp8_decode_sm90_t64_rb1", splits=1, decode_us=5.0, bf16_held_us=9.0,
               fp8_select_us=9.0)
    (tmp_path / "table.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": [row]}))
    monkeypatch.setattr(cfd, "TABLE_PATH", str(tmp_path / "table.json"))
    cfd.reload_table()
    prompts = [list(range(100, 400)), [7, 8, 9]]
    forced = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    res = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        for w in ("bf16", "auto"):
            llm = LLM(**{**tiny_engine_args, "device": "cuda", "dense_weights": w, "enforce_eager": eager})
            mods = {name: mod for name, mod in llm.engine.model.named_modules() if isinstance(mod, Linear)}
            copied = {name for name, mod in mods.items() if mod.fp8_decode is not None}
            wq_b = {name for name in mods if name.endswith(".attn.wq_b")}
            assert wq_b and copied == (wq_b if w == "auto" else set())
            for name in sorted(copied):                  # the copy's GEMM against the bf16 path, op by op
                mod = mods[name]
                for m in (1, 3, 8, 64):
                    x = torch.randn(m, mod.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
                    assert ops.fp8_decode_takes(x, *mod.fp8_decode), (name, m)
                    got = mod(x).float()
                    copy, mod.fp8_decode = mod.fp8_decode, None
                    want = mod(x).float()
                    mod.fp8_decode = copy
                    # FP8 products are exact; the two differ by accumulation order and the bf16 output's rounding
                    tol = 2 ** -7 * want.abs() + 2 ** -10 * want.abs().amax()
                    assert ((got - want).abs() <= tol).all(), (name, m, (got - want).abs().max().item())
            res[w] = llm.generate(prompts, params, forced_token_ids=forced, return_logits=True)
    finally:
        monkeypatch.undo()
        cfd.reload_table()
    rule = rc.fixture_rule("release", shared_dir)
    for a, b in zip(res["bf16"], res["auto"]):
        assert a.token_ids[:6] == b.token_ids[:6]
        scores = rc.score(torch.as_tensor(b.logits), torch.as_tensor(a.logits), rule["top1_guard"])
        print("copies against bf16 alone:", scores.line())
        assert not scores.judge(rule), scores.line()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_packed_index_keys_give_the_same_logits(tiny_engine_args, device):
    """ModelArgs.index_k_packed (EngineArgs.model_overrides): the cache holds the index keys as packed FP4 rows
    and every reader unpacks them to the values the bf16 pool held, so teacher-forced logits are bit for bit
    the bf16 pool's (a 300-token prompt: compressed entries and their index keys in prefill and decode)."""
    import numpy as np
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    prompts = [list(range(100, 400)), [7, 8, 9]]
    forced = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    res = {}
    for packed in (False, True):
        llm = LLM(**{**tiny_engine_args, "device": device, "model_overrides": {"index_k_packed": packed}})
        pools = llm.engine.caches.index_k
        assert pools and all((t.dtype == torch.uint8) == packed for t in pools.values())
        res[packed] = llm.generate(prompts, params, forced_token_ids=forced, return_logits=True)
        if packed:
            assert any(t.any() for t in pools.values())                 # keys were written, packed
    for a, b in zip(res[False], res[True]):
        assert a.token_ids == b.token_ids and np.array_equal(a.logits, b.logits)
