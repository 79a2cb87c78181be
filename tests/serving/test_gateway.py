"""The HTTP gateway (ensemble/gateway.py) as a subprocess in front of the session tritonserver, driven
by the official openai (Chat Completions, Responses) and anthropic (Messages) SDKs: everything the
SDKs parse, usage, the APIs' errors through the SDKs' exception types, 503 without Triton, and a
client that disconnects stops the engine request (the engine's running-requests gauge)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.responses import Response

from tests.serving.conftest import free_port
from tests.serving.test_ensemble import MAX_TOKENS, TOOL

pytestmark = pytest.mark.triton

MODEL = "deepseek-flash"
USER = [{"role": "user", "content": "Weather in Paris?"}]


def start_gateway(triton_grpc: str, log_path, *extra_args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.ensemble.gateway", "--triton-grpc", triton_grpc,
                             "--host", "127.0.0.1", "--port", str(port), *extra_args],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()
        try:
            httpx.get(f"{url}/health", timeout=2)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_gateway(proc)
    raise TimeoutError(open(log_path).read())


def stop_gateway(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    proc, url = start_gateway(server.grpc_url, tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield url
    finally:
        stop_gateway(proc)


def openai_client(base: str, api_key: str = "none", timeout: float = 120) -> openai.OpenAI:
    """The official OpenAI SDK on a gateway URL (no retries: a test sees the first answer)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def anthropic_client(base: str, api_key: str = "none", timeout: float = 120) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=api_key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def oai(gateway):
    return openai_client(gateway)


@pytest.fixture(scope="module")
def claude(gateway):
    return anthropic_client(gateway)


def test_health_and_models(gateway, oai, claude):
    assert httpx.get(f"{gateway}/health").json() == {"status": "ready"}
    assert MODEL in [m.id for m in oai.models.list()]
    assert MODEL in [m.id for m in claude.models.list()]
    assert oai.models.retrieve(MODEL).id == claude.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_completions(oai):
    kw = dict(model=MODEL, messages=USER, tools=[TOOL], max_tokens=MAX_TOKENS, seed=1,
              extra_body={"thinking": {"type": "enabled"}})
    whole = oai.chat.completions.create(**kw)
    assert whole.usage.completion_tokens == MAX_TOKENS and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens > 0 and whole.usage.total_tokens == whole.usage.prompt_tokens + MAX_TOKENS
    state = ChatCompletionStreamState()
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS == streamed.usage.completion_tokens
    assert streamed.choices[0].finish_reason == "length"
    # the same seed: the same answer and reasoning, streamed or not
    extra = lambda m: (m.model_extra or {}).get("reasoning_content")  # noqa: E731
    assert (streamed.choices[0].message.content, extra(streamed.choices[0].message)) == \
           (whole.choices[0].message.content, extra(whole.choices[0].message))


def test_chat_sse_framing(gateway):
    body = {"model": MODEL, "messages": USER, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "chat.completion.chunk" for line in lines[:-1])


def test_responses(oai, gateway):
    kw = dict(model="DeepSeek-V4.1-Flash", input="Weather in Paris?", reasoning={"effort": "high"},
              tools=[{"type": "function", **TOOL["function"]}], max_output_tokens=MAX_TOKENS)
    raw = oai.responses.with_raw_response.create(**kw)
    whole = raw.parse()
    assert whole.usage.output_tokens == MAX_TOKENS and whole.status == "incomplete"
    Response.model_validate_json(raw.http_response.text)   # strict: the SDK type
    events = list(oai.responses.create(**kw, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == MAX_TOKENS
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    with httpx.stream("POST", f"{gateway}/v1/responses", json={**kw, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2]))   # event: <type> then data: {...}
    assert len(lines) % 2 == 0 and all(e == f"event: {json.loads(d[6:])['type']}" for e, d in pairs)


def test_messages(claude):
    kw = dict(model="deepseek_v41_flash", max_tokens=MAX_TOKENS, messages=USER,
              thinking={"type": "adaptive"},
              tools=[{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}])
    whole = claude.messages.create(**kw)
    assert whole.usage.output_tokens == MAX_TOKENS and whole.stop_reason == "max_tokens"
    with claude.messages.stream(**kw) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert final.usage.output_tokens == MAX_TOKENS and final.stop_reason == "max_tokens"


def test_concurrent_streams_share_one_channel(gateway):
    """8 streams at once through the gateway's one gRPC channel: each gets its own chunks, in order."""
    import asyncio

    async def one(client, i):
        ids, text, usage = set(), [], None
        async for chunk in await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=MAX_TOKENS,
                seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}}):
            ids.add(chunk.id)
            text += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        return ids, "".join(text), usage

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(run())
    assert all(len(ids) == 1 and usage.completion_tokens == MAX_TOKENS for ids, _, usage in results)
    assert len({next(iter(ids)) for ids, _, _ in results}) == 8


