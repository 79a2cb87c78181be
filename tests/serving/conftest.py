"""One real tritonserver (from the nvidia-pytriton wheel) per session, on free ports, serving the
runtime copy of model_repository/ with a tiny checkpoint; always stopped at the end."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port, free_ports  # noqa: F401


MAX_MODEL_LEN = 2048


def _has_batch_invariant_mode() -> bool:
    import dataclasses
    from deepinfer import EngineArgs
    return "batch_invariant" in {f.name for f in dataclasses.fields(EngineArgs)}


BATCH_INVARIANT = _has_batch_invariant_mode()
ENGINE_ARGS = {"max_num_seqs": 40, **({"batch_invariant": True} if BATCH_INVARIANT else {})}


@dataclass
class Server:
    http_url: str
    grpc_url: str
    metrics_url: str
    log: Path
    checkpoint: Path


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="session")
def server(tmp_path_factory, checkpoint):
    from deepinfer.ensemble import serve
    tmp = tmp_path_factory.mktemp("triton")
    repo = serve.runtime_repository(tmp / "model_repository", str(checkpoint), MAX_MODEL_LEN, ENGINE_ARGS)
    ports = free_ports(3)
    log = tmp / "tritonserver.log"
    srv = serve.TritonServer(repo, *ports, log_path=log)
    srv.start(timeout=240)
    try:
        yield Server(f"http://127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", f"http://127.0.0.1:{ports[2]}/metrics",
                     log, checkpoint)
    finally:
        srv.stop()


@contextlib.contextmanager
def serve_router(rs, **runner_kw):
    """A RouterServer's app on a free local port, on its own event-loop thread; yields its URL once
    /health answers 200 (or after 30 s), and cleans the app up on exit."""
    import httpx
    from aiohttp import web
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(rs.app(), **runner_kw)

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()
    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
