"""Serve the model repository with tritonserver from the nvidia-pytriton wheel (Triton 2.51).

    python -m deepinfer.ensemble.serve --checkpoint DIR [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
                                       [--gateway-port 9000]   # also the OpenAI/Anthropic HTTP gateway

What it sets up (TRITON.md section 5.3): the Python backend with the stub built for this Python,
a runtime copy of model_repository/ whose configs carry the checkpoint, the engine arguments and
EXECUTION_ENV_PATH = this virtual environment (the committed configs stay portable), and the
library links perf_analyzer from the tritonclient wheel needs. Everything lives under .triton/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import config
from . import contract as c

STATE_DIR = config.REPO_ROOT / ".triton"


def pytriton_root() -> Path:
    import pytriton  # the nvidia-pytriton wheel bundles tritonserver 2.51
    return Path(pytriton.__file__).resolve().parent


def prepare_backend(state_dir: Path = STATE_DIR) -> Path:
    """A backends/ folder whose python backend has the stub for this interpreter's version."""
    src = pytriton_root() / "tritonserver"
    backends = state_dir / "backends"
    dest = backends / "python"
    stub = src / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    if not (dest / "triton_python_backend_stub").is_file():
        shutil.copytree(src / "backends" / "python", dest, dirs_exist_ok=True)
        shutil.copy2(stub, dest / "triton_python_backend_stub")
    return backends


def library_dir(state_dir: Path = STATE_DIR) -> Path:
    """libb64.so.0d and libcudart.so.12 for perf_analyzer, linked from the pytriton wheel's libs."""
    libs = pytriton_root().parent / "nvidia_pytriton.libs"
    out = state_dir / "lib"
    out.mkdir(parents=True, exist_ok=True)
    for name, prefix in (("libb64.so.0d", "libb64-"), ("libcudart.so.12", "libcudart-")):
        target = next(libs.glob(prefix + "*"))
        link = out / name
        if not link.exists():
            link.symlink_to(target)
    return out


def server_env() -> dict:
    """The copied stub finds the wheel's bundled libraries (its RPATH pointed next to them) and the
    libpython of the venv's own interpreter: with a pyenv Python, the system libpython3.x would be
    found first and the venv's extension modules (_ssl...) fail on missing symbols."""
    import sysconfig
    env = dict(os.environ)
    paths = [str(pytriton_root().parent / "nvidia_pytriton.libs")]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and Path(libdir, f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0").exists():
        paths.append(libdir)
    env["LD_LIBRARY_PATH"] = ":".join(paths + [env.get("LD_LIBRARY_PATH", "")])
    return env


def perf_analyzer_env() -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{library_dir()}:{env.get('LD_LIBRARY_PATH', '')}"
    return env


def perf_analyzer_bin() -> str:
    return str(Path(sys.prefix) / "bin" / "perf_analyzer")


def runtime_repository(dest: Path, checkpoint: str, max_model_len: int, engine_args: dict | None = None,
                       preprocess_params: dict[str, str] | None = None) -> Path:
    """preprocess_params: more recipe_preprocess parameters (allow_image_urls, max_images_per_request)."""
    args = {"max_model_len": max_model_len, **(engine_args or {})}
    ckpt = str(Path(checkpoint).resolve())
    params = {c.PREPROCESS: {"checkpoint": ckpt, "max_model_len": str(args["max_model_len"]), **(preprocess_params or {})},
              c.ENGINE: {"checkpoint": ckpt, "engine_args": json.dumps(args)},
              c.POSTPROCESS: {"checkpoint": ckpt}}
    if dest.exists():
        shutil.rmtree(dest)
    return config.build_runtime_repository(dest, params, execution_env=sys.prefix)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """One tritonserver process; a context manager that always stops it."""

    def __init__(self, repo: Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 log_path: Path | None = None, extra_args: list[str] | None = None):
        self.repo, self.log_path = Path(repo), log_path
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        binary = pytriton_root() / "tritonserver" / "bin" / "tritonserver"
        return [str(binary), f"--model-repository={self.repo}", f"--backend-directory={prepare_backend()}",
                "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
                *self.extra_args]

    def start(self, timeout: float = 180.0) -> "TritonServer":
        log = open(self.log_path, "wb") if self.log_path else None
        self.proc = subprocess.Popen(self.command(), env=server_env(), stdout=log or None,
                                     stderr=subprocess.STDOUT if log else None)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout}s (log: {self.log_path})")

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return "(no log)"
        return Path(self.log_path).read_bytes()[-n:].decode("utf-8", "replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve DeepSeek-V4.1-Flash from tritonserver (the nvidia-pytriton wheel).")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--engine-args", default="{}", help="JSON of deepinfer.EngineArgs fields")
    ap.add_argument("--allow-image-urls", action="store_true",
                    help="fetch http(s) image URLs (public addresses only); off: data URLs / base64 only")
    ap.add_argument("--gateway-port", type=int, default=0,
                    help="also start the OpenAI/Anthropic HTTP gateway (ensemble/gateway.py) on this port")
    args = ap.parse_args(argv)
    repo = runtime_repository(STATE_DIR / "model_repository", args.checkpoint, args.max_model_len,
                              json.loads(args.engine_args),
                              {"allow_image_urls": "true"} if args.allow_image_urls else None)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port)
    print(" ".join(server.command()), flush=True)
    server.proc = subprocess.Popen(server.command(), env=server_env())
    # forward SIGTERM as SIGINT (tritonserver's graceful stop); the wait below then returns
    signal.signal(signal.SIGTERM, lambda *_: server.proc.send_signal(signal.SIGINT))
    gateway = start_gateway(args.gateway_port, f"127.0.0.1:{args.grpc_port}") if args.gateway_port else None
    try:
        return server.proc.wait()
    except KeyboardInterrupt:
        server.stop()
        return 0
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(15)


def start_gateway(port: int, triton_grpc: str) -> subprocess.Popen:
    """The HTTP gateway beside tritonserver (its /health says ready once the ensemble is)."""
    cmd = [sys.executable, "-m", "deepinfer.ensemble.gateway", "--triton-grpc", triton_grpc, "--port", str(port)]
    print(" ".join(cmd), flush=True)
    return subprocess.Popen(cmd)


if __name__ == "__main__":
    sys.exit(main())
