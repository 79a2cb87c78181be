"""Shared builders for sampler / structured-output tests: the v41-tiny-bf16 fixture's V4.1 tokenizer
(tests/conftest.py builds it once per session), a StructuredOutput on it, and a constrained generator over
random logits (a stand-in for a random-weight model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.sample import Sampler, StructuredOutput
from sample_utils import VOCAB


@pytest.fixture(scope="session")
def checkpoint_dir(fixture_checkpoint) -> Path:
    """The v41-tiny-bf16 fixture: the generation-length budgets of these tests were set on it."""
    return fixture_checkpoint


@pytest.fixture(scope="session")
def tokenizer_path(checkpoint_dir) -> str:
    return str(checkpoint_dir / "tokenizer.json")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_path):
    import tokenizers
    return tokenizers.Tokenizer.from_file(tokenizer_path)


@pytest.fixture(scope="session")
def structured(tokenizer_path) -> StructuredOutput:
    return StructuredOutput.from_tokenizer_file(tokenizer_path, VOCAB)


@pytest.fixture(scope="session")
def sampler(structured) -> Sampler:
    return Sampler(VOCAB, structured=structured)
