"""The ensemble through a real tritonserver: the three APIs streamed and complete over gRPC
streaming and HTTP generate(_stream), 32 concurrent streams, bad input, the TensorRT-LLM style
inputs, metrics. Chunks are validated with the official openai/anthropic SDK types."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deepinfer.ensemble.client import GrpcClient, api_inputs, generate, generate_stream
from tests.serving.conftest import BATCH_INVARIANT

pytestmark = pytest.mark.triton

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MAX_TOKENS = 8


def body(api: str, stream: bool, seed: int = 1, **kw) -> dict:
    if api == "chat.completions":
        b = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "Weather in Paris?"}],
             "tools": [TOOL], "thinking": {"type": "enabled"}, "max_tokens": MAX_TOKENS}
        if stream:
            b["stream_options"] = {"include_usage": True}
    elif api == "responses":
        b = {"model": "DeepSeek-V4.1-Flash", "input": "Weather in Paris?", "reasoning": {"effort": "high"},
             "tools": [{"type": "function", **TOOL["function"]}], "max_output_tokens": MAX_TOKENS}
    else:
        b = {"model": "deepseek_v41_flash", "max_tokens": MAX_TOKENS, "thinking": {"type": "adaptive"},
             "messages": [{"role": "user", "content": "Weather in Paris?"}],
             "tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]}
    return {**b, "stream": stream, "seed": seed, **kw} if api == "chat.completions" else {**b, "stream": stream, **kw}


def accumulate(api: str, chunks: list[str]):
    """Validate every chunk with the official SDK type and accumulate them into a final object."""
    if api == "chat.completions":
        state = ChatCompletionStreamState()
        for c in chunks:
            state.handle_chunk(ChatCompletionChunk.model_validate_json(c))
        return state.current_completion_snapshot   # get_final_completion refuses finish_reason "length"
    if api == "responses":
        events = [TypeAdapter(ResponseStreamEvent).validate_json(c) for c in chunks]
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in events] == list(range(events[0].sequence_number, events[0].sequence_number + len(events)))
        return events[-1].response
    snapshot = None
    for c in chunks:
        if json.loads(c)["type"] == "ping":   # an SSE keep-alive the SDK drops before parsing
            continue
        snapshot = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_json(c),
                                    current_snapshot=snapshot, json_bufs={})
    return snapshot


def complete(api: str, text: str):
    return {"chat.completions": ChatCompletion, "responses": Response, "messages": Message}[api].model_validate_json(text)


def summary(api: str, obj) -> tuple:
    """(answer text, reasoning text, output tokens) of a final response object."""
    if api == "chat.completions":
        m = obj.choices[0].message
        reasoning = getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content") or ""
        return m.content or "", reasoning, obj.usage.completion_tokens
    if api == "responses":
        text = "".join(p.text for item in obj.output if item.type == "message" for p in item.content)
        reasoning = "".join(p.text for item in obj.output if item.type == "reasoning" for p in (item.content or []))
        return text, reasoning, obj.usage.output_tokens
    text = "".join(b.text for b in obj.content if b.type == "text")
    reasoning = "".join(b.thinking for b in obj.content if b.type == "thinking")
    return text, reasoning, obj.usage.output_tokens


APIS = ["chat.completions", "responses", "messages"]


@pytest.mark.parametrize("api", APIS)
def test_grpc_stream_and_complete(server, api):
    with GrpcClient(server.grpc_url) as client:
        outs = list(client.stream(api_inputs(api, body(api, stream=True))))
        whole = list(client.stream(api_inputs(api, body(api, stream=False))))
    assert all(o["status"] == 200 for o in outs + whole)
    assert [o["finish_reason"] for o in outs[:-1]] == [""] * (len(outs) - 1) and outs[-1]["finish_reason"]
    engine_counts = [o["num_output_tokens"] for o in outs]
    assert engine_counts == sorted(engine_counts) and engine_counts[-1] == MAX_TOKENS
    streamed = accumulate(api, [c for o in outs for c in o["response"]])
    assert len(whole) == 1 and len(whole[0]["response"]) == 1
    full = complete(api, whole[0]["response"][0])
    s_text, s_reasoning, s_tokens = summary(api, streamed)
    f_text, f_reasoning, f_tokens = summary(api, full)
    assert s_tokens == f_tokens == MAX_TOKENS == whole[0]["num_output_tokens"]   # usage = engine count
    if api == "chat.completions":   # the only API with a seed: same seed, same text
        assert (s_text, s_reasoning) == (f_text, f_reasoning)
    assert "".join(o["text_output"] for o in outs) == s_text


@pytest.mark.parametrize("api", APIS)
def test_http_generate_stream_and_generate(server, api):
    events = list(generate_stream(server.http_url, api_inputs(api, body(api, stream=True))))
    assert all("error" not in e for e in events)
    chunks = [c for e in events for c in (e["response"] if isinstance(e["response"], list) else [e["response"]])]
    streamed = accumulate(api, chunks)
    one = generate(server.http_url, api_inputs(api, body(api, stream=False)))
    assert one["http_status"] == 200, one
    response = one["response"] if isinstance(one["response"], str) else one["response"][0]
    s_summary, f_summary = summary(api, streamed), summary(api, complete(api, response))
    assert s_summary[2] == f_summary[2] == MAX_TOKENS
    if api == "chat.completions":
        assert s_summary == f_summary


def test_32_concurrent_streams_in_order_and_equal_to_complete(server):
    n, results, errors = 32, {}, []

    def run(i):
        try:
            b = {"model": "deepseek-flash", "messages": [{"role": "user", "content": f"Count to {i}."}],
                 "thinking": {"type": "disabled"}, "max_tokens": MAX_TOKENS, "seed": i, "temperature": 0.8}
            with GrpcClient(server.grpc_url) as client:
                outs = list(client.stream(api_inputs("chat.completions", {**b, "stream": True})))
                whole = list(client.stream(api_inputs("chat.completions", {**b, "stream": False})))
            results[i] = (outs, whole)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(results) == n
    mismatched = []
    for i, (outs, whole) in results.items():
        counts = [o["num_output_tokens"] for o in outs]
        assert counts == sorted(counts) and len(set(counts)) == len(counts)   # in order, no duplicates
        assert outs[-1]["finish_reason"] == "length" and counts[-1] == MAX_TOKENS
        streamed = accumulate("chat.completions", [c for o in outs for c in o["response"]])
        if summary("chat.completions", streamed) != summary("chat.completions", complete("chat.completions", whole[0]["response"][0])):
            mismatched.append(i)
    if mismatched and not BATCH_INVARIANT:
        pytest.xfail(f"streamed != complete for seeds {mismatched}: the engine has no batch-invariant mode yet")
    assert not mismatched, f"streamed != complete for seeds {mismatched} (batch invariance)"


BAD = [
    ("chat.completions", "{not json", "invalid JSON"),
    ("chat.completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "model"),
    ("chat.completions", json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}), "gpt-4o"),
    ("responses", json.dumps({"model": "deepseek-flash", "input": "hi", "max_output_tokens": "x"}), "expected an integer"),
    ("chat.completions", json.dumps({"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}],
                                     "tools": [TOOL], "tool_choice": "required"}), "tool_choice"),
    ("chat.completions", json.dumps({"model": "deepseek-flash",
                                     "messages": [{"role": "user", "content": "hi " * 3000}]}), "context length"),
    ("messages", json.dumps({"model": "nope", "max_tokens": 5, "messages": []}), "nope"),
]


@pytest.mark.parametrize("api,raw,needle", BAD)
def test_bad_input_answers_with_the_api_error(server, api, raw, needle):
    good: dict = {}

    def good_stream():
        with GrpcClient(server.grpc_url) as other:
            good["outs"] = list(other.stream(api_inputs("chat.completions", body("chat.completions", True))))

    t = threading.Thread(target=good_stream)
    t.start()
    with GrpcClient(server.grpc_url) as client:
        outs = list(client.stream({"request": raw, "api": api}))
    events = list(generate_stream(server.http_url, {"request": raw, "api": api}))
    t.join(120)
    unknown_model = any(name in raw for name in ('"gpt-4o"', '"nope"'))
    for out in (outs[0], events[0]):
        assert out["status"] == (404 if unknown_model else 400) and out["finish_reason"] == "error"
        response = out["response"] if isinstance(out["response"], list) else [out["response"]]
        err = json.loads(response[0])
        message = err["error"]["message"]
        assert (err["type"] == "error") if api == "messages" else ("type" in err["error"])
        assert needle in message
    assert len(outs) == 1
    assert good["outs"][-1]["finish_reason"] == "length"          # the other stream is unaffected
    assert httpx.get(f"{server.http_url}/v2/health/ready").status_code == 200


def test_trtllm_style_inputs(server):
    events = list(generate_stream(server.http_url, {"text_input": "Hello", "max_tokens": 5, "stream": True,
                                                    "temperature": 0.0, "exclude_input_in_output": True}))
    assert len(events) == 5 and events[-1]["finish_reason"] == "length"
    assert [e["num_output_tokens"] for e in events] == [1, 2, 3, 4, 5] and events[0]["num_input_tokens"] == 2
    one = generate(server.http_url, {"text_input": "Hello", "max_tokens": 5, "temperature": 0.0})
    assert one["text_output"] == "".join(e["text_output"] for e in events)


def test_engine_stop_input_and_direct_call(server):
    """The engine model called directly: the explicit stop (request_key + stop) ends a running request."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from deepinfer.ensemble import contract as c
    seen, done = [], threading.Event()

    def callback(result, error):
        seen.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback)
    key = np.array([b"direct-1"], dtype=np.object_)
    client.async_stream_infer(c.ENGINE, [
        tensor("input_ids", np.array([0, 128803, 19923, 128804, 128822], dtype=np.int32), "INT32"),
        tensor("sampling", np.array([json.dumps({"max_tokens": 1500}).encode()], dtype=np.object_), "BYTES"),
        tensor("streaming", np.array([True]), "BOOL"), tensor("request_key", key, "BYTES")],
        enable_empty_final_response=True)
    while len(seen) < 3:
        done.wait(0.05)
    stopper = grpcclient.InferenceServerClient(server.grpc_url)
    stopped = []
    stopper.start_stream(callback=lambda result, error: stopped.append((result, error)))
    stopper.async_stream_infer(c.ENGINE, [tensor("request_key", key, "BYTES"), tensor("stop", np.array([True]), "BOOL")],
                               enable_empty_final_response=True)
    assert done.wait(60)
    stopper.stop_stream(), client.stop_stream()
    stopper.close(), client.close()
    last = seen[-1][0]
    finals = [r for r, e in seen if r is not None and r.as_numpy("finish_reason") is not None
              and r.as_numpy("finish_reason")[0]]
    assert finals and finals[-1].as_numpy("finish_reason")[0] == b"abort" and len(seen) < 1500
    assert last.get_response().parameters["triton_final_response"].bool_param


