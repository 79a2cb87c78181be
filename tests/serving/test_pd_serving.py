"""Prefill -> decode through real Triton replicas: a kv_role="prefill" and a kv_role="decode" replica
(tritonserver + gateway each, ensemble/replicas.py) behind the router (ensemble/router_server.py).

The router sends each request to the prefill replica (not streamed), takes its hand-over from the
x-kv-transfer-params header (the ensemble's kv_transfer_params output), and sends the request with
it to the decode replica, which pulls the caches through NIXL and streams. Checked with the official
SDKs for the three APIs, streamed and whole, against the decode replica answering the same request
alone (no hand-over: a single instance's run) under batch_invariant / greedy; then a client that
leaves mid-stream, and the bad input of issue 20 (blocks gone, a transfer that times out, a prefill
replica down), each leaving no block behind on either replica (their deepinfer_* metrics).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from deepinfer.disagg.nixl_transport import import_nixl
from tests.serving.conftest import MAX_MODEL_LEN, free_port, free_ports, serve_router

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.triton

MODEL = "deepseek-flash"
HEADER = "x-kv-transfer-params"
TIMEOUT_S = 4.0     # kv_transfer_timeout_s of both replicas: a prefill's hold, a decode's pull
ENGINE_ARGS = {"max_num_seqs": 8, "batch_invariant": True, "kv_transfer_timeout_s": TIMEOUT_S}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_checkpoint):
    from deepinfer.ensemble.replicas import Replica
    from deepinfer.ensemble.router_server import RouterServer
    state = tmp_path_factory.mktemp("pd")
    ports = free_ports(8)                  # each replica's Triton HTTP / gRPC / metrics and gateway, all distinct
    prefill, decode = (Replica(i, str(tiny_checkpoint), {**ENGINE_ARGS, "kv_role": role}, MAX_MODEL_LEN,
                               tuple(ports[4 * i: 4 * i + 3]), ports[4 * i + 3], state_dir=state)
                       for i, role in enumerate(("prefill", "decode")))
    try:
        prefill.start(timeout=300)
        decode.start(timeout=300)
        rs = RouterServer({decode.gateway_url: decode.metrics_url}, poll_s=0.3, chunk=32,
                          prefill={prefill.gateway_url: prefill.metrics_url})
        with serve_router(rs, handler_cancellation=True) as url:
            yield url, rs, prefill, decode
    finally:
        for r in (prefill, decode):
            r.stop()


# -- the replicas' own figures -------------------------------------------------------------------------
def metric(replica, name: str) -> float:
    text = httpx.get(replica.metrics_url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"deepinfer_{name}{{"))


def wait_idle(*replicas, timeout: float = 15.0) -> None:
    """No request running, no block used, no caches held or being pulled (metrics polled once a second)."""
    names = ("num_requests_running", "cache_blocks_used", "kv_requests_held", "kv_requests_loading")
    deadline = time.monotonic() + timeout
    while True:
        left = {(r.index, n): v for r in replicas for n in names if (v := metric(r, n))}
        if not left:
            return
        assert time.monotonic() < deadline, f"left behind (replica, gauge): {left}"
        time.sleep(0.25)


def handover_from_prefill(prefill, path: str = "/v1/chat/completions", body: dict | None = None) -> tuple[dict, str]:
    """The prefill replica's answer to a request (default: a chat one): (body, its hand-over header)."""
    r = httpx.post(f"{prefill.gateway_url}{path}", timeout=60, json=body or chat_body("Tell me about ships.", False),
                   headers={"anthropic-version": "2023-06-01"} if path == "/v1/messages" else {})
    assert r.status_code == 200, r.text
    return r.json(), r.headers[HEADER]


def chat_body(content: str, stream: bool, max_tokens: int = 6) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, "temperature": 0, "thinking": {"type": "disabled"}}


# -- the three APIs, each through the hand-over and alone ---------------------------------------------------
def chat(base: str, stream: bool, **kw) -> tuple:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=8,
                temperature=0, extra_body={"thinking": {"type": "disabled"}}, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    text, reason, usage = [], None, None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            reason = c.finish_reason or reason
        usage = chunk.usage or usage
    return "".join(text), reason, usage.completion_tokens


def responses(base: str, stream: bool) -> tuple:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    # greedy: the recipe ignores temperature while reasoning, so reasoning off
    args = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=8, temperature=0, reasoning={"effort": "none"})
    if not stream:
        r = client.responses.create(**args)
    else:
        events = list(client.responses.create(**args, stream=True))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete"), events[-1].type
        r = events[-1].response
    return [item.model_dump(exclude={"id", "encrypted_content"}) for item in r.output], r.status, r.usage.output_tokens   # ids differ


