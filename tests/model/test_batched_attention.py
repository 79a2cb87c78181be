"""The batched attention (one sparse_attn call per layer for the whole batch) against the
per-sequence loop it replaced (seq_loop_ref.py), on multi-sequence steps that mix a first prefill
chunk, continuing chunks, one-token decodes and 1+k rows, each step on a shared cache state."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.cache.model_caches import ModelCaches
from deepinfer.model.simple import make_batch

from seq_loop_ref import loop_attention

# per step, per sequence: new tokens (0 = not in this step)
PLAN = [
    [40, 130, 7, 1],      # prefills from 0 (prefill layout), one of them longer than the window
    [1, 1, 130, 6],       # decodes, a chunk continuing past the window, a 1+5 row group
    [3, 129, 1, 1],       # 1+2, a long chunk crossing ring groups, odd starts
    [6, 1, 2, 0],         # mixed k-token rows; the last sequence sits this step out
    [1, 150, 1, 1],       # a chunk longer than the window whose ring slots wrap onto rows its first queries read
]


def _run(model, caches, tables, seqs, plan, loop: bool, emulate: bool):
    model.args.emulate_index_k_alias = emulate
    done, outs = [0] * len(seqs), []
    try:
        for step in plan:
            live = [i for i, n in enumerate(step) if n]
            chunks = [(seqs[i][done[i]:done[i] + step[i]], done[i], seqs[i][:done[i]]) for i in live]
            b = make_batch(chunks, live, tables[live], model.args.engram_max_ngram_size, "cpu", logits="all")
            if loop:
                with loop_attention():
                    outs.append(model(b, caches).logits)
            else:
                outs.append(model(b, caches).logits)
            for i in live:
                done[i] += step[i]
    finally:
        model.args.emulate_index_k_alias = False
    return outs


@pytest.mark.parametrize("emulate", [False, True])
def test_batched_equals_loop(bf16_model, fixture_dir, emulate):
    model, args = bf16_model, bf16_model.args
    prompts = [p["ids"] for p in json.load(open(fixture_dir("v41-tiny-bf16") / "prompts.json"))["prompts"]]
    seqs = [(prompts[i % len(prompts)] * 4)[:420] for i in range(4)]
    tables = torch.tensor([[i + 4 * j for j in range(7)] for i in range(4)])
    results = []
    for loop in (False, True):
        caches = ModelCaches.allocate(args, 4, 28, 64)
        results.append(_run(model, caches, tables, seqs, PLAN, loop, emulate))
    for step, (new, old) in enumerate(zip(*results)):
        assert torch.equal(new, old), (step, (new - old).abs().max().item())
