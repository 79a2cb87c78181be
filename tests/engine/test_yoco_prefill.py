"""YOCO prefill truncation on the real tiny model (CPU; model/yoco.py): the decoder layers (from the
first ratio-1 layer, 6 in the tiny preset) run only the last N prompt rows, the compressed KV is
what exact mode writes, a prompt no longer than N is untouched, the drift of the last rows' logits
against exact mode is measured (printed: run with -s), chunked prefill and prefix caching work with
it, and bad settings are refused at start."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model.yoco import decoder_start

KEEP = 140
P_LEN = 180


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 120000, n).tolist()


def make(ckpt, keep, **kw):
    return LLM(str(ckpt), device="cpu", max_num_seqs=2, max_num_batched_tokens=512, block_tokens=8,
               num_cache_blocks=64, yoco_prefill_keep_tokens=keep, **kw)


class RowCounter:
    """Rows each backbone layer runs, per forward (a pre-hook on every Block)."""

    def __init__(self, model):
        self.rows: list[list[int]] = [[] for _ in model.layers]
        self.handles = [layer.register_forward_pre_hook(lambda m, a, i=i: self.rows[i].append(a[0].shape[0]))
                        for i, layer in enumerate(model.layers)]

    def close(self):
        for h in self.handles:
            h.remove()


def first_prefill(llm, p):
    """Prefill p alone in a fresh engine; -> (the layers' row counts, the compressed pools after it)."""
    counter = RowCounter(llm.engine.model)
    out = llm.generate(p, SamplingParams(max_tokens=1, temperature=0), return_logits=True)[0]
    counter.close()
    caches = llm.engine.caches
    pools = {L: caches.compressed_kv[L].clone() for L in llm.engine.model.args.kv_source_layers}
    pools.update({("index", L): caches.index_k[L].clone() for L in llm.engine.model.args.kv_source_layers
                  if L in caches.index_k})
    return counter.rows, pools, out


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    p = prompt(P_LEN, 1)
    exact, yoco = make(tiny_checkpoint, 0), make(tiny_checkpoint, KEEP)
    return dict(exact=exact, yoco=yoco, p=p, first={"exact": first_prefill(exact, p), "yoco": first_prefill(yoco, p)})


def test_decoder_layers_run_only_the_last_n_rows(engines):
    rows, _, out = engines["first"]["yoco"]
    B = decoder_start(engines["yoco"].engine.model.args)
    assert B == 6                                              # the tiny preset's first ratio-1 layer
    assert all(r == [P_LEN] for r in rows[:B]), rows[:B]        # the encoder: the whole prompt, one step
    assert all(r == [KEEP] for r in rows[B:]), rows[B:]        # the decoder: the last N rows only
    exact_rows = engines["first"]["exact"][0]
    assert all(r == [P_LEN] for r in exact_rows)               # exact mode: every layer every row
    assert len(out.token_ids) == 1 and 0 <= out.token_ids[0] < 129280


def test_compressed_kv_is_what_exact_mode_writes(engines):
    """Layer B's compressed KV comes from every row's layer-B input: the pools (encoder sources and
    B) hold the same bits in both modes, so the prefix cache may share blocks between them."""
    ex, yo = engines["first"]["exact"][1], engines["first"]["yoco"][1]
    assert ex.keys() == yo.keys() and len(ex) >= 3
    for k in ex:
        assert ex[k].abs().sum() > 0, k                        # the request wrote into them
        assert np.array_equal(ex[k].float().numpy(), yo[k].float().numpy()), k


def test_last_rows_drift_is_measured_and_short_prompts_are_exact(engines):
    exact, yoco, p = engines["exact"], engines["yoco"], engines["p"]
    fed = prompt(3, 9)
    sp = SamplingParams(max_tokens=len(fed) + 1, temperature=0, ignore_eos=True)
    e = exact.generate(p, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    y = yoco.generate(p, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    assert e.shape == y.shape and np.isfinite(y).all()
    diff = np.abs(e - y).max(-1)
    top1 = (e.argmax(-1) == y.argmax(-1)).mean()
    print(f"\nYOCO N={KEEP} on a {P_LEN}-token prompt (tiny, CPU), teacher-forced logits vs exact: "
          f"max |diff| per row {np.round(diff, 3).tolist()}, top-1 agreement {top1:.2f}")
    assert diff.max() > 0                                      # truncation is approximate by design
    # a prompt no longer than N drops nothing: bit-identical to exact mode
    short = prompt(KEEP - 10, 3)
    es = exact.generate(short, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    ys = yoco.generate(short, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    assert np.array_equal(es, ys)


def test_chunked_prefill_keeps_a_placeholder_row_per_early_chunk(engines):
    yoco, p = engines["yoco"], engines["p"]
    whole = yoco.generate(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), return_logits=True)[0]
    sched = yoco.engine.scheduler
    budget = sched.max_num_batched_tokens
    counter = RowCounter(yoco.engine.model)
    sched.max_num_batched_tokens = 32                          # chunks of 32: [0, 32) .. [160, 180)
    try:
        chunked = yoco.generate(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                return_logits=True)[0]
    finally:
        sched.max_num_batched_tokens = budget
        counter.close()
    B = decoder_start(yoco.engine.model.args)
    prefill = counter.rows[B][:6]                              # 6 prefill chunks, then 3 decode steps
    keep_from = P_LEN - KEEP                                   # 40: chunk [32, 64) is cut at 40
    assert prefill == [1, 24, 32, 32, 32, 20], prefill          # [0,32) wholly before: one placeholder row
    assert counter.rows[0][:6] == [32, 32, 32, 32, 32, 20]
    assert sum(prefill) - 1 == KEEP and keep_from == 40
    # the same kept rows in other chunks: the same tokens (numbers differ only in rounding)
    assert chunked.token_ids[0] == whole.token_ids[0]
    d = np.abs(chunked.logits[0] - whole.logits[0]).max()
    print(f"\nYOCO chunked (32) vs whole prefill, first-token logits max |diff| {d:.4f}")


def test_prefix_caching_with_yoco(tiny_checkpoint):
    llm = make(tiny_checkpoint, KEEP, enable_prefix_caching=True, window_snapshot_bytes=0)
    p = prompt(P_LEN, 1)
    llm.generate(p, SamplingParams(max_tokens=1, temperature=0))
    counter = RowCounter(llm.engine.model)
    out = llm.generate(p + prompt(20, 5), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    counter.close()
    assert out.num_cached_tokens == P_LEN // 8 * 8             # the full blocks of the first prompt
    B = decoder_start(llm.engine.model.args)
    # replay from H - 128 = 48: the encoder runs [48, 200), the decoder the last N rows [60, 200)
    assert counter.rows[0][0] == P_LEN + 20 - (P_LEN // 8 * 8 - 128)
    assert counter.rows[B][0] == KEEP
    assert len(out.token_ids) == 3 and all(0 <= t < 129280 for t in out.token_ids)


@pytest.mark.parametrize("keep, match", [(100, "below the window"), (-1, ">= 0")])
def test_bad_keep_tokens_refused_at_start(tiny_checkpoint, keep, match):
    with pytest.raises(ValueError, match=match):
        make(tiny_checkpoint, keep)


def test_dspark_drafts_with_yoco_give_the_same_tokens(tiny_checkpoint, engines):
    """DSpark rings see the kept rows only (drafts read the last window): acceptance stays exact."""
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = engines["yoco"].generate(engines["p"], sp)[0]
    eng = make(tiny_checkpoint, KEEP, speculative="dspark", spec_policy="all")
    spec = eng.generate(engines["p"], sp)[0]
    assert eng.stats()["counters"]["spec_draft_tokens_verified_total"] > 0
    assert spec.token_ids == plain.token_ids
    with pytest.raises(ValueError, match=r"rollback \(6\)"):
        make(tiny_checkpoint, 130, speculative="dspark")            # 128 + 5 drafts + 1 > 130


def test_two_prompts_in_one_step(engines):
    yoco, p = engines["yoco"], engines["p"]
    short = prompt(100, 4)
    counter = RowCounter(yoco.engine.model)
    outs = yoco.generate([p, short], SamplingParams(max_tokens=1, temperature=0))
    counter.close()
    B = decoder_start(yoco.engine.model.args)
    assert counter.rows[0] == [P_LEN + 100] and counter.rows[B] == [KEEP + 100]   # one step, both prompts
    alone = yoco.generate(short, SamplingParams(max_tokens=1, temperature=0))[0]
    assert outs[1].token_ids == alone.token_ids                # the short prompt is exact mode's
