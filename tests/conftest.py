"""Builders every test folder shares: where ../shared is, the shared fixture checkpoints and the
project's own tiny preset, each built once per session into a temp folder (never into the repo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.ports import free_port, free_ports  # noqa: F401  (tests' process groups and servers)

# pytest-xdist (`make test` runs two workers, one per core of a CI machine): one torch thread in each
# worker and in the processes its tests start, so two workers never run four spinning threads
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("DEEPINFER_SHARED", REPO / ".." / "shared")).resolve()
FIXTURES = SHARED / "fixtures"

_built: dict[tuple[str, str], Path] = {}




def graph_replay_matches_eager(fn, static, fresh) -> None:
    """fn(static) captured in a CUDA graph (after an eager warm-up), `fresh` copied into static and the
    graph replayed: the replay's output equals an eager call on the same input (no host read, no stale
    buffer; a capture with a host read raises)."""
    import torch
    fn(static)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(static)
    static.copy_(fresh)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(static))


def captured_graph(fn):
    """(graph, its output): fn captured in a CUDA graph after one eager warm-up on another stream (the
    engine's order: kernels compile and buffers settle outside the capture)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def need_shared() -> Path:
    if not (FIXTURES / "v41-tiny" / "recipe.json").is_file() or not (SHARED / "tools" / "make-fixture").is_file():
        pytest.skip(f"shared fixtures not found at {SHARED} (set DEEPINFER_SHARED to the shared folder)")
    return SHARED


def build_fixture(name: str, tmp_path_factory) -> Path:
    """A shared fixture's checkpoint (make-fixture, checksums verified; about 5 s), once per session."""
    key = ("fixture", name)
    if key not in _built:
        need_shared()
        out = tmp_path_factory.mktemp("fixture") / name
        # run through this interpreter: the tool's shebang python may lack torch
        subprocess.run([sys.executable, str(SHARED / "tools" / "make-fixture"), "--from-fixture",
                        str(FIXTURES / name), "--out", str(out)], check=True, capture_output=True)
        _built[key] = out
    return _built[key]


def build_preset(preset: str, tmp_path_factory, seed: int = 0) -> Path:
    """The project's own random-weight checkpoint (deepinfer-make-checkpoint), once per session."""
    key = ("preset", f"{preset}-{seed}")
    if key not in _built:
        out = tmp_path_factory.mktemp("preset") / f"{preset}-{seed}"
        subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", preset, "--seed", str(seed),
                        "--out", str(out)], check=True, capture_output=True)
        _built[key] = out
    return _built[key]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return need_shared()


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """fixture_dir(name) -> the built checkpoint folder of a shared fixture."""
    return lambda name: build_fixture(name, tmp_path_factory)


@pytest.fixture(scope="session")
def fixture_checkpoint(tmp_path_factory) -> Path:
    """The v41-tiny-bf16 shared fixture's checkpoint."""
    return build_fixture("v41-tiny-bf16", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The project's tiny preset: what `make serve` serves by default."""
    return build_preset("tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory) -> Path:
    """The project's small preset (widths whose GEMMs take the Triton kernels on a GPU)."""
    return build_preset("small", tmp_path_factory)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (use with pytest.mark.usefixtures): the tiny model's ops are too
    small for two threads, and they spin against other processes."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    from deepinfer.model.loader import load_model
    return load_model(tiny_checkpoint, progress=False)