def messages(base: str, stream: bool) -> tuple:
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)
    args = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Weather in Paris?"}],
                thinking={"type": "disabled"}, extra_body={"temperature": 0})   # greedy (see responses())
    if not stream:
        m = client.messages.create(**args)
    else:
        with client.messages.stream(**args) as s:
            types = [event.type for event in s]
            m = s.get_final_message()
        assert types[0] == "message_start" and types[-1] == "message_stop"
    return [b.model_dump(exclude={"signature"}) for b in m.content], m.stop_reason, m.usage.output_tokens   # ids differ


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("api", [chat, responses, messages], ids=["chat", "responses", "messages"])
def test_three_apis_across_the_handover_equal_a_single_instance(pd, api, stream):
    url, rs, prefill, decode = pd
    alone = api(decode.gateway_url, stream)                     # no hand-over: the decode replica runs it all
    pulled = metric(decode, "kv_transfers_total")
    via = api(url, stream)                                      # prefill replica -> NIXL -> decode replica
    assert metric(decode, "kv_transfers_total") == pulled + 1 or wait_metric(decode, "kv_transfers_total", pulled + 1)
    assert via == alone
    assert via[2] == 8
    wait_idle(prefill, decode)


def wait_metric(replica, name: str, want: float, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(replica, name) == want:
            return True
        time.sleep(0.2)
    return False


def test_a_clients_own_handover_header_is_dropped_by_the_router(pd):
    url, rs, prefill, decode = pd
    text, reason, n = chat(url, False, extra_headers={HEADER: '{"engine_id": "forged"}'})
    assert reason == "length" and n == 8


# -- cancellation ---------------------------------------------------------------------------------------------
def test_a_client_gone_mid_stream_frees_both_replicas(pd):
    """1500 tokens would keep the decode busy for tens of seconds; the client leaves after a few."""
    url, rs, prefill, decode = pd
    wait_idle(prefill, decode)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body("Count to a thousand.", True, 1500),
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert wait_metric(decode, "num_requests_running", 1)   # the decode holds it (gauges: once a second)
    wait_idle(prefill, decode)                                    # decode request aborted, nothing held anywhere
    assert chat(url, True)[2] == 8                                # and both keep serving


# -- bad input ----------------------------------------------------------------------------------------------------
def test_blocks_that_no_longer_exist_fail_with_the_apis_error(pd):
    url, rs, prefill, decode = pd
    _, handover = handover_from_prefill(prefill)
    body = chat_body("Tell me about ships.", stream=True)
    with httpx.stream("POST", f"{decode.gateway_url}/v1/chat/completions", json=body, headers={HEADER: handover},
                      timeout=60) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    failures = metric(decode, "kv_transfer_failures_total")
    r = httpx.post(f"{decode.gateway_url}/v1/chat/completions", json=body, headers={HEADER: handover}, timeout=60)
    assert r.status_code == 500, r.text                           # pulled once and freed: gone now
    assert "no longer exist" in r.json()["error"]["message"]
    assert wait_metric(decode, "kv_transfer_failures_total", failures + 1)
    wait_idle(prefill, decode)
    assert chat(url, False)[2] == 8


def test_a_transfer_that_times_out_fails_and_the_prefill_frees_at_its_deadline(pd):
    url, rs, prefill, decode = pd
    body = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "Tell me about ships."}]}
    _, handover = handover_from_prefill(prefill, "/v1/messages", body)
    params = json.loads(handover)
    expired = metric(prefill, "kv_holds_expired_total")
    dead = {**params, "engine_id": "deepinfer-prefill-gone", "port": free_port()}    # nobody listens there
    t0 = time.monotonic()
    r = httpx.post(f"{decode.gateway_url}/v1/messages", headers={HEADER: json.dumps(dead), "anthropic-version": "2023-06-01"},
                   json=body, timeout=60)
    assert r.status_code == 500 and r.json()["type"] == "error", r.text   # Anthropic's error shape
    assert "timed out" in r.json()["error"]["message"]
    assert time.monotonic() - t0 >= TIMEOUT_S * 0.9
    wait_idle(prefill, decode)                                    # the prefill's hold expired, freed
    assert metric(prefill, "kv_holds_expired_total") == expired + 1
    assert chat(url, True)[2] == 8


