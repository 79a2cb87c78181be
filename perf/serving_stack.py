"""A tiny-preset tritonserver + HTTP gateway for the perf scripts that drive the gateway
(bad_inputs.py, soak.py, aiperf_gateway.py): a fresh checkpoint, the server on free ports, the
gateway once its /health answers 200; everything stopped on exit."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Stack:
    tmp: Path
    checkpoint: Path
    server: object            # deepinfer.ensemble.serve.TritonServer
    http_url: str             # Triton's own HTTP port
    metrics_url: str
    gateway_url: str


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@contextmanager
def tiny_serving_stack(prefix: str, max_model_len: int, engine_args: dict, gateway_args: tuple[str, ...] = ()):
    from deepinfer.ensemble import serve
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    ckpt = tmp / "ckpt"
    subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", "tiny", "--seed", "0",
                    "--out", str(ckpt)], check=True)
    repo = serve.runtime_repository(tmp / "repo", str(ckpt), max_model_len, engine_args)
    ports = serve.free_ports(4)
    with serve.TritonServer(repo, *ports[:3], log_path=tmp / "triton.log") as srv:
        gw = subprocess.Popen([sys.executable, "-m", "deepinfer.ensemble.gateway", "--triton-grpc",
                               f"127.0.0.1:{ports[1]}", "--host", "127.0.0.1", "--port", str(ports[3]), *gateway_args],
                              stdout=open(tmp / "gateway.log", "wb"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{ports[3]}"
            wait_healthy(url + "/health")
            yield Stack(tmp, ckpt, srv, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}/metrics", url)
        finally:
            gw.terminate()
            gw.wait(15)
