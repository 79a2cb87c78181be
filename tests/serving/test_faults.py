"""Faults survived: kill -9 of the engine's Python backend stub while streams run (every stream ends
with the API's error event and its end marker within seconds; the gateway's health turns 503; the
server then stops and leaves no /dev/shm region behind). Its own tritonserver: the session's one must
not lose its engine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import ENGINE_ARGS, MAX_MODEL_LEN, free_ports
from tests.serving.test_gateway import MODEL, USER, start_gateway, stop_gateway

pytestmark = pytest.mark.triton

N_STREAMS = 4


@pytest.fixture
def own_server(tmp_path, checkpoint):
    from deepinfer.ensemble import serve
    repo = serve.runtime_repository(tmp_path / "repo", str(checkpoint), MAX_MODEL_LEN, ENGINE_ARGS)
    srv = serve.TritonServer(repo, *free_ports(3), log_path=tmp_path / "triton.log")
    srv.start(timeout=300)
    try:
        yield srv
    finally:
        srv.stop()


def _stream(url: str, api: str, out: dict, i: int) -> None:
    path, body = (("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1500, "stream": True,
                                            "thinking": {"type": "disabled"}}) if api == "chat" else
                  ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 1500, "stream": True,
                                    "thinking": {"type": "disabled"}}))
    lines = []
    try:
        with httpx.stream("POST", url + path, json=body, timeout=httpx.Timeout(60, read=30)) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):   # streaming has begun (headers and a first chunk sent)
                    out[f"started-{i}"].set()
        out[i] = (api, lines, time.monotonic())
    except httpx.HTTPError as e:
        out[i] = (api, lines + [f"CLIENT ERROR {e!r}"], time.monotonic())


def test_kill_engine_stub_during_streams(own_server, tmp_path):
    proc, url = start_gateway(f"127.0.0.1:{own_server.grpc_port}", tmp_path / "gw.log", "--probe-period", "0.5")
    try:
        out: dict = {f"started-{i}": threading.Event() for i in range(N_STREAMS)}
        threads = [threading.Thread(target=_stream, args=(url, "chat" if i % 2 == 0 else "messages", out, i))
                   for i in range(N_STREAMS)]
        for t in threads:
            t.start()
        assert all(out[f"started-{i}"].wait(120) for i in range(N_STREAMS))
        engine = {k: pid for k, pid in own_server.stub_pids().items() if k.startswith("deepinfer:")}
        assert len(engine) == 1
        regions = {r for pid in own_server.stub_pids().values() for r in _regions(pid)}
        killed_at = time.monotonic()
        os.kill(next(iter(engine.values())), signal.SIGKILL)
        for t in threads:
            t.join(60)
        for i in range(N_STREAMS):
            api, lines, ended = out[i]
            lines = [line for line in lines if line]
            assert ended - killed_at < 15, f"stream {i} ended {ended - killed_at:.1f} s after the kill"
            data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            if api == "chat":
                assert lines[-1] == "data: [DONE]" and "error" in data[-1], (i, lines[-4:])
            else:
                assert data[-1]["type"] == "error" and "event: error" in lines, lines[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(f"{url}/health").status_code == 503
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2},
                       timeout=30)
        assert r.status_code >= 500 and "error" in r.json() and time.monotonic() - t0 < 10
        assert 'deepinfer_gateway_engine_alive 0' in httpx.get(f"{url}/metrics").text
    finally:
        stop_gateway(proc)
        print(*[line for line in (tmp_path / "gw.log").read_text().splitlines() if "engine model" in line], sep="\n")
    stubs = own_server.stub_pids()
    t0 = time.monotonic()
    own_server.stop(timeout=60)
    took = time.monotonic() - t0
    print(f"tritonserver stopped {took:.1f} s after SIGINT, exit code {own_server.proc.returncode}")
    assert took < 15 and own_server.proc.poll() is not None
    deadline = time.monotonic() + 5
    while [pid for pid in stubs.values() if _running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in stubs.values() if _running(pid)], "stubs outlived the server"
    assert not [r for r in regions if (Path("/dev/shm") / r).exists()], "the stubs' /dev/shm regions were left behind"


def _regions(pid: int) -> set[str]:
    from deepinfer.ensemble.serve import _shm_regions
    return _shm_regions(pid)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