class ServedApp:
    """An aiohttp app on its own loop thread (the router of a test, the unreachable-prefill shim)."""

    def __init__(self, app: web.Application) -> None:
        self.loop, self.port = asyncio.new_event_loop(), free_port()
        self.runner = web.AppRunner(app, handler_cancellation=True)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.2)

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def unreachable_prefill(prefill) -> tuple[web.Application, list]:
    """The prefill replica's gateway behind a shim whose hand-overs name an agent that is gone (an
    engine id and port nobody serves): a prefill replica that died right after answering. -> (app,
    the hand-overs it rewrote)"""
    rewritten = []

    async def forward(request: web.Request) -> web.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.request(request.method, f"{prefill.gateway_url}{request.path_qs}",
                                     content=await request.read(), headers={"content-type": "application/json"})
        headers = {}
        if HEADER in r.headers:
            gone = {**json.loads(r.headers[HEADER]), "engine_id": "deepinfer-prefill-gone", "port": free_port()}
            headers[HEADER] = json.dumps(gone)
            rewritten.append(gone)
        return web.Response(status=r.status_code, body=r.content, headers=headers, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    return app, rewritten


def test_a_failed_pull_is_retried_on_another_prefill_replica(pd, stream=True):
    """The first prefill replica (round robin) hands over caches whose agent is gone: the decode's
    pull times out (a transient failure), the router runs the whole hand-over again on the other
    prefill replica, and the client gets one clean answer, the same as the decode replica alone."""
    from deepinfer.ensemble.router_server import RouterServer
    url, rs, prefill, decode = pd
    alone = chat(decode.gateway_url, stream)
    shim_app, rewritten = unreachable_prefill(prefill)
    shim = ServedApp(shim_app)
    router = ServedApp(RouterServer({decode.gateway_url: decode.metrics_url}, policy="round_robin", poll_s=0.3,
                                    prefill={shim.url: None, prefill.gateway_url: prefill.metrics_url}).app())
    try:
        expired, failures = metric(prefill, "kv_holds_expired_total"), metric(decode, "kv_transfer_failures_total")
        t0 = time.monotonic()
        assert chat(router.url, stream) == alone
        assert time.monotonic() - t0 >= TIMEOUT_S * 0.9              # the first pull waited out its deadline
        assert len(rewritten) == 1                                    # the shim answered once, the retry went elsewhere
        assert wait_metric(decode, "kv_transfer_failures_total", failures + 1)
        wait_idle(prefill, decode)                                    # the shim's hand-over expired on the prefill
        assert metric(prefill, "kv_holds_expired_total") == expired + 1
    finally:
        router.close()
        shim.close()


@pytest.mark.parametrize("header, where", [("not json", "decode"), ("[1, 2]", "decode"), ('{"engine_id": "x"}', "decode"),
                                           ("{}", "prefill"), ("another prompt's", "decode")])
def test_malformed_handovers_get_a_400(pd, header, where):
    url, rs, prefill, decode = pd
    if header == "another prompt's":
        _, header = handover_from_prefill(prefill)              # held until it expires (TIMEOUT_S)
    replica = decode if where == "decode" else prefill
    r = httpx.post(f"{replica.gateway_url}/v1/chat/completions", json=chat_body("hi", False), headers={HEADER: header},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert "kv_transfer_params" in r.json()["error"]["message"]
    wait_idle(prefill, decode)


def test_a_prefill_replica_that_goes_down(pd):
    """Last (it stops the prefill): a hand-over whose prefill died before the pull fails with the API's
    error, the router answers 503 once no prefill is left, the decode replica keeps serving."""
    url, rs, prefill, decode = pd
    _, handover = handover_from_prefill(prefill)
    prefill.server.stop()
    # exited by itself (0) once every model unloaded, not killed after its 30 s exit timeout: no
    # request stranded by a cancelled gRPC stream keeps the engine model referenced (EnsembleCall._finish)
    assert prefill.server.proc.returncode == 0, prefill.server.log_tail()
    r = httpx.post(f"{decode.gateway_url}/v1/chat/completions", json=chat_body("Tell me about ships.", False),
                   headers={HEADER: handover}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["message"], r.text
    wait_idle(decode)
    with pytest.raises(openai.APIStatusError) as e:
        chat(url, True)
    assert e.value.status_code == 503 and "prefill" in e.value.message
    assert chat(decode.gateway_url, True)[2] == 8
