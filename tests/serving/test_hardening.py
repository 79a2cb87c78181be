"""Hardening through the gateway and Triton's own endpoints (issue 16), each item by the exact request
that broke: non-streaming stop sequences, max_completion_tokens and usage through the official SDKs;
grammar rejections, unknown models, previous_response_id, transport errors, sizes and depths, API keys,
request ids, the gateway's metrics, Triton's generate with malformed TensorRT-LLM style inputs, and
Triton's ports on localhost."""

from __future__ import annotations

import gzip
import json
import socket

import anthropic
import httpx
import openai
import pytest

from tests.serving.test_gateway import MODEL, USER, anthropic_client, openai_client, start_gateway, stop_gateway

pytestmark = pytest.mark.triton

MAX_BYTES = 300_000   # above the 200 KB 100,000-deep body, so depth (not size) refuses it
NO_THINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def gw(server, tmp_path_factory):
    log = tmp_path_factory.mktemp("gw-hardening") / "gateway.log"
    proc, url = start_gateway(server.grpc_url, log, "--max-request-bytes", str(MAX_BYTES))
    try:
        yield url, log
    finally:
        stop_gateway(proc)


@pytest.fixture(scope="module")
def url(gw):
    return gw[0]


@pytest.fixture(scope="module")
def oai(url):
    return openai_client(url)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic_client(url)


# -- the listed bugs, through the official SDKs -------------------------------------------------------
def _stop_in(text: str) -> str:
    """A stop string that occurs in text (4 characters from its middle)."""
    k = max(0, len(text) // 2 - 2)
    return text[k:k + 4]


def test_chat_stop_sequence_not_streaming(oai):
    kw = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw).choices[0].message.content
    assert len(full) >= 8, full
    stop = _stop_in(full)
    cut = oai.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.usage.completion_tokens <= 12


def test_messages_stop_sequences_not_streaming(claude):
    # NOTE: anthropic 2.15's create() has no temperature/top_k keywords any more: extra_body
    kw = dict(model=MODEL, max_tokens=12, messages=USER, thinking={"type": "disabled"}, extra_body={"temperature": 0})
    full = claude.messages.create(**kw).content[0].text
    stop = _stop_in(full)
    cut = claude.messages.create(**kw, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in cut.content if b.type == "text") == full[:full.index(stop)]


def test_trtllm_stop_words_not_streaming(server):
    payload = {"text_input": "Hello", "max_tokens": 12, "temperature": 0.0}
    full = httpx.post(f"{server.http_url}/v2/models/deepseek_v41_flash/generate", json=payload, timeout=120).json()
    stop = _stop_in(full["text_output"])
    r = httpx.post(f"{server.http_url}/v2/models/deepseek_v41_flash/generate",
                   json={**payload, "stop_words": [stop]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == full["text_output"][:full["text_output"].index(stop)]
    assert r.json()["finish_reason"] == "stop"


def test_max_completion_tokens(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=3, extra_body=NO_THINK)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=-5)
    assert e.value.body["param"] == "max_completion_tokens"


def test_reasoning_tokens_within_completion_tokens(oai):
    """Thinking on (the default): the recipe counted invalid-UTF-8 ids twice as reasoning (35 of 32);
    tests/recipe/test_postprocess.py covers many id sequences, this the SDK end to end."""
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, seed=5)
    details = r.usage.completion_tokens_details
    assert r.usage.completion_tokens == 16 and 0 < details.reasoning_tokens <= 16