def test_bad_input_is_the_api_error(oai, claude):
    with pytest.raises(openai.NotFoundError) as e:   # an unknown model: 404 model_not_found, as OpenAI
        oai.chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.status_code == 404 and "gpt-4o" in e.value.message
    with pytest.raises(openai.NotFoundError):   # refused before the stream starts: status + JSON
        oai.chat.completions.create(model="gpt-4o", messages=USER, stream=True)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens="x")
    assert "expected an integer" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=5, messages=USER)
    assert e.value.status_code == 404 and e.value.body["error"]["type"] == "not_found_error"
    assert "nope" in e.value.message


def test_unreachable_triton_is_503(tmp_path):
    proc, url = start_gateway(f"127.0.0.1:{free_port()}", tmp_path / "gateway.log")
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).chat.completions.create(
                model=MODEL, messages=USER)
        assert e.value.status_code == 503 and "unreachable" in e.value.message
        with pytest.raises(anthropic.APIStatusError) as e:
            anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
                model=MODEL, max_tokens=5, messages=USER)
        assert e.value.status_code == 503 and e.value.body["type"] == "error"
    finally:
        stop_gateway(proc)


def running(server) -> float:
    text = httpx.get(server.metrics_url).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deepinfer_num_requests_running"))


def wait_running(server, want, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (running(server) == 0) == (want == 0):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_stops_the_engine_request(server, gateway, stream):
    """1500 tokens would take the engine tens of seconds; a client that leaves frees it at once."""
    assert wait_running(server, 0, 30)
    body = {"model": MODEL, "messages": USER, "max_tokens": 1500, "stream": stream,
            "thinking": {"type": "disabled"}}
    if stream:
        with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            assert wait_running(server, 1, 5)   # the gauge is polled once a second; the stream keeps going
    else:   # a non-streaming request: the client gives up while the whole answer is generated
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=2.5))
        assert running(server) >= 1
    assert wait_running(server, 0, 6), "the engine request kept running after the client left"


def test_an_answered_call_ends_its_grpc_stream_with_ok_not_a_cancel(server):
    """After a request's last response the gateway half-closes its gRPC stream and lets Triton end it
    (status OK). Cancelling it there raced Triton 2.51 writing that response: the stranded request
    kept the engine model referenced and a stopped tritonserver waited out its exit timeout."""
    import asyncio

    import grpc
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as aio

    from deepinfer.ensemble import contract as c
    from deepinfer.ensemble.client import _input_tensor
    from deepinfer.ensemble.gateway import EnsembleCall

    engine_in = {t.name: t for t in c.tensors(c.ENGINE, c.IN)}
    ensemble_in = {t.name: t for t in c.ensemble_inputs()}
    body = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 4, "stream": False})

    async def calls() -> list:
        client = aio.InferenceServerClient(server.grpc_url)
        codes = []
        try:
            for i in range(3):   # the engine's stop for an unknown key: answered with FINAL only
                tensors = [_input_tensor(grpcclient, engine_in["request_key"], f"gw-test-ok-{i}"),
                           _input_tensor(grpcclient, engine_in["stop"], True)]
                call = EnsembleCall(client, c.ENGINE, tensors, f"gw-test-ok-{i}-stop")
                while await call.next(30) is not None:
                    pass
                call.close()
                codes.append(await asyncio.wait_for(call._it._grpc_call.code(), 10))
            for i in range(3):   # a whole answer, closed as soon as it is read (its FINAL still to come)
                inputs = {"request": body, "api": "chat.completions", "request_key": f"gw-test-whole-{i}"}
                tensors = [_input_tensor(grpcclient, ensemble_in[k], v) for k, v in inputs.items()]
                call = EnsembleCall(client, c.ENSEMBLE, tensors, f"gw-test-whole-{i}")
                answer = await call.next(120)
                assert answer["status"] == 200 and answer["finish_reason"] and call.engine_done, answer
                call.close()
                codes.append(await asyncio.wait_for(call._it._grpc_call.code(), 10))
        finally:
            await client.close()
        return codes

    assert asyncio.run(calls()) == [grpc.StatusCode.OK] * 6
