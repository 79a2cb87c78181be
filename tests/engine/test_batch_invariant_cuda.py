"""Batch invariance on the H200 with the fast kernels: EngineArgs(batch_invariant=True) turns the
Triton GEMMs' fixed-split configs on (kernels/batch_invariant.active) on top of the row-by-row torch
GEMMs, so a request's logits do not depend on what shares its steps. The small preset: its widths
(256, K multiples of 128) take the W8A16 kernels, which the tiny preset's do not."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_same_logits_alone_and_in_batches_on_cuda(small_checkpoint):
    from deepinfer import LLM, SamplingParams
    llm = LLM(str(small_checkpoint), device="cuda", max_num_seqs=8, batch_invariant=True)
    rng = np.random.default_rng(5)
    mine = [int(t) for t in rng.integers(1000, 100000, 40)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate([mine], sp, return_logits=True)[0]
    for size, pos in ((5, 2), (8, 7)):
        ps = [[int(t) for t in rng.integers(1000, 100000, 10 + 17 * i)] for i in range(size - 1)]
        ps.insert(pos, mine)
        out = llm.generate(ps, sp, return_logits=True)[pos]
        assert out.token_ids == alone.token_ids
        assert np.array_equal(out.logits, alone.logits), f"batch {size}: max diff {np.abs(out.logits - alone.logits).max()}"


def test_long_prompts_prefilled_together_match_alone_on_cuda(small_checkpoint):
    """Prompts of 17 / 300 / 1,000 tokens in one 2,048-token prefill step vs each alone: the step's token
    count crosses 1,024, where the fast mHC kernel used to take a taller token tile (H200, 2026-12-02:
    logits 0.12-0.36 apart before; perf/batch_invariance_probe.py found the module)."""
    from deepinfer import LLM, SamplingParams
    llm = LLM(str(small_checkpoint), device="cuda", max_num_seqs=8, max_num_batched_tokens=2048,
              batch_invariant=True)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(1000, 100000, n)] for n in (17, 300, 1000)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, sp, return_logits=True)
    for p, out in zip(prompts, together):
        alone = llm.generate([p], sp, return_logits=True)[0]
        assert out.token_ids == alone.token_ids
        assert np.array_equal(out.logits, alone.logits), f"{len(p)} tokens: max diff {np.abs(out.logits - alone.logits).max()}"
