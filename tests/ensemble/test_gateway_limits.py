"""The gateway's per-client limits (ensemble/gateway_limits.py) on a stepped clock: the token bucket's
burst and refill, the in-flight cap and its release, clients kept apart, the bounded client table."""

from __future__ import annotations

import pytest

from deepinfer.ensemble import gateway_limits
from deepinfer.ensemble.gateway_limits import RateLimiter, RateLimits, retry_after_header


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
