"""Cached prompt tokens in the usage of all three APIs, from the engine's prefix cache through the
ensemble and the gateway, parsed by the official SDKs: a request resent with the same long prompt
reports the prefix-cache hit (OpenAI Chat prompt_tokens_details.cached_tokens, Responses
input_tokens_details.cached_tokens, Anthropic cache_read_input_tokens); the first one reports 0.
Its own tritonserver (prefix caching on), so the session server's outputs stay cold-run exact."""

from __future__ import annotations

import openai
import pytest

from tests.serving.conftest import MAX_MODEL_LEN, free_ports
from tests.serving.test_gateway import anthropic_client, openai_client, start_gateway, stop_gateway

pytestmark = pytest.mark.triton

BLOCK = 16
LONG = "You are a careful assistant for the weather desk. " * 24   # ~250 tokens of shared prefix


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, checkpoint):
    from deepinfer.ensemble import serve
    tmp = tmp_path_factory.mktemp("triton-prefix")
    args = {"max_num_seqs": 8, "enable_prefix_caching": True, "block_tokens": BLOCK}
    repo = serve.runtime_repository(tmp / "model_repository", str(checkpoint), MAX_MODEL_LEN, args)
    ports = free_ports(3)
    srv = serve.TritonServer(repo, *ports, log_path=tmp / "tritonserver.log")
    srv.start(timeout=240)
    try:
        proc, url = start_gateway(f"127.0.0.1:{ports[1]}", tmp / "gateway.log")
        try:
            yield url
        finally:
            stop_gateway(proc)
    finally:
        srv.stop()


def test_cached_tokens_in_all_three_usages(gateway):
    oai = openai_client(gateway)
    claude = anthropic_client(gateway)
    msgs = [{"role": "user", "content": LONG + "Weather in Paris?"}]

    def chat():
        u = oai.chat.completions.create(model="deepseek-flash", messages=msgs, max_tokens=2).usage
        return u.prompt_tokens, u.prompt_tokens_details.cached_tokens

    def responses():
        u = oai.responses.create(model="deepseek-flash", input=msgs, max_output_tokens=2).usage
        return u.input_tokens, u.input_tokens_details.cached_tokens

    def messages():
        u = claude.messages.create(model="deepseek-flash", messages=msgs, max_tokens=2).usage
        return u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens

    for api in (chat, responses, messages):
        first_prompt, first_cached = api()
        prompt, cached = api()
        assert prompt == first_prompt > 200
        # the second sees the first one's full blocks (the last prompt token always runs)
        assert first_cached == 0 or api is not chat, (api.__name__, first_cached)
        assert cached >= (prompt - 1) // BLOCK * BLOCK - BLOCK and 0 < cached < prompt, (api.__name__, prompt, cached)


def test_cache_salt_isolates_tenants(gateway):
    oai = openai_client(gateway)
    msgs = [{"role": "user", "content": LONG + "Weather in Rome?"}]

    def cached(**extra):
        u = oai.chat.completions.create(model="deepseek-flash", messages=msgs, max_tokens=2, extra_body=extra).usage
        return u.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0          # the same prompt, another tenant: nothing shared
    assert cached(cache_salt="tenant-a") > 200
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(cache_salt=7)
