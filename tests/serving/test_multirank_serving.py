"""The `deepinfer` model hosting a multi-rank engine (2 gloo rank workers: attention DP + MoE EP)
from its one Triton instance: streams through the ensemble give the 1-rank server's tokens
(batch-invariant mode on both), per-rank metrics are published, and stopping tritonserver leaves no
rank worker behind."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from deepinfer.ensemble import serve
from deepinfer.ensemble.client import GrpcClient, api_inputs
from tests.serving.conftest import BATCH_INVARIANT, ENGINE_ARGS, MAX_MODEL_LEN, free_ports

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not BATCH_INVARIANT, reason="needs batch_invariant")]

RANKS = 2
PROMPTS = ["Weather in Paris?", "Name three primes.", "Say hi.", "Count to five.", "What is 2+2?", "Why is the sky blue?"]


def _children(pid: int) -> set[int]:
    """Every descendant of pid (from /proc: no psutil needed)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _rank_workers(pid: int) -> set[int]:
    found = set()
    for c in _children(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"deepinfer.parallel.worker" in cmd:
            found.add(c)
    return found


@pytest.fixture(scope="module")
def multirank(tmp_path_factory, checkpoint):
    tmp = tmp_path_factory.mktemp("triton-ranks")
    engine_args = {**ENGINE_ARGS, "data_parallel_size": RANKS, "expert_parallel": True}
    repo = serve.runtime_repository(tmp / "model_repository", str(checkpoint), MAX_MODEL_LEN, engine_args)
    ports = free_ports(3)
    srv = serve.TritonServer(repo, *ports, log_path=tmp / "tritonserver.log")
    srv.start(timeout=300)
    try:
        yield srv, f"127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[2]}/metrics"
    finally:
        srv.stop()


def _chat(prompt: str, seed: int) -> dict:
    return {"model": "deepseek-flash", "messages": [{"role": "user", "content": prompt}], "stream": False,
            "thinking": {"type": "disabled"}, "max_tokens": 6, "temperature": 0.8, "seed": seed}


def _concurrent_texts(grpc_url: str) -> dict[int, str]:
    results, errors = {}, []

    def run(i):
        try:
            with GrpcClient(grpc_url) as client:
                outs = list(client.stream(api_inputs("chat.completions", _chat(PROMPTS[i], seed=10 + i))))
            assert len(outs) == 1 and outs[0]["status"] == 200, outs
            message = json.loads(outs[0]["response"][0])["choices"][0]["message"]
            results[i] = (message.get("content") or "", outs[0]["num_output_tokens"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


def test_two_rank_engine_serves_the_one_rank_tokens_and_publishes_rank_metrics(multirank, server):
    srv, grpc_url, metrics_url = multirank
    assert len(_rank_workers(srv.proc.pid)) == RANKS          # the rank workers live under the stub
    got = _concurrent_texts(grpc_url)
    want = _concurrent_texts(server.grpc_url)                # the session's 1-rank server, same args
    assert got == want
    assert all(n == 6 for _, n in got.values())
    text = httpx.get(metrics_url).text
    for r in range(RANKS):
        assert 'deepinfer_rank_generation_tokens{' in text and f'rank="{r}"' in text
    # both ranks served requests (the least-loaded placement spreads 6 concurrent requests)
    per_rank = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("deepinfer_rank_generation_tokens{")]
    assert len(per_rank) == RANKS and all(v > 0 for v in per_rank), per_rank


def test_image_requests_on_two_ranks_give_the_one_rank_answers(multirank, server):
    """Image requests through the ensemble on rank workers (each rank encodes its requests' images
    ahead of their steps, parallel/image_ahead.py): the 1-rank server's answers, a broken image a 400
    and the ranks still serving; the engine counts the images it encoded."""
    import base64

    from tests.serving.test_images_serving import body, png
    srv, grpc_url, metrics_url = multirank
    urls = [None, "data:image/png;base64," + base64.b64encode(png(90, 60, 5)).decode()]

    def answers(url: str) -> list[tuple]:
        out = []
        with GrpcClient(url) as client:
            for image_url in urls:
                b = body("chat.completions", False, **({"image_url": image_url} if image_url else {}))
                o = list(client.stream(api_inputs("chat.completions", {**b, "temperature": 0})))
                assert len(o) == 1 and o[0]["status"] == 200, o
                out.append((json.loads(o[0]["response"][0])["choices"][0]["message"].get("content"),
                            o[0]["num_input_tokens"], o[0]["num_output_tokens"]))
        return out

    got = answers(grpc_url)
    assert got == answers(server.grpc_url) and all(n > 20 for _, n, _ in got)
    with GrpcClient(grpc_url) as client:
        bad = body("chat.completions", False, image_url="data:image/png;base64," + base64.b64encode(b"no").decode())
        o = list(client.stream(api_inputs("chat.completions", bad)))
    assert o[0]["status"] == 400, o
    assert answers(grpc_url) == got
    deadline, encoded = time.monotonic() + 10, []
    while time.monotonic() < deadline and not (encoded and encoded[0] >= 4):     # published once a second
        time.sleep(0.5)
        encoded = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(metrics_url).text.splitlines()
                   if line.startswith("deepinfer_images_encoded_total{")]
    assert encoded and encoded[0] >= 4, encoded                   # 2 image requests in each of 2 rounds


def test_stopping_the_server_leaves_no_rank_worker(multirank):
    """Last in the module: it stops the module's server."""
    srv = multirank[0]
    workers = _rank_workers(srv.proc.pid)
    assert len(workers) == RANKS
    srv.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
        time.sleep(0.5)
    alive = [p for p in workers if os.path.exists(f"/proc/{p}")
             and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"rank workers left after tritonserver stopped: {alive}"
    assert srv.proc.returncode is not None
