"""Sampling and structured output end to end through the public LLM API on the random-weight tiny
model: 200 schema-valid JSON generations, regex / EBNF / strict tool calls, seeded batch
invariance, logprobs, finish reasons, bad constraints rejected before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sample import InvalidConstraintError
from deepinfer.sampling_params import OutputConstraint, SamplingParams

from sample_schemas import SCHEMAS
from sample_utils import EBNF, TOOLS, recipe_tool_calls

EOS = 1


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(str(checkpoint_dir), max_num_seqs=32)


def prompts(n, salt=0):
    return [[0, 1000 + 37 * i + salt, 2000 + (i * 11) % 97, 3000 + salt] for i in range(n)]


def text_of(tokenizer, out):
    ids = out.token_ids[:-1] if out.token_ids and out.token_ids[-1] == EOS else out.token_ids
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_200_json_schema_generations_validate(llm, tokenizer):
    n = 200
    params = [SamplingParams(max_tokens=400, seed=i, temperature=1.0,
                             constraint=OutputConstraint("json_schema", json.dumps(SCHEMAS[i % 10])))
              for i in range(n)]
    outs = llm.generate(prompts(n), params)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS, (i, out.finish_reason)
        jsonschema.validate(json.loads(text_of(tokenizer, out)), SCHEMAS[i % 10])


def test_regex_and_ebnf_match_fully(llm, tokenizer):
    pattern = r"(yes|no), [0-9]{1,3}(\.[0-9]{2})?"
    params = ([SamplingParams(max_tokens=100, seed=i, constraint=OutputConstraint("regex", pattern)) for i in range(8)]
              + [SamplingParams(max_tokens=300, seed=i, constraint=OutputConstraint("ebnf", EBNF)) for i in range(8)])
    outs = llm.generate(prompts(16, salt=1), params)
    for out in outs[:8]:
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, text_of(tokenizer, out))
    for out in outs[8:]:
        assert out.finish_reason == "stop"
        text = text_of(tokenizer, out)
        assert re.fullmatch(r"[0-9+\-()]+", text) and text.count("(") == text.count(")")
        eval(text)  # noqa: S307 - digits, + - ( ) only


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_strict_tool_calls_through_engine(llm, tokenizer, tool_choice):
    _, (kind, spec) = recipe_tool_calls("", TOOLS, tool_choice)
    listed = [t for t in TOOLS if t["function"]["name"] in spec]   # ours keep maxLength (the recipe drops it)
    c = OutputConstraint("tool_calls", json.dumps(listed), tool_choice="required")
    outs = llm.generate(prompts(8, salt=2), [SamplingParams(max_tokens=1500, seed=i, constraint=c) for i in range(8)])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in outs:
        assert out.finish_reason == "stop"
        choice, _ = recipe_tool_calls(text_of(tokenizer, out), TOOLS, tool_choice)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in {t["function"]["name"] for t in listed}
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.fixture(scope="module")
def llm_invariant(checkpoint_dir):
    return LLM(str(checkpoint_dir), max_num_seqs=32, batch_invariant=True)


def test_same_seed_same_tokens_alone_and_in_batches(llm_invariant):
    llm = llm_invariant
    mine = [0, 5000, 6000, 7000, 8000]
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, min_p=0.01, seed=1234, ignore_eos=True)
    other = [SamplingParams(max_tokens=5 + i % 9, temperature=1.0 + 0.1 * (i % 3), top_p=0.95, seed=i,
                            presence_penalty=0.3 * (i % 2)) for i in range(31)]
    alone = llm.generate([mine], sp, return_logits=True)[0]
    runs = []
    for size, pos in ((16, 7), (5, 0), (32, 31)):
        ps = prompts(size - 1, salt=size)
        ps.insert(pos, mine)
        params = other[:size - 1]
        params.insert(pos, sp)
        runs.append(llm.generate(ps, params, return_logits=True)[pos])
    for out in runs:
        assert out.token_ids == alone.token_ids
        assert np.array_equal(out.logits, alone.logits)
    reseeded = llm.generate([mine], SamplingParams(**{**sp.__dict__, "seed": 4321}))[0]
    assert reseeded.token_ids != alone.token_ids



def test_same_tokens_however_the_prompt_is_chunked(checkpoint_dir):
    """Batch invariance includes chunking: the scheduler cuts a prompt by whatever budget is left, so a
    request's logits must not depend on where the cuts fall (prompt longer than the window, so
    chunks continue over the ring, the compressor carry and the compressed entries)."""
    prompt = [0] + [int(t) for t in np.random.default_rng(99).integers(100, 120000, 299)]
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    outs = []
    for budget in (7, 64, 512):
        llm = LLM(str(checkpoint_dir), max_num_seqs=4, max_num_batched_tokens=budget, batch_invariant=True)
        outs.append(llm.generate([prompt], sp, return_logits=True)[0])
    for out in outs[1:]:
        assert out.token_ids == outs[0].token_ids
        assert np.array_equal(out.logits, outs[0].logits)

def test_logprobs_and_finish_reasons(llm):
    params = [SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, seed=4)]
    outs = llm.generate(prompts(3, salt=3), params, return_logits=True)
    for out, p in zip(outs[:2], params):
        assert out.finish_reason == "length" and len(out.token_ids) == 6
        assert len(out.logprobs) == 6
        ref = torch.log_softmax(torch.from_numpy(out.logits), -1)
        for t, lp, row in zip(out.token_ids, out.logprobs, ref):
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-5)
            assert len(lp.top) == p.logprobs
            if lp.top:
                assert [i for i, _ in lp.top] == torch.topk(row, p.logprobs).indices.tolist()
    assert outs[2].logprobs is None


def test_bad_constraint_rejected_before_generation_engine_keeps_serving(llm):
    good = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    bad = SamplingParams(constraint=OutputConstraint("json_schema", '{"type": "objectx"}'))
    with pytest.raises(InvalidConstraintError, match="json_schema"):
        llm.generate(prompts(2, salt=4), [good, bad])
    assert not llm.engine.has_unfinished_requests()       # nothing was queued
    with pytest.raises(InvalidConstraintError, match="regex"):
        llm.generate(prompts(1), SamplingParams(constraint=OutputConstraint("regex", "(unclosed")))
    out = llm.generate(prompts(1, salt=4), good)[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("thinking", [False, True], ids=["content", "reasoning_content"])
def test_logprobs_reach_the_recipe_chat_response(llm, tokenizer_path, thinking):
    """The engine's TokenLogprob entries go into deepseek-recipe's InferenceChunk.tokens as they are;
    Chat returns them as logprobs.content (answer) or logprobs.reasoning_content (thinking)."""
    import deepseek_recipe as dr

    out = llm.generate(prompts(1, salt=9), SamplingParams(max_tokens=8, temperature=0.8, seed=9, logprobs=2,
                                                          ignore_eos=True))[0]
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled" if thinking else "disabled"}, "logprobs": True, "top_logprobs": 2}
    req = dr.ChatCompletionRequest(json.dumps(body)).convert(dr.ConversionOptions())
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "r", "DeepSeek-V4.1-Flash"),
                              req.parsing_options, dr.Tokenizer.from_file(tokenizer_path))
    resp = dr.ChatCompletionResponse("r", "DeepSeek-V4.1-Flash", 0, 4, 0)
    for ch in (dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=4, prompt_cache_hit_tokens=0),
                                       system_fingerprint="fp"),
               dr.InferenceChunk.tokens(out.token_ids, logprobs=out.logprobs),
               dr.InferenceChunk.finish(dr.InferenceFinishReason.Length)):
        for chunk in proc.push(ch):
            resp.accumulate(chunk)
    lp = json.loads(resp.to_json())["choices"][0]["logprobs"]
    entries = lp["reasoning_content" if thinking else "content"]
    ours = {round(x.logprob, 5) for x in out.logprobs}
    assert entries and all(round(e["logprob"], 5) in ours and len(e["top_logprobs"]) == 2 for e in entries)


def test_grammar_with_draft_verification_matches_plain_decode(llm, tokenizer):
    """Drafts (some right, some wrong) verified under a JSON-schema grammar give exactly the tokens of
    plain decoding (greedy verification is lossless), and the grammar state follows the accepted ones."""
    c = OutputConstraint("json_schema", json.dumps(SCHEMAS[1]))
    params = SamplingParams(max_tokens=60, temperature=0, constraint=c)
    prompt = prompts(1, salt=11)[0]
    ref = llm.generate([prompt], params)[0].token_ids
    engine = llm.engine
    engine.add_request("drafted", prompt, params)
    got, step = [], 0
    while engine.has_unfinished_requests():
        req = engine.scheduler.requests.get("drafted")
        if req is not None and got:
            k = 1 + step % 3
            drafts = list(ref[len(got):len(got) + k])
            if step % 4 == 3 and drafts:
                drafts[-1] = 17   # a wrong draft: rejected
            req.spec_token_ids = drafts
        for out in engine.step():
            got += out.new_token_ids
        step += 1
    assert got == ref and got[-1] == EOS
    jsonschema.validate(json.loads(tokenizer.decode(got[:-1], skip_special_tokens=False)), SCHEMAS[1])
