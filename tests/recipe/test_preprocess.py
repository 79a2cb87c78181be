"""Preprocess: the three APIs through deepseek-recipe, output limits, options handed to the engine,
and rejections carrying each API's own error body."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from deepinfer.recipe import RequestContext, prepare_inputs, preprocess_outputs
from tests.recipe.conftest import TOOL, chat, messages, responses

BODIES = {"chat.completions": chat, "responses": responses, "messages": messages}


@pytest.mark.parametrize("api", list(BODIES))
def test_prompt_is_the_recipe_encoding(pre, api):
    p = pre.prepare(api, json.dumps(BODIES[api]()))
    assert not p.rejected
    assert p.prompt_token_ids[:2] == [0, 128799]            # BOS, <｜System｜> (reasoning effort block)
    assert p.prompt_token_ids[-2:] == [128804, 128821]      # <｜Assistant｜><think>: thinking on by default
    assert p.context.prompt_tokens == len(p.prompt_token_ids)
    assert p.sampling["stop_token_ids"] == [1]


def test_default_output_limits_capped_by_context(pre):
    off = pre.prepare("chat.completions", json.dumps(chat(thinking={"type": "disabled"})))
    on = pre.prepare("chat.completions", json.dumps(chat()))
    assert off.sampling["max_tokens"] == 4096 - len(off.prompt_token_ids)   # min(8192, context left)
    assert on.sampling["max_tokens"] == 4096 - len(on.prompt_token_ids)


def test_default_output_limits_uncapped(tokenizer_path):
    from deepinfer.recipe import Preprocessor
    p = Preprocessor(tokenizer_path, max_model_len=1 << 20)
    limit = lambda body: p.prepare("chat.completions", json.dumps(body)).sampling["max_tokens"]
    assert limit(chat(thinking={"type": "disabled"})) == 8192
    assert limit(chat()) == 65536
    assert limit(chat(reasoning_effort="max")) == 131072


def test_sampling_constraint_stop_logprobs(pre):
    body = chat(thinking={"type": "disabled"}, temperature=0.5, seed=7, logprobs=True, top_logprobs=3,
                stop=["END"], tools=[TOOL], response_format={"type": "json_object"},
                messages=[{"role": "user", "content": "Answer in json."}])
    p = pre.prepare("chat.completions", json.dumps(body))
    s = p.sampling
    assert (s["temperature"], s["seed"], s["logprobs"]) == (0.5, 7, 3)
    assert s["constraint"]["kind"] in ("json_object", "tool_calls")
    ctx = RequestContext.from_json(p.context.to_json())
    assert ctx.body == json.dumps(body) and ctx.model == "deepseek-flash"


def test_tool_choice_required_is_a_tool_call_grammar(pre):
    p = pre.prepare("chat.completions", json.dumps(chat(thinking={"type": "disabled"}, tools=[TOOL],
                                                        tool_choice="required")))
    assert p.sampling["constraint"]["kind"] == "tool_calls"
    assert p.sampling["constraint"]["tool_choice"] == "required"


def test_deferred_tools_render_for_v41(pre):
    deferred = {"name": "get_weather", "description": "Get weather.", "input_schema": {"type": "object"},
                "defer_loading": True}
    now = {"name": "get_time", "description": "Get time.", "input_schema": {"type": "object"}}
    body = json.dumps(messages(tools=[now, deferred]))
    assert not pre.prepare("messages", body).rejected
    text = dr.DeepseekV41Encoding().render_conversation(
        dr.MessagesRequest(body).convert(pre.options).conversation).prompt
    assert '"get_time"' in text and '"get_weather"' not in text   # deferred: not listed up front


@pytest.mark.parametrize("api,body,status,needle", [
    ("chat.completions", "{not json", 400, "invalid JSON"),
    ("chat.completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}), 400, "model"),
    ("chat.completions", json.dumps(chat(model="gpt-4o")), 404, "gpt-4o"),
    ("chat.completions", json.dumps(chat(model="DeepSeek-V4-Pro")), 404, "DeepSeek-V4-Pro"),
    ("responses", json.dumps(responses(max_output_tokens="many")), 400, "expected an integer"),
    ("chat.completions", json.dumps(chat(tools=[TOOL], tool_choice="required")), 400, "tool_choice"),
    ("chat.completions", json.dumps(chat(messages=[{"role": "user", "content": "hi " * 5000}])), 400, "context length"),
    ("messages", "{not json", 400, "invalid JSON"),
    ("messages", json.dumps(messages(tools=[TOOL], tool_choice={"type": "any"}, thinking={"type": "enabled"})), 400, ""),
    ("embeddings", "{}", 400, "unknown api"),
])
def test_rejections_carry_the_api_error_body(pre, api, body, status, needle):
    p = pre.prepare(api, body)
    assert p.rejected and p.context.error_status == status and p.prompt_token_ids == []
    err = json.loads(p.context.error_body)
    if api == "messages":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert needle in err["error"]["message"]
    else:
        assert err["error"]["type"] == "invalid_request_error" and needle in err["error"]["message"]


def test_text_input_path(pre):
    p = prepare_inputs(pre, {"text_input": "Hello", "max_tokens": 5, "stream": True, "temperature": 0.0,
                             "top_k": 3, "seed": 1, "stop_words": ["x"], "exclude_input_in_output": None})
    assert p.prompt_token_ids[0] == 0 and p.stream and p.context.api == "text"
    assert (p.sampling["max_tokens"], p.sampling["top_k"], p.sampling["temperature"]) == (5, 3, 0.0)
    out = preprocess_outputs(p)
    assert set(out) == {"input_ids", "sampling", "streaming", "context", "request_key", "image_pixels", "image_sizes",
                        "kv_transfer_params"}
    assert out["kv_transfer_params"] == ""                         # an ordinary request
    handed = preprocess_outputs(prepare_inputs(pre, {"text_input": "Hello", "kv_transfer_params": "{\"a\": 1}"}))
    assert handed["kv_transfer_params"] == "{\"a\": 1}"            # passed through for the engine to check
    over = prepare_inputs(pre, {"text_input": "hi " * 5000})
    assert over.rejected and over.context.error_status == 400


def test_neither_request_nor_text_input(pre):
    p = prepare_inputs(pre, {})
    assert p.rejected and "text_input" in json.loads(p.context.error_body)["error"]["message"]


def test_client_request_key_replaces_the_generated_one(pre):
    body = json.dumps(chat(thinking={"type": "disabled"}))
    assert prepare_inputs(pre, {"request": body, "api": "chat.completions", "request_key": "gw-1"}).request_key == "gw-1"
    assert prepare_inputs(pre, {"text_input": "hi", "request_key": "gw-2"}).request_key == "gw-2"
    assert len(prepare_inputs(pre, {"text_input": "hi"}).request_key) == 32
