"""Postprocess: engine token ids -> chunks that parse and accumulate with the recipe's own response
classes; usage equals the engine's token count; stop sequences; the text API; the stream registry."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest

from deepinfer.recipe import Postprocessor, ResponseStream
from tests.recipe.conftest import TOOL, chat, messages, responses

ANSWER = ('Let me think.</think>I will check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
          '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
RESPONSE_CLASSES = {"chat.completions": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse,
                    "messages": dr.MessagesResponse}
CHUNK_CLASSES = {"chat.completions": "choices", "responses": "type", "messages": "type"}
BODIES = {"chat.completions": lambda **kw: chat(tools=[TOOL], **kw),
          "responses": lambda **kw: responses(tools=[{"type": "function", **TOOL["function"]}], **kw),
          "messages": lambda **kw: messages(tools=[{"name": "get_weather", "description": "Get the weather.",
                                                    "input_schema": TOOL["function"]["parameters"]}], **kw)}


def answer_ids(pre) -> list[int]:
    return pre.tokenizer.encode(ANSWER) + [1]   # + EOS, as the engine emits it


def run(pre, api, stream, step=1):
    p = pre.prepare(api, json.dumps(BODIES[api](stream=stream)))
    s = ResponseStream(p.context, pre.tokenizer)
    ids, outs = answer_ids(pre), []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        outs.append(s.push(ids[i:i + step], None, "stop" if last else None))
    return p, ids, outs


@pytest.mark.parametrize("api", list(BODIES))
def test_streamed_equals_complete_and_usage_is_engine_count(pre, api):
    p, ids, outs = run(pre, api, stream=True)
    assert outs[-1].done and not any(o.done for o in outs[:-1])
    chunks = [c for o in outs for c in o.chunks]
    for c in chunks:
        json.loads(c)
    _, _, whole = run(pre, api, stream=False, step=len(ids))
    complete = json.loads(whole[-1].chunks[0])
    usage = complete["usage"]
    n_out = usage.get("completion_tokens", usage.get("output_tokens"))
    assert n_out == len(ids) == outs[-1].num_output_tokens
    text = json.dumps(complete)
    assert "Paris" in text and "get_weather" in text and "Let me think." in text
    assert "end▁of▁sentence" not in text


def test_chat_stream_chunks_accumulate(pre):
    p, ids, outs = run(pre, "chat.completions", stream=True, step=3)
    chunks = [json.loads(c) for o in outs for c in o.chunks]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    assert reasoning == "Let me think."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert "".join(o.text for o in outs) == "I will check."


def test_stop_sequence_ends_the_answer_and_asks_to_stop_the_engine(pre):
    body = chat(thinking={"type": "disabled"}, stop=["STOP"], stream=True)
    p = pre.prepare("chat.completions", json.dumps(body))
    s = ResponseStream(p.context, pre.tokenizer)
    ids = pre.tokenizer.encode("Hello STOP and more text")
    outs = [s.push([t]) for t in ids]
    stopped = [i for i, o in enumerate(outs) if o.stopped]
    assert len(stopped) == 1 and outs[stopped[0]].done and outs[stopped[0]].finish_reason == "stop"
    assert "".join(o.text for o in outs).strip() == "Hello"
    assert s.push([5], None, "length").chunks == []      # the engine's late tokens are dropped


def test_text_api_decodes_incrementally(pre):
    from deepinfer.recipe import prepare_inputs
    p = prepare_inputs(pre, {"text_input": "Hi", "stream": True, "exclude_input_in_output": False,
                             "stop_words": ["zz"]})
    s = ResponseStream(p.context, pre.tokenizer)
    ids = pre.tokenizer.encode("Grüße 🦀 yes")
    outs = [s.push([t]) for t in ids] + [s.push([1], None, "stop")]
    assert "".join(o.text for o in outs) == "HiGrüße 🦀 yes"
    assert all(o.chunks == [] for o in outs) and outs[-1].num_output_tokens == len(ids) + 1


def test_postprocessor_registry(pre, tokenizer_path):
    post = Postprocessor(tokenizer_path)
    p = pre.prepare("messages", json.dumps(messages(stream=True)))
    ids = pre.tokenizer.encode("Hi there") + [1]
    out0, stop = post.process({"request_key": "k", "context": p.context.to_json(), "output_ids": ids[:1],
                               "logprobs": "", "finish_reason": "", "num_input_tokens": 1, "num_output_tokens": 1})
    assert not stop and "k" in post.streams and out0["status"] == 200
    assert json.loads(out0["response"][0])["type"] == "message_start"
    out1, _ = post.process({"request_key": "k", "context": "", "output_ids": ids[1:], "logprobs": "",
                            "finish_reason": "stop", "num_input_tokens": 1, "num_output_tokens": len(ids)})
    assert "k" not in post.streams and out1["finish_reason"] == "stop"
    assert json.loads(out1["response"][-1])["type"] == "message_stop"
    events = [json.loads(c) for c in out0["response"] + out1["response"]]
    usage = [e for e in events if e["type"] == "message_delta"][0]["usage"]
    assert usage["output_tokens"] == len(ids)


def test_postprocessor_rejection(pre, tokenizer_path):
    post = Postprocessor(tokenizer_path)
    p = pre.prepare("messages", "{oops")
    out, stop = post.process({"request_key": "k", "context": p.context.to_json(), "output_ids": [],
                              "logprobs": "", "finish_reason": "error"})
    assert out["status"] == 400 and json.loads(out["response"][0])["type"] == "error" and not post.streams


def test_logprobs_reach_the_chunks(pre):
    body = chat(thinking={"type": "disabled"}, logprobs=True, top_logprobs=1, stream=True)
    p = pre.prepare("chat.completions", json.dumps(body))
    s = ResponseStream(p.context, pre.tokenizer)
    ids = pre.tokenizer.encode("Hello")
    out = s.push(ids, [(-0.5, [(ids[0], -0.5)])] * len(ids), "stop")
    lp = [json.loads(c)["choices"][0]["logprobs"] for c in out.chunks]
    assert any(x and x.get("content") for x in lp)


def test_text_does_not_depend_on_how_the_engine_groups_ids(pre, tokenizer_path):
    """A request cut by max_tokens inside a multi-byte character (its last id is a partial UTF-8
    byte token) reads the same whether its ids came one per step or all in one response, and its
    usage still counts every id the engine generated."""
    from deepinfer.recipe.token_bytes import TokenBytes
    body = json.dumps(chat(max_tokens=8, thinking={"type": "disabled"}))
    partial = pre.tokenizer.encode("🦀")[:2]          # 🦀 is three byte tokens: keep two
    ids = pre.tokenizer.encode(" engineering-founder polyethylene") + partial
    token_bytes = TokenBytes.from_file(tokenizer_path)

    def final(step: int) -> dict:
        p = pre.prepare("chat.completions", body)
        s = ResponseStream(p.context, pre.tokenizer, token_bytes=token_bytes)
        outs = [s.push(ids[i:i + step], None, "length" if i + step >= len(ids) else None)
                for i in range(0, len(ids), step)]
        return json.loads(outs[-1].chunks[-1])

    for step in (1, 3, len(ids)):
        response = final(step)
        assert response["choices"][0]["message"]["content"] == " engineering-founder polyethylene"
        assert response["usage"]["completion_tokens"] == len(ids)


def test_incomplete_utf8_tail(pre, tokenizer_path):
    from deepinfer.recipe.token_bytes import TokenBytes
    tb = TokenBytes.from_file(tokenizer_path)
    crab, word = pre.tokenizer.encode("🦀"), pre.tokenizer.encode(" hello")
    assert len(crab) == 3
    assert [tb.incomplete_tail(word + crab[:k]) for k in range(4)] == [0, 1, 2, 0]
    assert tb.incomplete_tail(word + [1]) == 0 and tb.incomplete_tail([]) == 0


STOP_BODIES = {"chat.completions": lambda **kw: chat(stop=["STOP"], **kw),
               "messages": lambda **kw: messages(stop_sequences=["STOP"], **kw)}


@pytest.mark.parametrize("api", list(STOP_BODIES))
def test_stop_sequence_in_a_complete_response(pre, api):
    """Non-streaming: all ids arrive in one push; the ids after the match are dropped (no
    'stream processor has finished'), the answer ends before the stop, the reason is the stop's."""
    p = pre.prepare(api, json.dumps(STOP_BODIES[api](stream=False)))
    s = ResponseStream(p.context, pre.tokenizer)
    ids = pre.tokenizer.encode("Let me think.</think>Hello world, STOP here and more text.") + [1]
    out = s.push(ids, None, "stop")
    assert out.done and out.finish_reason == "stop" and not out.stopped   # the engine already ended
    whole = json.loads(out.chunks[0])
    if api == "chat.completions":
        assert whole["choices"][0]["message"]["content"] == "Hello world, "
        assert whole["choices"][0]["finish_reason"] == "stop"
        assert whole["usage"]["completion_tokens"] < len(ids)
    else:
        assert whole["content"][-1]["text"] == "Hello world, "
        assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "STOP")


