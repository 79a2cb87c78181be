"""The request-validation layer (recipe/validation): each API's official ranges and required fields,
the operator's limits and the JSON size/depth checks, applied before conversion and tokenization;
each rejection in the API's own error format."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer.recipe import Preprocessor
from deepinfer.recipe.validation import Limits
from deepinfer.recipe.validation.json_body import json_depth
from tests.recipe.conftest import TOOL, chat, messages, responses

CASES = [
    # api, body, status, words in the message
    ("chat.completions", chat(max_completion_tokens=-5), 400, "max_completion_tokens"),
    ("chat.completions", chat(max_tokens=0), 400, "max_tokens"),
    ("chat.completions", chat(temperature=2.5), 400, "temperature"),
    ("chat.completions", chat(top_p=-0.1), 400, "top_p"),
    ("chat.completions", chat(presence_penalty=3), 400, "presence_penalty"),
    ("chat.completions", chat(n=2), 400, "'n'"),
    ("chat.completions", chat(top_logprobs=21, logprobs=True), 400, "top_logprobs"),
    ("chat.completions", chat(top_logprobs=2), 400, "logprobs"),
    ("chat.completions", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("chat.completions", chat(stop=[1]), 400, "stop"),
    ("chat.completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("chat.completions", chat(logit_bias={"x": 1}), 400, "logit_bias"),
    ("chat.completions", chat(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("chat.completions", chat(user=["x"]), 400, "user"),
    ("chat.completions", chat(messages=[]), 400, "messages"),
    ("chat.completions", chat(messages="hi"), 400, "messages"),
    ("chat.completions", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("chat.completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("chat.completions", chat(model="gpt-4o"), 404, "gpt-4o"),
    ("chat.completions", chat(reasoning_effort="banana"), 400, "banana"),
    ("chat.completions", chat(stream="yes"), 400, "stream"),
    ("responses", responses(previous_response_id="resp_123"), 400, "previous_response_id"),
    ("responses", responses(max_output_tokens=0), 400, "max_output_tokens"),
    ("responses", responses(temperature=-1), 400, "temperature"),
    ("responses", responses(tool_choice="required"), 400, "Tool choice"),
    ("responses", {"model": "deepseek-flash"}, 400, "input"),
    ("responses", responses(model="o3"), 404, "o3"),
    ("messages", {k: v for k, v in messages().items() if k != "max_tokens"}, 400, "max_tokens"),
    ("messages", messages(temperature=2), 400, "temperature"),
    ("messages", messages(top_k=-1), 400, "top_k"),
    ("messages", messages(messages=[{"role": "system", "content": "be brief"}]), 400, "system"),
    ("messages", messages(thinking={"type": "enabled", "budget_tokens": 10}), 400, "budget_tokens"),
    ("messages", messages(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 4096}), 400, "budget_tokens"),
    ("messages", messages(stop_sequences="END"), 400, "stop_sequences"),
    ("messages", messages(model="claude-sonnet-4"), 404, "claude-sonnet-4"),
]


@pytest.mark.parametrize("api,body,status,needle", CASES)
def test_official_ranges(pre, api, body, status, needle):
    p = pre.prepare(api, json.dumps(body))
    assert p.rejected and p.context.error_status == status and p.prompt_token_ids == []
    err = json.loads(p.context.error_body)
    if api == "messages":
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert err["type"] == "error" and err["error"]["type"] == kind and needle in err["error"]["message"]
    else:
        assert err["error"]["type"] == "invalid_request_error" and needle in err["error"]["message"]
        assert status != 404 or err["error"]["code"] == "model_not_found"


def test_max_completion_tokens_is_the_output_limit(pre):
    p = pre.prepare("chat.completions", json.dumps(chat(max_completion_tokens=3)))
    assert not p.rejected and p.sampling["max_tokens"] == 3
    assert "max_completion_tokens" not in json.loads(p.context.body)   # the postprocess re-converts this body


def test_valid_requests_pass(pre):
    ok = [("chat.completions", chat(tools=[TOOL], temperature=0, stop="x", logit_bias={"5": -100}, user="u")),
          ("responses", responses(temperature=2, max_output_tokens=16)),
          ("messages", messages(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
                                system="be brief", temperature=1, top_k=5, stop_sequences=["END"]))]
    for api, body in ok:
        p = pre.prepare(api, json.dumps(body))
        assert not p.rejected, p.context.error_body


def test_operator_limits(tokenizer_path):
    limits = Limits(max_request_bytes=2000, max_messages=2, max_tools=1, max_stop_sequences=2,
                    max_tokens_cap=100, default_max_tokens=50)
    pre = Preprocessor(tokenizer_path, 4096, limits=limits)

    def status(api, body):
        return pre.prepare(api, json.dumps(body) if isinstance(body, dict) else body).context.error_status

    assert status("chat.completions", chat(messages=[{"role": "user", "content": "x" * 3000}])) == 413
    assert status("chat.completions", chat(messages=[{"role": "user", "content": "a"}] * 3)) == 400
    assert status("chat.completions", chat(tools=[TOOL, TOOL])) == 400
    assert status("messages", messages(stop_sequences=["a", "b", "c"])) == 400
    assert status("chat.completions", chat(max_tokens=101)) == 400
    assert status("messages", messages(max_tokens=101)) == 400
    assert status("chat.completions", chat(max_tokens=100)) == 0
    default = pre.prepare("chat.completions", json.dumps(chat(thinking={"type": "disabled"})))
    assert default.sampling["max_tokens"] == 50               # not the recipe's 8,192
    assert pre.prepare_text("hi").sampling["max_tokens"] == 50
    assert pre.prepare_text("x" * 3000).context.error_status == 413


def test_size_and_depth_are_checked_before_parsing(pre):
    """A 100,000-deep body (what crashed Triton's own JSON parser) is a 400 at once, and a body over
    max_request_bytes a 413 before any tokenization."""
    deep = '{"model": "deepseek-flash", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    t0 = time.perf_counter()
    p = pre.prepare("chat.completions", deep)
    assert p.context.error_status == 400 and "100001 levels" in json.loads(p.context.error_body)["error"]["message"]
    huge = json.dumps(chat(messages=[{"role": "user", "content": "word " * 2_000_000}]))
    assert pre.prepare("chat.completions", huge).context.error_status == 413
    assert time.perf_counter() - t0 < 5   # generous: what it rules out is tokenizing 10 MB (~10 s)


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(b'{"a": "[[[[{{{"}') == 1
    assert json_depth(b'{"a": "\\"[[["}') == 1
    assert json_depth(b'[[{"a": [1]}]]') == 4
    assert json_depth(b'"x"') == 0


@pytest.mark.parametrize("raw", [b'{"model": "deepseek-flash", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
                                 b'{"model": "deepseek-flash", "temperature": NaN, "messages": []}',
                                 b"[1, 2]", b""])
def test_malformed_bodies(pre, raw):
    p = pre.prepare("chat.completions", raw)
    assert p.context.error_status == 400 and json.loads(p.context.error_body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw,needle", [({"max_tokens": 0}, "max_tokens"), ({"temperature": float("nan")}, "temperature"),
                                       ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
                                       ({"stop_words": [""]}, "stop_words")])
def test_text_inputs_are_checked(pre, kw, needle):
    p = pre.prepare_text("hello", **kw)
    assert p.context.error_status == 400 and needle in json.loads(p.context.error_body)["error"]["message"]


def test_text_input_invalid_utf8(pre):
    assert pre.prepare_text(b"\xff\xfe hi").context.error_status == 400
