"""Any chunking of the same tokens (prefill chunks of 1, 7, 64, 130; one-token decode; k-token steps;
several sequences in one batch; rollback of rejected drafts) gives the logits of one whole prefill,
within the bf16 fixture's rule (per-position err below its max_err, median below its median_err,
top-1 agreement at least its min_top1)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.cache.model_caches import ModelCaches
from deepinfer.model.simple import SequenceRunner, make_batch


@pytest.fixture(scope="module")
def check(logit_err):
    def run(got, ref, rule, what):
        err = logit_err(got, ref)
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert err.max() < rule["max_err"], (what, err.max().item())
        assert err.median() < rule["median_err"], (what, err.median().item())
        assert top1 >= rule["min_top1"], (what, top1)
    return run


@pytest.fixture(scope="module")
def rule(fixture_dir):
    return json.load(open(fixture_dir("v41-tiny-bf16") / "pass_rule.json"))


@pytest.fixture(scope="module")
def prompts(fixture_dir):
    return [p["ids"] for p in json.load(open(fixture_dir("v41-tiny-bf16") / "prompts.json"))["prompts"]]


def whole(model, ids):
    return SequenceRunner(model, len(ids) + 8).step(ids, logits="all").logits


def chunked(model, ids, sizes):
    r, out, s, i = SequenceRunner(model, len(ids) + 8), [], 0, 0
    while s < len(ids):
        n = sizes[min(i, len(sizes) - 1)]
        out.append(r.step(ids[s:s + n], logits="all").logits)
        s, i = s + n, i + 1
    return torch.cat(out)


@pytest.mark.parametrize("size", [7, 64, 130])
def test_prefill_chunks(bf16_model, prompts, rule, check, size):
    ids = prompts[2]                                  # 300 tokens: > window, > 2 x ring groups
    check(chunked(bf16_model, ids, [size]), whole(bf16_model, ids), rule, f"chunk {size}")


def test_one_token_steps(bf16_model, prompts, rule, check):
    ids = prompts[1]                                  # 145 tokens, token by token
    check(chunked(bf16_model, ids, [1]), whole(bf16_model, ids), rule, "chunk 1")


def test_decode_and_k_token_steps(bf16_model, prompts, rule, check):
    ids = prompts[2]
    # prefill 200, then 1-token decodes, 3-token and 6-token (1 + 5 drafts) steps, odd starts included
    sizes = [200, 1, 1, 3, 6, 1, 3, 3, 6, 1] + [5] * 20
    check(chunked(bf16_model, ids, sizes), whole(bf16_model, ids), rule, "k-token")


def test_batch_of_sequences(bf16_model, prompts, rule, check):
    """Three sequences with different start positions and lengths in each step, paged blocks
    interleaved, equal to running each alone."""
    model, args = bf16_model, bf16_model.args
    seqs = [prompts[1], prompts[2], prompts[3][:260]]
    refs = [whole(model, s) for s in seqs]
    bt = 64
    caches = ModelCaches.allocate(args, 3, 3 * 6, bt)
    tables = torch.tensor([[0, 3, 6, 9, 12, 15], [1, 4, 7, 10, 13, 16], [2, 5, 8, 11, 14, 17]])
    plan = [[40, 130, 1], [50, 1, 129], [55, 69, 130]]     # new tokens per step, per sequence
    done, got = [0, 0, 0], [[], [], []]
    for step in range(3):
        chunks, active = [], []
        for i, s in enumerate(seqs):
            n = min(plan[i][step], len(s) - done[i])
            if n > 0:
                chunks.append((s[done[i]:done[i] + n], done[i], s[:done[i]]))
                active.append(i)
        batch = make_batch(chunks, active, tables[active], args.engram_max_ngram_size, "cpu", logits="all")
        out = model(batch, caches)
        rows = batch.cu_seqlens.tolist()
        for j, i in enumerate(active):
            got[i].append(out.logits[rows[j]:rows[j + 1]])
            done[i] += len(chunks[j][0])
    for i in range(3):
        g = torch.cat(got[i])
        check(g, refs[i][:g.shape[0]], rule, f"batch seq {i}")


def test_rollback_of_rejected_drafts(bf16_model, prompts, rule, check):
    ids = prompts[2]
    ref = whole(bf16_model, ids)
    r = SequenceRunner(bf16_model, len(ids) + 16)
    out = [r.step(ids[:151], logits="all").logits]
    pos = 151
    while pos < len(ids):
        wrong = [7, 8, 9, 10, 11]                       # a rejected draft block, then roll back
        r.step([ids[pos]] + wrong, logits="all")
        r.rollback(len(wrong) + 1)
        n = min(3, len(ids) - pos)
        out.append(r.step(ids[pos:pos + n], logits="all").logits)
        pos += n
    check(torch.cat(out), ref, rule, "rollback")