def test_text_api_stop_words_in_a_complete_response(pre):
    p = pre.prepare_text("hi", max_tokens=50, stream=False, stop_words=["STOP"])
    s = ResponseStream(p.context, pre.tokenizer)
    out = s.push(pre.tokenizer.encode("Hello world, STOP here and more text.") + [1], None, "stop")
    assert out.done and out.text == "Hello world, " and out.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_never_exceed_completion_tokens(pre, stream):
    """Random ids (invalid UTF-8 among them: the recipe counts those twice as reasoning) in thinking
    mode: usage keeps reasoning_tokens <= completion_tokens == the engine's count."""
    import random
    rng = random.Random(0)
    worst = 0
    for _ in range(40):
        ids = [rng.randrange(2, 128000) for _ in range(32)]
        kw = {"stream_options": {"include_usage": True}} if stream else {}
        p = pre.prepare("chat.completions", json.dumps(chat(max_tokens=32, stream=stream, **kw)))
        s = ResponseStream(p.context, pre.tokenizer)
        outs = ([s.push([t], None, "length" if k == 31 else None) for k, t in enumerate(ids)] if stream
                else [s.push(ids, None, "length")])
        usage = json.loads(outs[-1].chunks[-1])["usage"]
        assert usage["completion_tokens"] == 32
        worst = max(worst, usage["completion_tokens_details"]["reasoning_tokens"])
    assert worst == 32


@pytest.mark.parametrize("stream", [False, True])
def test_responses_usage_validates_against_the_openai_sdk(pre, stream):
    """Every Responses event and response validates strictly against the OpenAI SDK's types, whose
    usage declares input_tokens_details.cache_write_tokens required (the recipe leaves it out): 0, the
    prefix cache's reads in cached_tokens."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    p = pre.prepare("responses", json.dumps(BODIES["responses"](stream=stream)))
    s = ResponseStream(p.context, pre.tokenizer, cached_tokens=5)
    ids = answer_ids(pre)
    outs = [s.push(ids, None, "stop")]
    chunks = [c for o in outs for c in o.chunks]
    if stream:
        final = [TypeAdapter(ResponseStreamEvent).validate_json(c) for c in chunks][-1].response
    else:
        final = Response.model_validate_json(chunks[-1])
    details = final.usage.input_tokens_details
    assert details.cache_write_tokens == 0 and details.cached_tokens == 5
