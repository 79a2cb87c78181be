"""Engram hash ids of every fixture prompt equal the recorded ones; the compressed vocabulary of the
real tokenizer is 99,092; hashing a prompt in chunks (history passed in) gives the same ids."""

from __future__ import annotations

import json

import numpy as np
import torch

from deepinfer.checkpoint.tokenizer import v4_tokenizer_json
from deepinfer.model.engram import _build_token_map


def test_compressed_vocab_of_real_tokenizer(tmp_path):
    from deepinfer.checkpoint.tokenizer import write_tokenizer
    _, n = _build_token_map(str(v4_tokenizer_json()))
    assert n == 99092
    _, n41 = _build_token_map(str(write_tokenizer(tmp_path / "tokenizer.json")))
    assert n41 == 99092


def _hash(model, ids, chunk):
    out = []
    for s in range(0, len(ids), chunk):
        new = ids[s:s + chunk]
        hist = ([-1, -1, -1] + ids[:s])[-3:]
        out.append(model.hasher(torch.tensor(new), torch.tensor([0, len(new)]), torch.tensor([hist])))
    return torch.cat(out).numpy()


def test_hash_ids_match_fixture(fixture_dir, bf16_model):
    for name in ("v41-tiny", "v41-tiny-bf16"):
        fx = fixture_dir(name)
        exp = np.load(fx / "expected.npz")
        prompts = json.load(open(fx / "prompts.json"))["prompts"]
        for i, p in enumerate(prompts):
            want = exp[f"p{i}_engram_hash_ids"]
            assert np.array_equal(_hash(bf16_model, p["ids"], len(p["ids"])), want), (name, i)
            assert np.array_equal(_hash(bf16_model, p["ids"], 5), want), (name, i, "chunked")


def test_dead_tokens_block_lookback(bf16_model):
    ids = torch.tensor([10, 20, 30, 40, 50])
    mask = torch.tensor([True, True, False, True, True])
    h = bf16_model.hasher(ids, torch.tensor([0, 5]), torch.tensor([[-1, -1, -1]]), mask)
    plain = bf16_model.hasher(ids, torch.tensor([0, 5]), torch.tensor([[-1, -1, -1]]))
    assert torch.equal(h[:2], plain[:2])                 # before the dead token: unchanged
    assert not torch.equal(h[3], plain[3])               # its look-back stops at the dead token
    # position 3 looks back only to itself: same as a sequence starting at position 3
    alone = bf16_model.hasher(ids[3:4], torch.tensor([0, 1]), torch.tensor([[-1, -1, -1]]))
    assert torch.equal(h[3], alone[0])
