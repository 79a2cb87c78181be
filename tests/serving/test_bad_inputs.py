"""The bad-input corpus (tests/serving/bad_input_corpus.py), a bounded subset against the session
tritonserver and a gateway: every case answered with the official status and the API's error body,
the server healthy after each, and a stream running beside the whole corpus untouched.
perf/bad_inputs.py runs the full corpus (>= 500 cases) and prints the figures."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.serving.bad_input_corpus import corpus, healthy, run_case
from tests.serving.test_gateway import MODEL, USER, start_gateway, stop_gateway

pytestmark = pytest.mark.triton

MAX_REQUEST_BYTES = 300_000   # above the 200 KB deep-nesting case
N_GENERATED = 80        # + ~60 hand-written and Triton-generate cases: well under a minute on the tiny model
BESIDE_TOKENS = 6        # short well-formed streams, one after another, all through the corpus


@pytest.fixture(scope="module")
def urls(server, tmp_path_factory):
    log = tmp_path_factory.mktemp("gw-bad-inputs") / "gateway.log"
    proc, url = start_gateway(server.grpc_url, log, "--max-request-bytes", str(MAX_REQUEST_BYTES))
    try:
        yield {"gateway": url, "text": server.http_url}
    finally:
        stop_gateway(proc)


def test_corpus_subset(urls):
    cases = corpus(N_GENERATED, MAX_REQUEST_BYTES)
    assert len(cases) >= 130
    corpus_done, beside = threading.Event(), []

    def streams_beside():   # well-formed streams running while the corpus is sent
        client = openai.OpenAI(base_url=f"{urls['gateway']}/v1", api_key="none", max_retries=0, timeout=300)
        while not corpus_done.is_set() or not beside:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=BESIDE_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}}))
            beside.append(([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
                           chunks[-1].usage.completion_tokens))

    t = threading.Thread(target=streams_beside)
    t.start()
    wrong, unhealthy = [], []
    with httpx.Client(timeout=120) as client:
        for case in cases:
            problem = run_case(client, urls, case)
            if problem:
                wrong.append(f"{case.name}: {problem}")
            if not healthy(client, urls):
                unhealthy.append(case.name)
                break
    corpus_done.set()
    t.join(300)
    assert not unhealthy, f"server unhealthy after {unhealthy}"
    assert not wrong, "\n".join(wrong)
    assert beside and all(b == (["length"], BESIDE_TOKENS) for b in beside), beside