# -- client errors that were 500s or 200s ----------------------------------------------------------------
STRICT_TOOL = {"type": "function", "function": {
    "name": "lookup", "strict": True,
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}},
                   "required": ["code"], "additionalProperties": False}}}


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "regex", "regex": "(("}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<!x)y"}}}}}},
    {"tools": [STRICT_TOOL], **NO_THINK},
], ids=["bad-regex", "json-schema-lookbehind", "strict-tool-lookbehind"])
def test_grammar_rejections_are_400(oai, extra):
    body = {k: v for k, v in extra.items() if k != "tools"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=extra.get("tools", openai.NOT_GIVEN),
                                    extra_body=body)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404_in_each_format(oai, claude):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="o3", input="hi")
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-sonnet-4", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_previous_response_id_is_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="and then?", previous_response_id="resp_abc")
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("kw", [dict(extra_body={"temperature": 2}), dict(extra_body={"top_k": -1}),
                                dict(thinking={"type": "enabled", "budget_tokens": 10}),
                                dict(messages=[{"role": "system", "content": "x"}, *USER])])
def test_messages_official_ranges(claude, kw):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**{"model": MODEL, "max_tokens": 5, "messages": USER, **kw})
    assert e.value.body["error"]["type"] == "invalid_request_error"


# -- transport: every gateway error in the API's JSON -----------------------------------------------------
def _json_error(r: httpx.Response, status: int, api: str = "chat.completions") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json") and r.headers.get("x-request-id")
    body = r.json()
    assert (body["type"] == "error") if api == "messages" else ("message" in body["error"])
    return body


def test_transport_errors_are_json(url):
    chat = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 2}).encode()
    _json_error(httpx.post(f"{url}/v1/chat/completions", content=chat,
                           headers={"content-encoding": "gzip", "content-type": "application/json"}), 400)
    ok = httpx.post(f"{url}/v1/chat/completions", content=gzip.compress(chat),
                    headers={"content-encoding": "gzip", "content-type": "application/json"}, timeout=60)
    assert ok.status_code == 200
    _json_error(httpx.get(f"{url}/v1/chat/completions"), 405)
    _json_error(httpx.post(f"{url}/v1/embeddings", json={}), 404)
    _json_error(httpx.get(f"{url}/v1/messages", headers={"anthropic-version": "2023-06-01"}), 405, "messages")
    big_header = httpx.post(f"{url}/v1/chat/completions", content=chat, timeout=60,
                            headers={"content-type": "application/json", "x-big": "a" * 20_000})
    assert big_header.status_code == 200
    huge = httpx.post(f"{url}/v1/chat/completions", content=chat, headers={"x-huge": "a" * 100_000})
    assert huge.status_code >= 400 and "error" in huge.json()


def test_size_limit_is_413_before_reading(url):
    filler = "word " * (MAX_BYTES // 4)
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": filler}]})
    assert _json_error(r, 413)["error"]["message"].startswith("Request body")
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": filler}]})
    assert _json_error(r, 413, "messages")["error"]["type"] == "request_too_large"


def test_deeply_nested_json_gateway_stays_up(url):
    """The 100,000-deep body that crashed tritonserver 2.51's own JSON parser: the gateway refuses it
    (400) without parsing it and goes on serving."""
    deep = b'{"model": "deepseek-flash", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        r = httpx.post(f"{url}{path}", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "levels deep" in r.text
    assert httpx.get(f"{url}/health").status_code == 200


def test_triton_ports_are_on_localhost(server):
    """Mitigation for Triton's own parser crash (documented): Triton's HTTP and gRPC ports listen on
    127.0.0.1 only, so only the gateway (which limits depth) is reachable from other hosts."""
    from deepinfer.ensemble import serve
    cmd = serve.TritonServer("repo").command()
    assert "--http-address=127.0.0.1" in cmd and "--grpc-address=127.0.0.1" in cmd
    host_ips = {ip for *_, (ip, *_) in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    host_ips -= {"127.0.0.1", "127.0.1.1"}
    port = int(server.http_url.rsplit(":", 1)[1])
    for ip in host_ips:
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((ip, port)) != 0, f"Triton's HTTP port answers on {ip}"


# -- Triton's generate with malformed TensorRT-LLM style inputs ------------------------------------------------
@pytest.mark.parametrize("payload", [{"text_input": "hi", "max_tokens": 0}, {"text_input": "hi", "top_k": -1},
                                     {"text_input": "hi", "top_p": 0.0}, {"text_input": "hi", "stop_words": [""]},
                                     {"text_input": "hi", "max_tokens": 100_000}])
def test_generate_malformed_text_inputs_are_400(server, payload):
    r = httpx.post(f"{server.http_url}/v2/models/deepseek_v41_flash/generate", json=payload, timeout=60)
    assert r.status_code == 400 and "error" in r.json(), r.text


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"text_input": 5}', b'{"text_input": "hi", "seed": -1}',
                                     b'{"text_input": "hi", "max_tokens": "many"}'])
