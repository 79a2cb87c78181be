"""The gateway's per-client rate limits through the real gateway, Triton and the official SDKs: a key's
requests past its per-minute budget are 429 in each API's own format with Retry-After, other keys keep
theirs, a second request beside an open stream is 429 while the in-flight cap is reached and admitted
once the stream has ended, probes are never limited, and the metrics count the refusals; under a token
budget a key is charged each answer's tokens when it ends (streams too) and refused once overdrawn."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.serving.test_gateway import MODEL, USER, anthropic_client, openai_client, start_gateway, stop_gateway

pytestmark = pytest.mark.triton

NO_THINK = {"thinking": {"type": "disabled"}}
KEYS = ("key-a", "key-b", "key-c")


@pytest.fixture(scope="module")
def url(server, tmp_path_factory):
    keys = [arg for k in KEYS for arg in ("--api-key", k)]
    proc, url = start_gateway(server.grpc_url, tmp_path_factory.mktemp("gw-limits") / "gateway.log", *keys,
                              "--rate-limit-rpm", "2", "--max-in-flight-per-client", "1")
    try:
        yield url
    finally:
        stop_gateway(proc)


def chat(client: openai.OpenAI):
    return client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body=NO_THINK)


def test_past_the_minute_budget_is_429_in_each_api(url):
    a = openai_client(url, "key-a")
    t0 = time.monotonic()
    chat(a), chat(a)
    with pytest.raises(openai.RateLimitError) as e:
        chat(a)
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    assert e.value.body["type"] == "requests" and "requests per minute" in e.value.message
    # half a minute for one of 2 rpm, counted from the first request (however slow the host ran them)
    assert 29 - (time.monotonic() - t0) <= int(e.value.response.headers["retry-after"]) <= 30
    b = anthropic_client(url, "key-b")                                         # another key: its own budget
    for _ in range(2):
        b.messages.create(model=MODEL, max_tokens=2, messages=USER, thinking={"type": "disabled"})
    with pytest.raises(anthropic.RateLimitError) as e:
        b.messages.create(model=MODEL, max_tokens=2, messages=USER, thinking={"type": "disabled"})
    assert e.value.body["error"]["type"] == "rate_limit_error" and e.value.response.headers["retry-after"]
    for _ in range(3):                                                         # probes are not limited
        assert httpx.get(f"{url}/health", headers={"Authorization": "Bearer key-a"}).status_code == 200


def test_a_second_request_beside_an_open_stream(url):
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, "stream": True, **NO_THINK}
    headers = {"Authorization": "Bearer key-c"}
    long = {**body, "max_tokens": 96}                           # open long enough to send one beside it
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()              # held: a dropped line iterator closes the response (and the stream)
        next(lines)                                                            # the stream is open
        beside = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert beside.status_code == 429 and beside.headers["retry-after"] == "1"
        assert "in flight" in beside.json()["error"]["message"]
        assert [ln for ln in lines if ln][-1] == "data: [DONE]"                # to its end
    after = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, headers=headers, timeout=60)
    assert after.status_code == 200, after.text                                # the refusal took no token


def test_the_metrics_count_the_refusals(url):
    text = httpx.get(f"{url}/metrics").text
    counts = {api: float(ln.split()[-1]) for ln in text.splitlines() for api in ("chat.completions", "messages")
              if ln.startswith(f'deepinfer_gateway_rejected_total{{api="{api}",reason="rate_limited"}}')}
    assert counts == {"chat.completions": 2, "messages": 1}


@pytest.fixture(scope="module")
def tpm_url(server, tmp_path_factory):
    proc, url = start_gateway(server.grpc_url, tmp_path_factory.mktemp("gw-tpm") / "gateway.log",
                              "--api-key", "key-t", "--api-key", "key-s", "--rate-limit-tpm", "1")
    try:
        yield url
    finally:
        stop_gateway(proc)


def test_a_token_budget_refuses_once_the_answers_overdraw_it(tpm_url):
    t = openai_client(tpm_url, "key-t")
    first = chat(t)                                            # a budget of 1 token a minute: admitted
    assert first.usage.prompt_tokens + first.usage.completion_tokens > 1      # and it overdraws it
    with pytest.raises(openai.RateLimitError) as e:
        chat(t)
    assert e.value.body["code"] == "rate_limit_exceeded" and "tokens per minute" in e.value.message
    debt = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert int(e.value.response.headers["retry-after"]) >= debt * 60          # refills at 1 token a minute
    # a stream is charged when it ends: its key is refused after it, not during it
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "stream": True, "reasoning": {"effort": "none"}}
    headers = {"Authorization": "Bearer key-s"}
    with httpx.stream("POST", f"{tpm_url}/v1/responses", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = [ln for ln in r.iter_lines() if ln.startswith("event:")]
        assert events[-1] in ("event: response.completed", "event: response.incomplete"), events[-3:]
    again = httpx.post(f"{tpm_url}/v1/responses", json={**body, "stream": False}, headers=headers, timeout=60)
    assert again.status_code == 429 and "tokens per minute" in again.json()["error"]["message"]
