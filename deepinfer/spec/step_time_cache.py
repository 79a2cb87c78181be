"""The step-time profile kept across engine starts (EngineArgs.spec_step_time_cache: a folder).

The scheduler's profile (spec/step_time.py) runs at every start: at the release's 40 layers on the H200
the engine came up in 26-48 s with it (2026-12-03), most of it the profile. A restart on the same device
with the same code, checkpoint config and engine arguments measures the same thing, so the model is saved
under a fingerprint of all of them and read back instead. Anything that can move a step's time changes
the fingerprint and profiles afresh: another GPU, torch / Triton / CUDA version, any edit to the engine's
or the kernels' Python sources (hashed), the checkpoint's config.json, any engine argument (except the
cache-size knobs, which only decide which batch sizes fit, and the cache folder itself). A file that
cannot be read or does not match is ignored and rewritten; a failed write is logged, never raised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from deepinfer.spec.step_time import StepTimeModel

logger = logging.getLogger(__name__)

FORMAT = 1
# engine arguments that cannot change a step's time: the cache's own folder, and the cache sizing (it
# only decides which batch sizes the profile can run; free memory moves it from start to start)
_NOT_TIMING = {"spec_step_time_cache", "num_cache_blocks", "cache_memory_fraction", "checkpoint"}


def fingerprint(engine, plain: bool) -> dict:
    """Everything the profiled times depend on, as JSON-able values."""
    a = engine.args
    return {
        "format": FORMAT,
        "plain": plain,
        "device": _device(engine.device),
        "versions": _versions(),
        "sources": _sources_digest(),
        "model_config": _file_digest(Path(a.checkpoint) / "config.json") if a.checkpoint else None,
        "engine_args": {f.name: repr(getattr(a, f.name)) for f in dataclasses.fields(a) if f.name not in _NOT_TIMING},
    }


def load(folder: str, fp: dict) -> StepTimeModel | None:
    """The saved model of this fingerprint, or None (no file, unreadable, or another fingerprint)."""
    path = _path(folder, fp)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("fingerprint") != fp:
            logger.info("step-time cache %s: written for another fingerprint; profiling afresh", path)
            return None
        m = data["model"]
        model = StepTimeModel([int(n) for n in m["batch_sizes"]], [int(x) for x in m["drafts_per_seq"]],
                              [[float(t) for t in row] for row in m["seconds"]],
                              None if m["plain_seconds"] is None else [float(t) for t in m["plain_seconds"]])
        _check(model)
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("step-time cache %s unreadable (%s); profiling afresh", path, e)
        return None
    logger.info("step-time profile read from %s (batch sizes %s x drafts %s)", path, model.batch_sizes,
                model.drafts_per_seq)
    return model


def save(folder: str, fp: dict, model: StepTimeModel) -> None:
    """Write atomically (a reader never sees half a file); failures are logged."""
    path = _path(folder, fp)
    data = {"fingerprint": fp, "model": {"batch_sizes": model.batch_sizes, "drafts_per_seq": model.drafts_per_seq,
                                         "seconds": model.seconds, "plain_seconds": model.plain_seconds}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("step-time cache: could not write %s (%s)", path, e)
        return
    logger.info("step-time profile saved to %s", path)


def _check(model: StepTimeModel) -> None:
    """A saved model must be one the budget can use: ascending grids, one positive time per point."""
    n, x = model.batch_sizes, model.drafts_per_seq
    if not n or not x or n != sorted(set(n)) or x != sorted(set(x)) or min(n) < 1 or min(x) < 0:
        raise ValueError(f"bad grid {n} x {x}")
    rows = model.seconds + ([model.plain_seconds] if model.plain_seconds is not None else [])
    if len(model.seconds) != len(n) or any(len(r) != len(x) for r in model.seconds) or \
            (model.plain_seconds is not None and len(model.plain_seconds) != len(n)) or \
            not all(t > 0 for r in rows for t in r):
        raise ValueError("times do not match the grid or are not positive")


def _path(folder: str, fp: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:24]
    return Path(folder).expanduser() / f"step_time-{digest}.json"


def _device(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"type": device}
    idx = torch.device(device).index or 0
    return {"type": "cuda", "name": torch.cuda.get_device_name(idx),
            "capability": list(torch.cuda.get_device_capability(idx)), "count": torch.cuda.device_count()}


def _versions() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}


def _sources_digest() -> str:
    """sha256 over the engine's and the kernels' Python sources (paths and bytes)."""
    import deepinfer
    import deepinfer.kernels
    h = hashlib.sha256()
    for root in sorted({Path(deepinfer.__file__).resolve().parent, Path(deepinfer.kernels.__file__).resolve().parent}):
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root.parent)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _file_digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
