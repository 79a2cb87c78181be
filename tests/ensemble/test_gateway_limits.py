"""The gateway's per-client limits (ensemble/gateway_limits.py) on a stepped clock: the token bucket's
burst and refill, the in-flight cap and its release, clients kept apart, the bounded client table."""

from __future__ import annotations

import pytest

from deepinfer.ensemble import gateway_limits
from deepinfer.ensemble.gateway_limits import RateLimiter, RateLimits, estimate_tokens, retry_after_header


def limiter(rpm=None, in_flight=None):
    now = [0.0]
    return RateLimiter(RateLimits(rpm, in_flight), clock=lambda: now[0]), now


def test_a_minute_burst_then_the_refill_rate():
    lim, now = limiter(rpm=6)
    for _ in range(6):
        assert lim.admit("a") is None
        lim.release("a")
    refused = lim.admit("a")
    assert refused is not None and not refused.in_flight and refused.retry_after == pytest.approx(10.0)
    now[0] = 9.9
    assert lim.admit("a") is not None
    now[0] = 10.0                                          # one request's worth refilled (6 a minute)
    assert lim.admit("a") is None and lim.admit("a") is not None
    assert lim.admit("b") is None                           # another client has its own bucket
    now[0] = 1000.0                                         # a long idle: a full bucket, no more
    assert sum(lim.admit("a") is None for _ in range(10)) == 6


def test_the_in_flight_cap_frees_a_slot_when_an_answer_ends():
    lim, _ = limiter(in_flight=2)
    assert lim.admit("a") is None and lim.admit("a") is None
    refused = lim.admit("a")
    assert refused.in_flight and refused.retry_after == 1.0
    assert lim.admit("b") is None
    lim.release("a")
    assert lim.admit("a") is None


def test_a_refused_request_takes_no_token_and_no_slot():
    lim, _ = limiter(rpm=1, in_flight=1)
    assert lim.admit("a") is None
    assert lim.admit("a").in_flight                         # refused by the cap: the bucket is untouched
    lim.release("a")
    assert not lim.admit("a").in_flight                     # now the bucket (used by the first) refuses


def test_the_client_table_forgets_idle_clients(monkeypatch):
    monkeypatch.setattr(gateway_limits, "MAX_CLIENTS", 8)
    lim, now = limiter(rpm=60)
    for i in range(8):
        assert lim.admit(f"c{i}") is None
        lim.release(f"c{i}")
    now[0] = 120.0                                          # every bucket full again
    assert lim.admit("busy") is None                        # past the bound: the idle ones are dropped
    assert len(lim._requests.levels) <= 2 and "busy" in lim._requests.levels


def test_bad_limits_and_the_header():
    with pytest.raises(ValueError, match="rate-limit-rpm"):
        RateLimits(requests_per_minute=0)
    with pytest.raises(ValueError, match="max-in-flight"):
        RateLimits(max_in_flight=0)
    assert not RateLimits().enabled and RateLimits(max_in_flight=3).enabled
    assert retry_after_header(0.01) == "1" and retry_after_header(29.2) == "30"


def test_the_token_budget_is_charged_after_the_answer_and_refills():
    now = [0.0]
    lim = RateLimiter(RateLimits(tokens_per_minute=600), clock=lambda: now[0])
    assert lim.admit("a") is None and lim.admit("a") is None    # nothing charged yet: both admitted
    lim.charge("a", 500)
    lim.release("a")
    assert lim.admit("a") is None                                # 100 tokens left: still admitted
    lim.charge("a", 400)                                         # overdrawn: 300 tokens of debt
    lim.release("a")
    lim.release("a")
    refused = lim.admit("a")
    assert refused.limit == "tpm" and not refused.in_flight
    assert refused.retry_after == pytest.approx(30.1)            # (300 + 1) tokens at 10 a second
    assert lim.admit("b") is None                                # another client has its own budget
    now[0] = 30.0
    assert lim.admit("a") is not None                            # at 0: still refused
    now[0] = 30.2
    assert lim.admit("a") is None
    now[0] = 1000.0
    lim.charge("a", 0)                                           # an empty answer charges nothing
    assert lim._tokens.level("a") == pytest.approx(600.0)       # refilled to the minute's worth, no more


def test_rpm_and_tpm_together_take_a_request_only_when_both_admit():
    now = [0.0]
    lim = RateLimiter(RateLimits(requests_per_minute=2, tokens_per_minute=60), clock=lambda: now[0])
    assert lim.admit("a") is None
    lim.charge("a", 100)                                         # the token budget overdrawn
    lim.release("a")
    assert lim.admit("a").limit == "tpm"
    assert lim._requests.level("a") == pytest.approx(1.0)       # the refusal took no request
    with pytest.raises(ValueError, match="rate-limit-tpm"):
        RateLimits(tokens_per_minute=0)


