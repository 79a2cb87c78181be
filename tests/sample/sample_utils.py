"""Helpers shared by the tests in tests/sample (a uniquely named module: `conftest` is ambiguous
when several test folders are collected together)."""

from __future__ import annotations

import json

import torch

from deepinfer.sample import Sampler, SamplingRow
from deepinfer.sampling_params import OutputConstraint, SamplingParams

VOCAB = 129_280


def generate_random(sampler: Sampler, constraint: OutputConstraint, seeds: list[int], max_tokens=200,
                    temperature=1.0, logit_seed=0) -> list[list[int]]:
    """Batched constrained generation over random logits; stops at EOS (1). Returns token ids (no EOS)."""
    g = torch.Generator().manual_seed(logit_seed)
    states = [sampler.new_state(SamplingParams(seed=s, temperature=temperature, constraint=constraint,
                                               max_tokens=max_tokens)) for s in seeds]
    outs: list[list[int]] = [[] for _ in seeds]
    live = list(range(len(seeds)))
    for step in range(max_tokens):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=g)
        rows = [SamplingRow(states[i], outs[i], 100 + step) for i in live]
        toks = sampler.sample(logits, rows).token_ids.tolist()
        still = []
        for i, t in zip(live, toks):
            if t == 1:
                continue
            outs[i].append(t)
            still.append(i)
        live = still
    assert not live, f"{len(live)} generations did not finish in {max_tokens} tokens"
    return outs


EBNF = r'''
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
'''


def recipe_tool_calls(text: str, tools: list, tool_choice) -> tuple[list, str]:
    """Parse model output with deepseek-recipe's own Chat stream processor."""
    import deepseek_recipe as dr

    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": tool_choice, "thinking": {"type": "disabled"}}
    req = dr.ChatCompletionRequest(json.dumps(body)).convert(dr.ConversionOptions())
    proc = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(req, "r", "DeepSeek-V4.1-Flash"),
                              req.parsing_options)
    resp = dr.ChatCompletionResponse("r", "DeepSeek-V4.1-Flash", 0, 1, 0)
    for ch in (dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=1, prompt_cache_hit_tokens=0),
                                       system_fingerprint="fp"),
               dr.InferenceChunk.text(text, token_count=1), dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)):
        for out in proc.push(ch):
            resp.accumulate(out)
    choice = json.loads(resp.to_json())["choices"][0]
    oc = req.inference_options.output_constraint
    return choice, (oc.kind, oc.schema)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"type": "string", "enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Alarm.", "strict": True, "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "labels": {"type": "array", "items": {"type": "string", "enum": ["work", "home"]}, "maxItems": 2},
                                         "loud": {"type": "boolean"}},
        "required": ["hour", "labels", "loud"], "additionalProperties": False}}},
]
