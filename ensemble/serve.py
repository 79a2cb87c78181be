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
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deepinfer.ports import free_port, free_ports  # noqa: F401  (servers' ports: tests, perf)

from . import config
from . import contract as c

STATE_DIR = config.REPO_ROOT / ".triton"
DEAD_STUB_GRACE_S = 5.0   # how long a server with a dead stub is given to stop before SIGKILL


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
                       limits: dict | None = None, preprocess_params: dict[str, str] | None = None) -> Path:
    """limits: deepinfer.recipe.validation.Limits fields for the preprocess (request size, max_tokens
    cap and default, ...); preprocess_params: more recipe_preprocess parameters (allow_image_urls,
    max_images_per_request)."""
    args = {"max_model_len": max_model_len, **(engine_args or {})}
    ckpt = str(Path(checkpoint).resolve())
    params = {c.PREPROCESS: {"checkpoint": ckpt, "max_model_len": str(args["max_model_len"]),
                             "limits": json.dumps(limits or {}), **(preprocess_params or {})},
              c.ENGINE: {"checkpoint": ckpt, "engine_args": json.dumps(args)},
              c.POSTPROCESS: {"checkpoint": ckpt}}
    if dest.exists():
        shutil.rmtree(dest)
    return config.build_runtime_repository(dest, params, execution_env=sys.prefix)


class TritonServer:
    """One tritonserver process; a context manager that always stops it."""

    def __init__(self, repo: Path, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 log_path: Path | None = None, extra_args: list[str] | None = None):
        self.repo, self.log_path = Path(repo), log_path
        if len({http_port, grpc_port, metrics_port}) != 3:
            raise ValueError(f"tritonserver needs three distinct ports (HTTP, gRPC, metrics); got {http_port}, "
                             f"{grpc_port}, {metrics_port}")
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self.shm_regions: set[str] = set()
        self._seen_stubs: set[str] = set()

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
                        self.stub_pids()
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
        """SIGINT (Triton's graceful stop), SIGKILL after timeout; then no stub and no /dev/shm region
        of this server is left. NOTE: a server whose stub died (kill -9, OOM) waits its whole
        --exit-timeout-secs (30 s) for requests that dead stub will never finish, and exits 1;
        Triton 2.51 neither restarts a Python stub nor fails its requests, so stop it after
        DEAD_STUB_GRACE_S instead."""
        if self.proc is None:
            return
        stubs = self.stub_pids()   # also records the regions of the stubs still alive
        if self.proc.poll() is None:
            if self.dead_stubs:
                timeout = min(timeout, DEAD_STUB_GRACE_S)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in stubs.values():   # a stub outliving its server (killed above) would hold its memory
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        remove_shm_regions(self.shm_regions)

    @property
    def dead_stubs(self) -> set[str]:
        """Stubs seen alive before that are gone now (their server still running)."""
        alive = set(self.stub_pids()) if self.proc is not None and self.proc.poll() is None else set()
        return {k for k in self._seen_stubs if k not in alive}

    def stub_pids(self) -> dict[str, int]:
        """The Python backend stubs; also records their /dev/shm regions (removed at stop if left)."""
        stubs = stub_pids(self.proc.pid) if self.proc is not None else {}
        for pid in stubs.values():
            self.shm_regions |= _shm_regions(pid)
        self._seen_stubs |= set(stubs)
        return stubs

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- the Python backend's stub processes and their shared memory --------------------------------------------
STUB = "triton_python_backend_stub"
SHM_PREFIX = "triton_python_backend_shm_region"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def stub_pids(server_pid: int) -> dict[str, int]:
    """{model instance folder's model name: stub pid} of one tritonserver's Python backend stubs."""
    stubs = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        args = _cmdline(int(entry.name))
        if ppid == server_pid and args and args[0].endswith(STUB):
            model = Path(args[1]).parent.parent.name   # <repo>/<model>/1/model.py
            stubs[f"{model}:{entry.name}"] = int(entry.name)
    return stubs


def _shm_regions(pid: int) -> set[str]:
    return {a for a in _cmdline(pid) if a.startswith(SHM_PREFIX)}


def remove_shm_regions(names: set[str]) -> list[str]:
    """NOTE: a stub killed with SIGKILL cannot unlink its /dev/shm region, and tritonserver does not
    either; remove the ones of this server's stubs (named in their command lines) after it exits."""
    removed = []
    for name in names:
        path = Path("/dev/shm") / name
        if path.exists():
            path.unlink(missing_ok=True)
            removed.append(name)
    return removed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve DeepSeek-V4.1-Flash from tritonserver (the nvidia-pytriton wheel).")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--engine-args", default="{}", help="JSON of deepinfer.EngineArgs fields")
    ap.add_argument("--limits", default="{}",
                    help='JSON of request limits, e.g. {"max_request_bytes": 4194304, "max_tokens_cap": 4096, '
                         '"default_max_tokens": 1024} (deepinfer.recipe.validation.Limits)')
    ap.add_argument("--allow-image-urls", action="store_true",
                    help="fetch http(s) image URLs (public addresses only); off: data URLs / base64 only")
    ap.add_argument("--gateway-port", type=int, default=0,
                    help="also start the OpenAI/Anthropic HTTP gateway (ensemble/gateway.py) on this port")
    args = ap.parse_args(argv)
    repo = runtime_repository(STATE_DIR / "model_repository", args.checkpoint, args.max_model_len,
                              json.loads(args.engine_args), json.loads(args.limits),
                              {"allow_image_urls": "true"} if args.allow_image_urls else None)
    server = TritonServer(repo, args.http_port, args.grpc_port, args.metrics_port)
    print(" ".join(server.command()), flush=True)
    server.proc = subprocess.Popen(server.command(), env=server_env())
    # SIGTERM stops like Ctrl-C: through server.stop() (graceful, bounded when a stub died)
    signal.signal(signal.SIGTERM, _interrupt)
    gateway = start_gateway(args.gateway_port, f"127.0.0.1:{args.grpc_port}") if args.gateway_port else None
    try:
        while server.proc.poll() is None:
            server.stub_pids()   # records the stubs' /dev/shm regions, removed at exit if a stub could not
            time.sleep(2)
        return server.proc.returncode
    except KeyboardInterrupt:
        server.stop()
        return 0
    finally:
        remove_shm_regions(server.shm_regions)
        if gateway is not None:
            gateway.terminate()
            gateway.wait(15)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def start_gateway(port: int, triton_grpc: str) -> subprocess.Popen:
    """The HTTP gateway beside tritonserver (its /health says ready once the ensemble is)."""
    cmd = [sys.executable, "-m", "deepinfer.ensemble.gateway", "--triton-grpc", triton_grpc, "--port", str(port)]
    print(" ".join(cmd), flush=True)
    return subprocess.Popen(cmd)


if __name__ == "__main__":
    sys.exit(main())
