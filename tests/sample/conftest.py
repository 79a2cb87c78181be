"""Shared builders for sampler / structured-output tests: the V4 tokenizer from a fixture checkpoint
built into a temp dir (session-scoped), a StructuredOutput on it, and a constrained generator over
random logits (a stand-in for a random-weight model)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from deepinfer.sample import Sampler, SamplingRow, StructuredOutput
from deepinfer.sampling_params import OutputConstraint, SamplingParams

SHARED = Path("/work/shared")
VOCAB = 129_280


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


def generate_random(sampler: Sampler, constraint: OutputConstraint, seeds: list[int], max_tokens=200,
                    temperature=1.0, logit_seed=0) -> list[list[int]]:
    """Batched constrained generation over random logits; stops at EOS (1). Returns token ids (no EOS)."""
    g = torch.Generator().manual_seed(logit_seed)
    states = [sampler.new_state(SamplingParams(seed=s, temperature=temperature, constraint=constraint,
                                               max_tokens=max_tokens)) for s in seeds]
    outs: list[list[int]] = [[] for _ in seeds]
    live = list(range(len(seeds)))
    for step in range(max_tokens):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=g)
        rows = [SamplingRow(states[i], outs[i], 100 + step) for i in live]
        toks = sampler.sample(logits, rows).token_ids.tolist()
        still = []
        for i, t in zip(live, toks):
            if t == 1:
                continue
            outs[i].append(t)
            still.append(i)
        live = still
    assert not live, f"{len(live)} generations did not finish in {max_tokens} tokens"
    return outs
