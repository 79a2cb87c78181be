"""Model-test helpers: the bf16 fixture model and check-parity's err (fixture builders live in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


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
def tiny_vision_model(tiny_checkpoint):
    """The tiny preset (it has a vision_config: a 2-layer, 64-wide tower), loaded on the CPU."""
    from deepinfer.model.loader import load_model
    return load_model(tiny_checkpoint, progress=False)