def test_generate_malformed_bodies_are_refused_and_the_server_stays_up(server, content):
    """NOTE: Triton 2.51's HTTP frontend parses the generate body into tensors before any model runs
    and answers what it cannot parse (empty, malformed JSON, wrong types, a negative UINT64 seed) with
    HTTP 500 and its own {"error": ...}; a Python model cannot change that status (documented; the
    gateway answers the same mistakes with the API's 400)."""
    r = httpx.post(f"{server.http_url}/v2/models/deepseek_v41_flash/generate", content=content, timeout=60)
    assert r.status_code in (400, 500) and r.json()["error"], r.text
    assert httpx.get(f"{server.http_url}/v2/health/ready").status_code == 200


# -- observability --------------------------------------------------------------------------------------------
def test_request_ids_and_metrics(gw, oai):
    url, log = gw
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=USER, max_tokens=2, extra_body=NO_THINK)
    rid = raw.headers["x-request-id"]
    assert rid.startswith("req_") and rid in log.read_text()
    text = httpx.get(f"{url}/metrics").text
    assert 'deepinfer_gateway_requests_total{api="chat.completions",status="200"}' in text
    assert 'deepinfer_gateway_rejected_total{api="chat.completions",reason="not_found"}' in text
    assert 'deepinfer_gateway_finish_total{api="chat.completions",reason="length"}' in text
    assert "deepinfer_gateway_request_seconds_bucket" in text and "deepinfer_gateway_engine_alive 1" in text
    tokens = [line for line in text.splitlines() if line.startswith("deepinfer_gateway_generation_tokens_total")]
    assert tokens and all(float(line.rsplit(" ", 1)[1]) > 0 for line in tokens)


# -- API keys ---------------------------------------------------------------------------------------------------
def test_api_keys(server, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# operators\nsk-file-key-2\n")
    proc, url = start_gateway(server.grpc_url, tmp_path / "gw.log", "--api-key", "sk-cli-key-1",
                              "--api-key-file", str(key_file))
    try:
        for key in ("none", ""):
            with pytest.raises(openai.AuthenticationError) as e:
                openai.OpenAI(base_url=f"{url}/v1", api_key=key or "x", max_retries=0).models.list()
            assert e.value.body["code"] == "invalid_api_key"
            with pytest.raises(anthropic.AuthenticationError) as e:
                anthropic.Anthropic(base_url=url, api_key=key or "x", max_retries=0).messages.create(
                    model=MODEL, max_tokens=2, messages=USER)
            assert e.value.body["error"]["type"] == "authentication_error"
        assert httpx.post(f"{url}/v1/chat/completions", json={}).status_code == 401   # no header at all
        for key in ("sk-cli-key-1", "sk-file-key-2"):
            r = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).chat.completions.create(
                model=MODEL, messages=USER, max_tokens=2, extra_body=NO_THINK)
            assert r.usage.completion_tokens == 2
        m = anthropic.Anthropic(base_url=url, api_key="sk-cli-key-1", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=USER, thinking={"type": "disabled"})
        assert m.usage.output_tokens == 2
        assert httpx.get(f"{url}/health").status_code == 200            # probes need no key
    finally:
        stop_gateway(proc)
