"""Two real Triton replicas (tritonserver + gateway each) behind the router (ensemble/router_server.py):
streamed requests of the three APIs go through it; conversations sharing a system prompt stay on one
replica; the router reads the replicas' deepinfer_* metrics; a replica that goes down gets no more
requests, and the requests keep being answered by the other."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serving.conftest import MAX_MODEL_LEN, free_ports, serve_router

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def topology(tmp_path_factory, tiny_checkpoint):
    from deepinfer.ensemble.replicas import Replica
    from deepinfer.ensemble.router_server import RouterServer
    state = tmp_path_factory.mktemp("replicas")
    ports = free_ports(8)                  # each replica's Triton HTTP / gRPC / metrics and gateway, all distinct
    reps = [Replica(i, str(tiny_checkpoint), {"max_num_seqs": 8}, MAX_MODEL_LEN,
                    tuple(ports[4 * i: 4 * i + 3]), ports[4 * i + 3], state_dir=state) for i in range(2)]
    try:
        for r in reps:
            r.start(timeout=300)
        rs = RouterServer({r.gateway_url: r.metrics_url for r in reps}, policy="prefix", poll_s=0.3, chunk=32)
        with serve_router(rs) as url:
            yield url, rs, reps
    finally:
        for r in reps:
            r.stop()


SYSTEMS = ["You are a terse assistant for a shipping company. " * 4, "You translate everything into French. " * 4]


def stream(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data:") or line.startswith("event:")]


def test_three_apis_stream_through_the_router_and_prefixes_stay_put(topology):
    url, rs, reps = topology
    before = {n: r.num_routed for n, r in rs.router.replicas.items()}
    per_system = {0: set(), 1: set()}
    for i in range(6):
        s = i % 2
        body = {"model": "deepseek-flash", "max_tokens": 4, "stream": True,
                "messages": [{"role": "system", "content": SYSTEMS[s]}, {"role": "user", "content": f"question {i}"}]}
        lines = stream(url, "/v1/chat/completions", body)
        assert lines[-1] == "data: [DONE]"
        after = {n: r.num_routed for n, r in rs.router.replicas.items()}
        per_system[s] |= {n for n in after if after[n] > before[n]}
        before = after
    assert all(len(v) == 1 for v in per_system.values()), per_system     # each system prompt on one replica
    lines = stream(url, "/v1/messages", {"model": "deepseek-flash", "max_tokens": 4, "stream": True,
                                         "system": SYSTEMS[0], "messages": [{"role": "user", "content": "hi"}]})
    assert any("message_stop" in line for line in lines)
    lines = stream(url, "/v1/responses", {"model": "deepseek-flash", "max_output_tokens": 4, "stream": True,
                                          "instructions": SYSTEMS[1], "input": "hi"})
    assert any("response.completed" in line or "response.incomplete" in line for line in lines), lines[-3:]
    time.sleep(1.0)
    assert all(r.failures == 0 for r in rs.router.replicas.values())


def test_a_replica_that_goes_down_gets_no_more_requests(topology):
    url, rs, reps = topology
    down = reps[0]
    down.server.stop()                                   # tritonserver gone: its gateway answers 503 / not ready
    deadline = time.monotonic() + 20
    while down.gateway_url in rs.router.healthy() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rs.router.healthy() == [reps[1].gateway_url]
    for i in range(3):
        body = {"model": "deepseek-flash", "max_tokens": 3, "stream": True,
                "messages": [{"role": "system", "content": SYSTEMS[i % 2]}, {"role": "user", "content": "again"}]}
        assert stream(url, "/v1/chat/completions", body)[-1] == "data: [DONE]"
    assert httpx.get(f"{url}/health").json() == {"healthy_replicas": [reps[1].gateway_url]}
