"""The step-time profile kept across engine starts (EngineArgs.spec_step_time_cache,
spec/step_time_cache.py), through the real engine on the tiny model: a second start with the same
arguments reads the first one's measured times back (a fresh profile would measure other floats), another
argument profiles afresh into its own file, a damaged file is profiled over and rewritten, and the cache
goes only with the scheduler policy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from deepinfer import EngineArgs
from deepinfer.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cached_args(tiny_engine_args, tmp_path):
    return {**tiny_engine_args, "max_num_batched_tokens": 128, "speculative": "dspark", "spec_policy": "scheduler",
            "spec_step_time_cache": str(tmp_path / "step_times")}


def _start(args) -> tuple:
    """An engine start: its step-time model, then the cache folder's files (name, text)."""
    engine = Engine(EngineArgs(**args))
    model = engine.step_time_model
    engine.shutdown()
    return model, [(p.name, p.read_text()) for p in _files(args)]


def _files(args) -> list[Path]:
    folder = Path(args["spec_step_time_cache"])
    return sorted(folder.glob("step_time-*.json")) if folder.is_dir() else []


def test_a_restart_reads_the_profile_back(cached_args):
    first, files = _start(cached_args)
    assert first is not None and len(files) == 1
    saved = json.loads(files[0][1])
    assert saved["model"]["seconds"] == first.seconds and saved["fingerprint"]["engine_args"]["max_num_seqs"] == "8"
    again, files_again = _start(cached_args)
    assert again == first and files_again == files            # the same measured floats, the file untouched


def test_another_argument_profiles_afresh(cached_args):
    first, _ = _start(cached_args)
    other, files = _start({**cached_args, "max_num_seqs": 4})
    assert len(files) == 2 and other.batch_sizes != first.batch_sizes
    # the cache sizing is not part of the fingerprint: only which sizes fit depends on it
    bigger, files_after = _start({**cached_args, "num_cache_blocks": 96})
    assert bigger == first and len(files_after) == 2


def test_a_damaged_file_is_profiled_over(cached_args, caplog):
    first, _ = _start(cached_args)
    path = _files(cached_args)[0]
    for damage in ("{not json", json.dumps({"fingerprint": json.loads(path.read_text())["fingerprint"],
                                            "model": {"batch_sizes": [4, 1], "drafts_per_seq": [0, 5],
                                                      "seconds": [[1.0, 2.0], [1.0, 2.0]], "plain_seconds": None}})):
        path.write_text(damage)
        with caplog.at_level(logging.WARNING, logger="deepinfer.spec.step_time_cache"):
            model, files = _start(cached_args)
        assert "unreadable" in caplog.text and model is not None and model != first
        assert json.loads(files[0][1])["model"]["seconds"] == model.seconds          # rewritten
        caplog.clear()


def test_the_cache_needs_the_scheduler(cached_args):
    with pytest.raises(ValueError, match="spec_step_time_cache needs spec_policy='scheduler'"):
        EngineArgs(**{**cached_args, "spec_policy": "threshold"})