def test_metrics(server):
    text = httpx.get(server.metrics_url).text
    for name in ("deepinfer_generation_tokens_total", "deepinfer_num_requests_running", "deepinfer_cache_usage",
                 "deepinfer_time_to_first_token_seconds", "deepinfer_preemptions_total"):
        assert name in text, name
    # the engine model froze its startup heap after building the engine: that collection is counted (the
    # metrics poller copies the engine's counters once a second)
    for _ in range(50):
        full = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(server.metrics_url).text.splitlines()
                if line.startswith("deepinfer_gc_full_collections_total{")]
        if full and full[0] >= 1:
            break
        time.sleep(0.2)
    assert full and full[0] >= 1, full


def test_perf_analyzer_streaming_load(server, tmp_path):
    """perf/perf_analyzer_ensemble.py's perf_analyzer run (tritonclient 2.51 wheel) on the ensemble."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "perf" / "perf_analyzer_ensemble.py"
    spec = importlib.util.spec_from_file_location("perf_analyzer_ensemble", path)
    perf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf)
    result = perf.run_perf_analyzer(server.grpc_url, concurrency=4, num_requests=8, out_dir=tmp_path)
    assert "Response Throughput" in result["stdout"]
    tokens_per_s, n_tokens = perf.streamed_tokens_per_s(result["export"])
    assert tokens_per_s > 0 and n_tokens > 0 and perf.first_response_latencies(result["export"])