def test_a_reservation_holds_concurrent_requests_back_and_the_answer_replaces_it():
    """Requests in flight together see each other's reservation (before, all were admitted until an answer
    ended); an answer's real tokens replace its reservation, and a request with no answer gives it back."""
    now = [0.0]
    lim = RateLimiter(RateLimits(tokens_per_minute=600), clock=lambda: now[0])
    assert lim.admit("a", 400) is None                           # 600 -> 200
    assert lim.admit("a", 400) is None                           # 200 > 0: admitted, -> -200
    refused = lim.admit("a", 400)
    assert refused.limit == "tpm" and refused.retry_after == pytest.approx(20.1)   # (200 + 1) at 10 a second
    assert lim._tokens.level("a") == pytest.approx(-200.0)     # the refusal reserved nothing
    lim.charge("a", 100, 400)                                    # answered with 100: 300 back
    lim.release("a")
    assert lim._tokens.level("a") == pytest.approx(100.0)
    lim.refund("a", 400)                                         # the other one ended with no answer
    lim.release("a")
    assert lim._tokens.level("a") == pytest.approx(500.0)
    lim.charge("a", 0, 0)
    assert lim._tokens.level("a") == pytest.approx(500.0)


@pytest.mark.parametrize("body,tokens", [
    (b'{"model": "m", "messages": [], "max_tokens": 100}', 100),
    (b'{"model": "m", "messages": [], "max_completion_tokens": 50, "max_tokens": 999}', 50),
    (b'{"model": "m", "input": "hi", "max_output_tokens": 16}', 16),
    (b'{"model": "m", "input": "hi", "max_output_tokens": true}', 0),
    (b'{"model": "m", "input": "hi", "max_output_tokens": -5}', 0),
    (b'not json at all', 0),
])
def test_the_estimate_is_the_output_cap_plus_the_text_at_four_bytes_a_token(body, tokens):
    assert estimate_tokens(body) == tokens + len(body) // 4


def test_the_estimate_leaves_inline_data_urls_out():
    image = '"data:image/png;base64,' + "A" * 40_000 + '"'
    body = ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": %s}}]}], '
            '"max_tokens": 8}' % image).encode()
    assert estimate_tokens(body) == 8 + (len(body) - len(image) + 2) // 4


def test_the_guard_reserves_up_front_and_settles_with_the_answer():
    """The gateway's guard middleware in a real aiohttp server, its handler answering with a known token count
    (as Gateway._answered charges): two concurrent requests of one client, the second refused while the first
    holds its reservation; after the answer the budget holds what the answer used, not the estimate; a handler
    that fails gives its reservation back."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from deepinfer.ensemble.gateway_guard import CHARGE_TOKENS, GuardConfig, make_guard
    from deepinfer.ensemble.gateway_metrics import GatewayMetrics

    gate = asyncio.Event()

    async def chat(request):
        body = await request.json()
        if body.get("fail"):
            raise RuntimeError("no answer")
        if body.get("wait"):
            await gate.wait()
        request[CHARGE_TOKENS](30)
        return web.json_response({"ok": True})

    async def main():
        cfg = GuardConfig(api_keys=frozenset({"k"}), limits=RateLimits(tokens_per_minute=600))
        app = web.Application(middlewares=[make_guard(cfg, GatewayMetrics())])
        app.router.add_post("/v1/chat/completions", chat)
        auth = {"Authorization": "Bearer k"}
        async with TestClient(TestServer(app)) as client:
            first = asyncio.ensure_future(client.post("/v1/chat/completions", json={"max_tokens": 700, "wait": 1},
                                                      headers=auth))
            await asyncio.sleep(0.2)                                # admitted, its 700+ tokens reserved
            second = await client.post("/v1/chat/completions", json={"max_tokens": 1}, headers=auth)
            assert second.status == 429 and "tokens per minute" in (await second.json())["error"]["message"]
            gate.set()
            assert (await first).status == 200                       # answered with 30 tokens
            third = await client.post("/v1/chat/completions", json={"max_tokens": 500}, headers=auth)
            assert third.status == 200                               # 600 - 30 left (refilling): admitted
            failed = await client.post("/v1/chat/completions", json={"max_tokens": 500, "fail": 1}, headers=auth)
            assert failed.status == 500
            fourth = await client.post("/v1/chat/completions", json={"max_tokens": 1}, headers=auth)
            assert fourth.status == 200                              # the failed one's reservation came back

    asyncio.run(main())
