"""Launch a topology on one machine: N Triton replicas (each tritonserver + its gateway), and the
router in front of them (ensemble/router_server.py).

    python -m deepinfer.ensemble.replicas --checkpoint checkpoints/tiny --replicas 2 --port 8080
    python -m deepinfer.ensemble.replicas --checkpoint DIR --replicas 4 --devices 0,1 2,3 4,5 6,7 \
        --engine-args '{"data_parallel_size": 2}'

Prefill/decode disaggregation: `--roles prefill decode` (one role per replica) starts replica 0 with
kv_role="prefill" and replica 1 with kv_role="decode"; the router then sends each request to a
prefill replica and on to a decode one (router_server.py). On one GPU, two replicas can share it
with a cache memory fraction each (--engine-args '{"cache_memory_fraction": 0.4}' --devices 0 0: the
second replica takes 0.4 of the memory the first left free).

Replica i serves Triton on ports base + 10 i (HTTP, gRPC, metrics) and its gateway on
gateway_base + i; with --devices, replica i sees only those GPUs (CUDA_VISIBLE_DEVICES), else
the replicas are CPU processes. Several machines: run this (or `make serve` with a gateway) on each
node and one router_server with every node's replicas (README, "Several replicas").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .serve import STATE_DIR, TritonServer, runtime_repository


class Replica:
    def __init__(self, index: int, checkpoint: str, engine_args: dict, max_model_len: int, ports: tuple[int, int, int],
                 gateway_port: int, devices: str | None = None, state_dir: Path = STATE_DIR) -> None:
        """ports: Triton's HTTP, gRPC and metrics ports."""
        self.index, self.gateway_port = index, gateway_port
        repo = runtime_repository(state_dir / f"replica{index}" / "model_repository", checkpoint, max_model_len,
                                  engine_args)
        self.server = TritonServer(repo, *ports, log_path=state_dir / f"replica{index}" / "triton.log")
        self.devices = devices
        self.gateway: subprocess.Popen | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    def start(self, timeout: float = 300.0) -> None:
        env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.devices   # server_env() copies os.environ
        try:
            self.server.start(timeout)
        finally:
            if self.devices is not None:
                if env_before is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = env_before
        self.gateway = subprocess.Popen([sys.executable, "-m", "deepinfer.ensemble.gateway", "--triton-grpc",
                                         f"127.0.0.1:{self.server.grpc_port}", "--port", str(self.gateway_port)])
        wait_http(f"{self.gateway_url}/health", timeout)

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGINT)
            try:
                self.gateway.wait(15)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()
        self.server.stop()


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def role_engine_args(engine_args: dict, role: str) -> dict:
    """A replica's engine args for its role: a decode replica's prompts come as pulled caches, so the
    prefix cache (enable_prefix_caching) and balanced CP (context_parallel_size) stay with the prefill replicas."""
    if role == "both":
        return engine_args
    out = {**engine_args, "kv_role": role}
    if role == "decode":
        out["enable_prefix_caching"] = False
        out["context_parallel_size"] = 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--devices", nargs="*", help="per replica: its CUDA_VISIBLE_DEVICES, e.g. 0,1 2,3")
    ap.add_argument("--engine-args", default="{}", help="JSON of deepinfer.EngineArgs fields (every replica)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--base-port", type=int, default=8100, help="replica i: Triton on base + 10 i (+1 gRPC, +2 metrics)")
    ap.add_argument("--gateway-base-port", type=int, default=9100)
    ap.add_argument("--port", type=int, default=8080, help="the router")
    ap.add_argument("--policy", default="prefix")
    ap.add_argument("--roles", nargs="*", choices=("both", "prefill", "decode"),
                    help="per replica: its kv_role (default both); prefill ones go behind --prefill-replica")
    args = ap.parse_args(argv)
    if args.devices and len(args.devices) != args.replicas:
        ap.error(f"--devices names {len(args.devices)} replicas, --replicas is {args.replicas}")
    roles = args.roles or ["both"] * args.replicas
    if len(roles) != args.replicas:
        ap.error(f"--roles names {len(roles)} replicas, --replicas is {args.replicas}")
    if ("prefill" in roles) != ("decode" in roles) or ("prefill" in roles and "both" in roles):
        ap.error(f"--roles {roles}: prefill and decode replicas go together, without 'both' ones")
    engine_args = json.loads(args.engine_args)
    base = args.base_port
    replicas = [Replica(i, args.checkpoint, role_engine_args(engine_args, roles[i]), args.max_model_len,
                        (base + 10 * i, base + 10 * i + 1, base + 10 * i + 2), args.gateway_base_port + i,
                        args.devices[i] if args.devices else None)
                for i in range(args.replicas)]
    try:
        for r in replicas:
            r.start()
            print(f"replica {r.index}: gateway {r.gateway_url}, metrics {r.metrics_url}", flush=True)
        from .router_server import main as router_main
        flags = [a for r, role in zip(replicas, roles)
                 for a in ("--prefill-replica" if role == "prefill" else "--replica", f"{r.gateway_url},{r.metrics_url}")]
        return router_main(flags + ["--port", str(args.port), "--policy", args.policy])
    finally:
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    raise SystemExit(main())
