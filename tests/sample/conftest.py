"""Shared builders for sampler / structured-output tests: the V4 tokenizer from a fixture checkpoint
built into a temp dir (session-scoped), a StructuredOutput on it, and a constrained generator over
random logits (a stand-in for a random-weight model)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deepinfer.sample import Sampler, StructuredOutput
from sample_utils import VOCAB

SHARED = Path("/work/shared")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    subprocess.run([str(SHARED / "tools/make-fixture"), "--from-fixture", str(SHARED / "fixtures/v41-tiny-bf16"),
                    "--out", str(out)], check=True, capture_output=True)
    return out


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
