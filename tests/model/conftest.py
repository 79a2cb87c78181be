"""Shared builders for the model tests: fixture checkpoints built into a temp folder (never the repo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("DEEPINFER_SHARED", REPO / ".." / "shared")).resolve()
FIXTURES = SHARED / "fixtures"


def _need_shared():
    if not (FIXTURES / "v41-tiny" / "recipe.json").is_file():
        pytest.skip(f"shared fixtures not found at {FIXTURES} (set DEEPINFER_SHARED to the shared folder)")


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """fixture_dir(name) -> built checkpoint folder (make-fixture, checksums verified)."""
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        _need_shared()
        if name not in built:
            out = tmp_path_factory.mktemp("fixtures") / name
            subprocess.run([sys.executable, str(SHARED / "tools" / "make-fixture"), "--from-fixture",
                            str(FIXTURES / name), "--out", str(out)], check=True, capture_output=True)
            built[name] = out
        return built[name]

    return build


@pytest.fixture(scope="session")
def bf16_model(fixture_dir):
    from deepinfer.model.loader import load_model
    torch.set_num_threads(1)
    return load_model(fixture_dir("v41-tiny-bf16"), progress=False)


def _logit_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row: max |got - ref| over ref's top-512 ids, in units of ref's logit std (check-parity's err)."""
    top = ref.topk(512, dim=-1).indices
    return (got.gather(-1, top) - ref.gather(-1, top)).abs().amax(-1) / ref.std(-1)


@pytest.fixture(scope="session")
def logit_err():
    return _logit_err


@pytest.fixture(scope="session")
def shared_dir():
    _need_shared()
    return SHARED
