"""Images through the real tritonserver (the session server, tiny preset with its vision tower):
Chat Completions, Responses and Messages with an image, streamed and complete, over gRPC and over
the gateway with the official openai / anthropic SDKs; usage counts the image span tokens (the
recipe's count equals the engine's own expanded prompt length); bad images are the API's 400 and
the server keeps serving."""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from deepinfer.ensemble.client import GrpcClient, api_inputs
from tests.serving.test_ensemble import accumulate, complete, summary
from tests.serving.test_gateway import anthropic_client, openai_client, start_gateway, stop_gateway

pytestmark = pytest.mark.triton

MAX_TOKENS = 6
MODEL = "deepseek-flash"


def png(w: int, h: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


IMAGE = png(200, 120, 7)           # span 20 in the tiny preset's plan
B64 = base64.b64encode(IMAGE).decode()
URL = "data:image/png;base64," + B64


def body(api: str, stream: bool, image_url: str = URL) -> dict:
    if api == "chat.completions":
        b = {"model": MODEL, "max_tokens": MAX_TOKENS, "seed": 3, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"}, {"type": "image_url", "image_url": {"url": image_url}}]}]}
        if stream:
            b["stream_options"] = {"include_usage": True}
    elif api == "responses":
        b = {"model": MODEL, "max_output_tokens": MAX_TOKENS, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is in this image?"}, {"type": "input_image", "image_url": image_url}]}]}
    else:
        b = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
            {"type": "text", "text": "What is in this image?"}]}]}
    return {**b, "stream": stream}


def prompt_usage(api: str, obj) -> int:
    return obj.usage.prompt_tokens if api == "chat.completions" else obj.usage.input_tokens


@pytest.mark.parametrize("api", ["chat.completions", "responses", "messages"])
def test_grpc_image_requests_stream_and_complete(server, api):
    with GrpcClient(server.grpc_url) as client:
        outs = list(client.stream(api_inputs(api, body(api, stream=True))))
        whole = list(client.stream(api_inputs(api, body(api, stream=False))))
    assert all(o["status"] == 200 for o in outs + whole), whole
    streamed = accumulate(api, [c for o in outs for c in o["response"]])
    full = complete(api, whole[0]["response"][0])
    assert summary(api, streamed)[2] == summary(api, full)[2] == MAX_TOKENS
    engine_prompt = whole[0]["num_input_tokens"]          # the engine's own expanded prompt length
    assert prompt_usage(api, full) == engine_prompt > 20   # usage counts the whole image span
    if api == "chat.completions":
        assert summary(api, streamed)[:2] == summary(api, full)[:2]


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    proc, url = start_gateway(server.grpc_url, tmp_path_factory.mktemp("gateway-images") / "gateway.log")
    try:
        yield url
    finally:
        stop_gateway(proc)


@pytest.fixture(scope="module")
def oai(gateway):
    return openai_client(gateway)


@pytest.fixture(scope="module")
def claude(gateway):
    return anthropic_client(gateway)


def test_sdks_through_the_gateway(oai, claude):
    chat = body("chat.completions", False)
    whole = oai.chat.completions.create(**{k: v for k, v in chat.items() if k != "stream"})
    chunks = list(oai.chat.completions.create(**{k: v for k, v in body("chat.completions", True).items()
                                                 if k != "stream"}, stream=True))
    assert whole.usage.completion_tokens == MAX_TOKENS == chunks[-1].usage.completion_tokens
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 20
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    resp = oai.responses.create(**{k: v for k, v in body("responses", False).items() if k != "stream"})
    assert resp.usage.input_tokens > 20 and resp.usage.output_tokens == MAX_TOKENS
    events = list(oai.responses.create(**{k: v for k, v in body("responses", True).items() if k != "stream"},
                                       stream=True))
    assert events[-1].response.usage.input_tokens == resp.usage.input_tokens
    msg = claude.messages.create(**{k: v for k, v in body("messages", False).items() if k != "stream"})
    assert msg.usage.input_tokens > 20 and msg.usage.output_tokens == MAX_TOKENS
    with claude.messages.stream(**{k: v for k, v in body("messages", False).items() if k != "stream"}) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens == msg.usage.input_tokens


def test_bad_images_are_400s_and_the_server_keeps_serving(oai, claude):
    bad = "data:image/png;base64," + base64.b64encode(b"this is not a png").decode()
    for url, needle in ((bad, "not a readable"), ("https://example.com/cat.png", "image URLs are not accepted")):
        with pytest.raises(openai.BadRequestError, match=needle):
            oai.chat.completions.create(**{k: v for k, v in body("chat.completions", False, url).items()
                                           if k != "stream"})
        with pytest.raises(openai.BadRequestError, match=needle):
            list(oai.chat.completions.create(**{k: v for k, v in body("chat.completions", True, url).items()
                                                if k != "stream"}, stream=True))
    msgs = body("messages", False)
    msgs["messages"][0]["content"][0]["source"]["data"] = base64.b64encode(b"GIF89a broken").decode()
    with pytest.raises(anthropic.BadRequestError, match="corrupt|not a readable"):
        claude.messages.create(**{k: v for k, v in msgs.items() if k != "stream"})
    ok = oai.chat.completions.create(**{k: v for k, v in body("chat.completions", False).items() if k != "stream"})
    assert ok.usage.completion_tokens == MAX_TOKENS


def test_same_image_batched_equals_alone(server):
    """Two requests with the same image at once (one engine batch) answer what one alone does (the
    session server runs batch_invariant; same seed)."""
    import threading
    api = "chat.completions"

    def run(out, i):
        with GrpcClient(server.grpc_url) as client:
            out[i] = list(client.stream(api_inputs(api, body(api, stream=False))))
    alone = {}
    run(alone, 0)
    pair = {}
    threads = [threading.Thread(target=run, args=(pair, i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    texts = [summary(api, complete(api, r[0]["response"][0]))[:2] for r in (alone[0], pair[0], pair[1])]
    assert texts[0] == texts[1] == texts[2]
