"""EngineDriver on the real AsyncEngine (tiny checkpoint): one response per step when streaming, one
response otherwise, FINAL always (also after an error, a cancel or a stop), context echoed once."""

from __future__ import annotations

import json
import threading

import pytest

from deepinfer.ensemble.engine_driver import EngineDriver, EngineRequest

PROMPT = [0, 128803, 19923, 2058, 128804, 128822]


class RecordingSender:
    def __init__(self, cancel_after: int | None = None):
        self.responses, self.errors, self.finals = [], [], 0
        self.cancel_after = cancel_after
        self.done = threading.Event()

    def send(self, outputs, final):
        if outputs is not None:
            self.responses.append(outputs)
        if final:
            self.finals += 1
            self.done.set()

    def send_error(self, message, code):
        self.errors.append((code, message))
        self.finals += 1
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def wait(self):
        assert self.done.wait(60), "no FINAL"
        return self


def make_params(kwargs):
    from deepinfer import SamplingParams
    return SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def driver(engine):
    d = EngineDriver(engine, make_params)
    yield d
    d._events.put(None)


def request(key, streaming=True, **sampling):
    return EngineRequest(key, PROMPT, {"max_tokens": 6, "temperature": 0, **sampling}, streaming, context='{"c": 1}')


def test_streaming_one_response_per_step(driver):
    s = RecordingSender()
    driver.submit(request("s1"), s)
    s.wait()
    assert s.finals == 1 and not s.errors
    assert [len(r["output_ids"]) for r in s.responses] == [1] * 6
    assert [r["context"] for r in s.responses] == ['{"c": 1}'] + [""] * 5
    assert [r["num_output_tokens"] for r in s.responses] == list(range(1, 7))
    assert s.responses[-1]["finish_reason"] == "length" and s.responses[0]["finish_reason"] == ""


def test_non_streaming_one_response(driver):
    s, t = RecordingSender(), RecordingSender()
    driver.submit(request("n1", streaming=False), s)
    driver.submit(request("n2", streaming=True), t)
    s.wait(), t.wait()
    assert len(s.responses) == 1 and len(s.responses[0]["output_ids"]) == 6
    assert s.responses[0]["output_ids"] == [i for r in t.responses for i in r["output_ids"]]   # greedy


def test_cancel_sends_cancelled_and_final(driver):
    s = RecordingSender(cancel_after=2)
    driver.submit(request("c1", max_tokens=200), s)
    s.wait()
    assert s.finals == 1 and s.errors[0][0] == "CANCELLED" and len(s.responses) == 2
    assert "c1" not in driver.active


def test_explicit_stop(driver):
    s = RecordingSender()
    driver.submit(request("x1", max_tokens=500), s)
    while not s.responses:
        s.done.wait(0.01)
    stopper = RecordingSender()
    driver.submit(EngineRequest("x1", stop=True), stopper)
    s.wait(), stopper.wait()
    assert stopper.finals == 1 and stopper.responses == []
    assert s.finals == 1 and s.responses[-1]["finish_reason"] == "abort" and len(s.responses) < 500


def test_stop_before_the_request_arrives(driver, engine):
    """A client that leaves while its request is still in the preprocess: the stop comes first."""
    stopper = RecordingSender()
    driver.submit(EngineRequest("early1", stop=True), stopper)
    s = RecordingSender()
    driver.submit(request("early1", max_tokens=500), s)
    s.wait(), stopper.wait()
    assert s.finals == 1 and [r["finish_reason"] for r in s.responses] == ["abort"]
    assert "early1" not in driver.active and engine.num_in_flight() == 0


def test_bad_params_and_rejected_requests(driver):
    bad = RecordingSender()   # through the ensemble (a context): a last response whose context says 400
    driver.submit(request("b1", top_p=7.0), bad)
    assert bad.wait().finals == 1 and not bad.errors and bad.responses[0]["finish_reason"] == "error"
    ctx = json.loads(bad.responses[0]["context"])
    assert ctx["c"] == 1 and ctx["error_status"] == 400 and "top_p" in ctx["error_message"]
    direct = RecordingSender()   # called directly (no context): Triton's INVALID_ARG
    driver.submit(EngineRequest("b0", PROMPT, {"max_tokens": 4, "top_p": 7.0}, True), direct)
    assert direct.wait().errors[0][0] == "INVALID_ARG" and direct.finals == 1
    too_long = RecordingSender()
    driver.submit(EngineRequest("b2", list(range(5, 3000)), {"max_tokens": 4}, True), too_long)
    assert too_long.wait().errors[0][0] == "INVALID_ARG"
    rejected = RecordingSender()
    driver.submit(EngineRequest("b3", [], {}, True, context=json.dumps({"error_status": 400})), rejected)
    assert rejected.wait().finals == 1 and rejected.responses[0]["finish_reason"] == "error"


def test_a_grammar_the_engine_cannot_compile_is_a_client_error(engine):
    """A regex xgrammar refuses: the engine rejects it at admission; the driver answers it as a 400
    the postprocess turns into the API's error body (was a Triton INTERNAL, HTTP 500)."""
    from deepinfer import SamplingParams
    from deepinfer.sampling_params import OutputConstraint
    from deepinfer.recipe.context import RequestContext
    from deepinfer.recipe.errors import error_body

    def params(kwargs):
        c = kwargs.pop("constraint", None)
        return SamplingParams(**kwargs, constraint=OutputConstraint(**c) if c else None)

    d = EngineDriver(engine, params)
    try:
        ctx = RequestContext(api="chat.completions", response_id="chatcmpl-1")
        s = RecordingSender()
        d.submit(EngineRequest("g1", PROMPT, {"max_tokens": 4, "constraint": {"kind": "regex", "spec": "(("}},
                               True, context=ctx.to_json()), s)
        back = RequestContext.from_json(s.wait().responses[0]["context"])
        assert back.error_status == 400 and "regex" in back.error_message
        err = json.loads(error_body(back.api, back.error_status, back.error_message))["error"]
        assert err["type"] == "invalid_request_error"
    finally:
        d._events.put(None)


@pytest.mark.parametrize("handover, needle", [("not json", "not JSON"), ("[1]", "JSON object"),
                                               ('{"engine_id": "x"}', "kv_role='decode'")])
def test_a_bad_or_misplaced_handover_is_a_client_error(driver, handover, needle):
    """kv_transfer_params: malformed, or given to an instance that is not kv_role="decode" (this
    one is "both"): a 400 through the ensemble, and the request never runs; ordinary requests carry
    an empty kv_transfer_params output."""
    s = RecordingSender()
    driver.submit(EngineRequest("h1", PROMPT, {"max_tokens": 4}, True, context='{"c": 1}',
                                kv_transfer_params=handover), s)
    assert s.wait().finals == 1 and not s.errors and s.responses[0]["finish_reason"] == "error"
    ctx = json.loads(s.responses[0]["context"])
    assert ctx["error_status"] == 400 and needle in ctx["error_message"], ctx
    ok = RecordingSender()
    driver.submit(request("h2", streaming=False), ok)
    assert ok.wait().responses[-1]["kv_transfer_params"] == "" and ok.responses[-1]["finish_reason"] == "length"
