"""Balanced CP for prompts with images (deepinfer/parallel/cp.py, image spans): real gloo rank workers and
the tiny preset's vision tower. Each rank's share rows get the owner's encoded span rows (one scatter),
their token types (VL router bias, Engram dead) and a DEAD-marked n-gram history, so every rank's rows
are a 1-rank prefill's: the logits and tokens equal one rank's bit for bit (batch_invariant), with spans
straddling the mirror split's chunk boundaries and one inside a borrowed rank's chunk (EP or replicated
experts with pipelined steps, DSpark's drafts, a prefix-cache hit on the next turn). Images are encoded
once, ahead, on the owner only; an image that fails to encode fails its request alone."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.llm import LLM
from deepinfer.parallel.cp import MirrorSplit
from deepinfer.parallel.dp_scheduler import BORROW_PREFIX
from deepinfer.sampling_params import SamplingParams
from tests.engine.conftest import drain
from tests.engine.test_engine_images import IMG, png
from tests.parallel.faulty_images import FailsOnTheRank
from tests.parallel.test_cp import one_rank_group, run_recording_drafts

KW = dict(max_num_seqs=4, max_num_batched_tokens=256, num_cache_blocks=48, block_tokens=16, max_model_len=256,
          batch_invariant=True, device="cpu")
CP_KW = dict(cp_min_prompt_tokens=64, worker_threads=1)

# 121 tokens, n = 120 CP positions; spans (sizes: the tiny tower's plans of the pngs below)
#   A 22..41 (20)  C 54..67 (14)  B 82..89 (8)  D 96..103 (8)
# 2 ranks (chunks of 30: rank 0 = 0..29 + 90..119, rank 1 = 30..89): A straddles 30 (rank 0 | rank 1),
# C straddles 60 (rank 1's two chunks, two sequences), B lies inside rank 1's chunk and ends at 90, where
# rank 0's second chunk starts (its n-gram history: DEAD), D lies inside rank 0's chunk;
# 4 ranks (chunks of 15): A straddles 30 (rank 1 | rank 2), C 60 (rank 3's two chunks), B lies inside
# rank 2's 75..89, D inside rank 1's 90..104. The owner of the second prompt is rank 1.
TEXT = [22, 12, 14, 6, 17]
SIZES = [(200, 120), (120, 100), (64, 64), (40, 40)]
SPANS = [(22, 42), (54, 68), (82, 90), (96, 104)]
N = sum(TEXT) + sum(e - s for s, e in SPANS) - 1        # CP positions: the expanded prompt's all but last


def _prompt(offset: int) -> list[int]:
    ids, tok = [], 1000 + offset
    for i, n in enumerate(TEXT):
        ids += list(range(tok, tok + n))
        tok += n
        if i < len(SIZES):
            ids.append(IMG)
    return ids


def _images(seed: int) -> list[bytes]:
    return [png(w, h, seed + i) for i, (w, h) in enumerate(SIZES)]


PROMPTS = [_prompt(0), _prompt(300)]
IMAGES = [_images(10), _images(20)]
PARAMS = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)]


def _spans_cross_the_split(ranks: int) -> None:
    """The layout's claims for `ranks` (owner rank 0): a span straddles a chunk boundary between two ranks,
    one lies wholly inside a chunk of a rank that is not the owner."""
    split = MirrorSplit(N, ranks)
    rank_at = np.empty(split.num_tokens, dtype=np.int64)
    for r in range(ranks):
        rank_at[split.positions(r)] = r
    chunks = [split.chunks(r) for r in range(ranks)]
    owners = [set(rank_at[s:e].tolist()) for s, e in SPANS]
    assert any(len(o) > 1 for o in owners), owners
    assert any(s >= a and e <= b and r != 0 for s, e in SPANS for r in range(ranks) for a, b in chunks[r])


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint):
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # as the rank workers run
    try:
        llm = LLM(str(tiny_checkpoint), **KW)
        yield llm
    finally:
        torch.set_num_threads(threads)


def _gauges(llm) -> list[dict]:
    return llm.engine.runner.ping()


def _check_nothing_borrowed(llm) -> None:
    engine = llm.engine
    assert engine.kv_cache.num_used_blocks == 0                   # owners' and borrowed blocks all back
    engine.kv_cache.check()
    assert all(not k.startswith(BORROW_PREFIX) for s in engine.scheduler.schedulers for k in s.kv_cache.block_ids)
    assert all(not k.startswith(BORROW_PREFIX) for s in engine.scheduler.schedulers for k in s.kv_cache.ring_slot)


@pytest.mark.parametrize("ranks,extra", [(2, {}), (4, {}), (2, {"expert_parallel": False, "async_scheduling": True})])
def test_cp_image_prompts_give_one_ranks_logits(ranks, extra, one_rank, tiny_checkpoint):
    """Two image prompts, one per owner rank, both prefilled with CP in one step: each output's logits
    (every sampled position) and tokens are one rank's bit for bit (EP on, and experts replicated with
    pipelined steps); each image was encoded once, on its request's owner, ahead (no step encoded
    inline), and every rank ran both shares."""
    _spans_cross_the_split(ranks)
    want = one_rank.generate(PROMPTS, PARAMS, images=IMAGES, return_logits=True)
    llm = LLM(str(tiny_checkpoint), **KW, **CP_KW, **extra, data_parallel_size=ranks, context_parallel_size=ranks)
    try:
        got = llm.generate(PROMPTS, PARAMS, images=IMAGES, return_logits=True)
        cp = llm.engine.scheduler.cp_prefills
        pings = _gauges(llm)
        _check_nothing_borrowed(llm)
    finally:
        llm.engine.shutdown()
    assert sorted((o, n) for _, o, n in cp) == [(0, N), (1, N)], cp     # both took CP, one owner each
    assert all(p["num_cp_prefills"] == 2 for p in pings)             # every rank ran its share of each
    assert [p["images_encoded_ahead"] for p in pings] == [4, 4] + [0] * (ranks - 2)   # on the owners only
    assert all(p["images_encoded_inline"] == 0 for p in pings)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logits.shape == w.logits.shape and bool((g.logits == w.logits).all())


def test_a_failing_image_fails_its_request_alone(one_rank, tiny_checkpoint):
    """Among CP image prompts, one whose image cannot be encoded on its rank: it finishes with the error
    (before any block is borrowed for it), the others are prefilled with CP and give one rank's tokens,
    every cache block and ring slot comes back, and the engine goes on."""
    from deepinfer.model.vision import load_image
    greedy = PARAMS[0]
    want = one_rank.generate(PROMPTS, greedy, images=IMAGES)
    llm = LLM(str(tiny_checkpoint), **KW, **CP_KW, data_parallel_size=2, context_parallel_size=2)
    engine = llm.engine
    try:
        im = load_image(png(64, 64, 99), engine.model_args.vision)
        bad = FailsOnTheRank(im.patches, im.plan, content_hash="fails-on-the-rank")
        engine.add_request("ok-0", PROMPTS[0], greedy, images=IMAGES[0])
        engine.add_request("bad", PROMPTS[1], greedy, images=IMAGES[1][:2] + [bad] + IMAGES[1][3:])
        engine.add_request("ok-1", PROMPTS[1], greedy, images=IMAGES[1])
        got, final = drain(engine)
        cp = engine.scheduler.cp_prefills
        _check_nothing_borrowed(llm)
        assert engine.dead is None
        assert final["bad"].finish_reason == "error" and "could not read this image" in final["bad"].error
        assert llm.stats()["counters"]["image_encode_failures_total"] == 1
        assert [got["ok-0"], got["ok-1"]] == [w.token_ids for w in want]
        assert sorted(rid for rid, _, _ in cp) == ["ok-0", "ok-1"]
        again = llm.generate(PROMPTS[:1], greedy, images=IMAGES[:1])[0].token_ids   # the engine goes on, with CP
        assert again == want[0].token_ids and len(engine.scheduler.cp_prefills) == 3
        _check_nothing_borrowed(llm)
    finally:
        engine.shutdown()


def test_cp_image_prompt_with_prefix_caching_second_turn_hits(one_rank, tiny_checkpoint):
    """Prefix caching with CP over 2 ranks: turn 1 (an image prompt) is prefilled with CP and its owner's
    blocks enter the cache under their image keys; turn 2 (turn 1 + its answer + text and another image)
    goes to that owner, hits turn 1's blocks (no CP: it starts past 0) and gives a cold 1-rank run's tokens."""
    greedy = PARAMS[0]
    llm = LLM(str(tiny_checkpoint), **KW, **CP_KW, data_parallel_size=2, context_parallel_size=2,
              enable_prefix_caching=True)
    try:
        t1 = llm.generate(PROMPTS[:1], greedy, images=IMAGES[:1])[0]
        p2, im2 = PROMPTS[0] + t1.token_ids + [5, 6, 7, IMG, 8, 9], IMAGES[0] + [png(64, 64, 77)]
        hot = llm.generate([p2], greedy, images=[im2])[0]
        cp = llm.engine.scheduler.cp_prefills
        llm.engine.kv_cache.check()
        schedulers = llm.engine.scheduler.schedulers
        assert all(not k.startswith(BORROW_PREFIX) for s in schedulers for k in s.kv_cache.block_ids)
    finally:
        llm.engine.shutdown()
    assert [n for _, _, n in cp] == [N]                           # turn 1 only took CP
    assert hot.num_cached_tokens > 64
    cold = one_rank.generate([PROMPTS[0], p2], greedy, images=[IMAGES[0], im2])
    assert t1.token_ids == cold[0].token_ids and hot.token_ids == cold[1].token_ids


def test_cp_image_prompts_with_dspark_give_one_ranks_tokens_and_drafts(one_rank, tiny_checkpoint):
    """DSpark over 2 ranks (every draft verified): the CP prefill of the image prompts leaves the owner's
    draft rings as a 1-rank DSpark prefill does, so every proposal and every token is one rank's."""
    import torch

    from deepinfer.config import EngineArgs
    from deepinfer.engine import Engine
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(checkpoint=str(tiny_checkpoint), **KW, speculative="dspark", spec_policy="threshold",
              spec_confidence_threshold=0.0)
    plain = [o.token_ids for o in one_rank.generate(PROMPTS, greedy, images=IMAGES)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = Engine(EngineArgs(**kw))
    try:
        want, want_drafts = run_recording_drafts(ref, PROMPTS, [greedy] * len(PROMPTS), IMAGES)
    finally:
        ref.shutdown()
        torch.set_num_threads(threads)
    engine = Engine(EngineArgs(**kw, **CP_KW, data_parallel_size=2, context_parallel_size=2))
    try:
        got, got_drafts = run_recording_drafts(engine, PROMPTS, [greedy] * len(PROMPTS), IMAGES)
        cp = engine.scheduler.cp_prefills
    finally:
        engine.shutdown()
    assert sorted((o, n) for _, o, n in cp) == [(0, N), (1, N)], cp
    assert want == got == plain
    assert set(want_drafts) == set(got_drafts) == {"r0", "r1"}
    for rid in want_drafts:
        assert got_drafts[rid] == want_drafts[rid], rid


# ---- the model hook, in process (one rank: the CP share is every position) -------------------------
def cp_image_share_matches_plain_prefill(ckpt, device: str, backend: str) -> None:
    """prefill_share over a 1-rank group on an image prompt (the owner's rows: every position, through
    owner_span_rows from the ImageEmbeds' ahead copy, which an ImageEncoder made, and the share's
    token_mask) leaves exactly the caches a plain prefill with the runner's
    image fields leaves, and the prompt's last token then gets the same logits from both."""
    import torch

    from deepinfer.model.batch import ForwardBatch
    from deepinfer.model.loader import load_model
    from deepinfer.model.vision import expand_image_placeholders, load_image
    from deepinfer.parallel.cp import CPShare, prefill_share
    from deepinfer.worker.image_embeds import ImageEmbeds, ImageEncoder
    from deepinfer.worker.loading import allocate_caches
    with one_rank_group(device, backend):
        model = load_model(ckpt, device, progress=False)
        prompt = expand_image_placeholders(PROMPTS[0], [load_image(b, model.args.vision) for b in IMAGES[0]], IMG)
        assert [(im.start, im.start + im.span_len) for im in prompt.images] == SPANS
        encoder = ImageEncoder(model.vision_tower, batch_invariant=True)
        encoder.submit(prompt)
        assert encoder.flush() == {} and prompt.embeds is not None
        images = ImageEmbeds(model.vision_tower, batch_invariant=True)
        prompt.ahead_key = "r#0"
        images.ahead[prompt.ahead_key] = prompt
        tokens, types = np.asarray(prompt.token_ids, dtype=np.int64), prompt.token_types
        n = len(tokens) - 1
        width = model.args.engram_max_ngram_size - 1
        blocks, slot = list(range(8)), 1
        caches = [allocate_caches(model.args, 2, 9, 16, device, "bfloat16") for _ in range(2)]
        dev = torch.device(device)
        rows = torch.cat(prompt.embeds)                          # [span positions, dim]

        def batch(start: int, end: int) -> ForwardBatch:
            hist = [-1 if p < 0 else -2 if types[p] >= 0 else tokens[p] for p in range(start - width, start)]
            span = np.nonzero(types[start:end] >= 0)[0]
            before = int((types[:start] >= 0).sum())
            return ForwardBatch(input_ids=torch.from_numpy(tokens[start:end]).to(dev),
                                positions=torch.arange(start, end, device=dev),
                                cu_seqlens=torch.tensor([0, end - start]), start_pos=torch.tensor([start]),
                                ngram_history=torch.tensor([hist], device=dev), ring_slots=torch.tensor([slot], device=dev),
                                block_tables=torch.tensor([blocks], device=dev),
                                logits_indices=torch.tensor([end - start - 1], device=dev),
                                token_mask=torch.from_numpy(types[start:end] < 0).to(dev),
                                image_rows=torch.from_numpy(span).to(dev) if len(span) else None,
                                image_embeds=rows[before:before + len(span)] if len(span) else None)
        with torch.inference_mode():
            model(batch(0, n), caches[0])
            share = CPShare("r", 0, 0, 1, tokens[:n], blocks, slot, types[:n].copy(), prompt.ahead_key)
            prefill_share(model, caches[1], share, None, images)
            for kind in ("window_kv", "carry_kv", "carry_score", "compressed_kv", "index_k"):
                a, b = getattr(caches[0], kind), getattr(caches[1], kind)
                for key in (range(len(a)) if isinstance(a, list) else a):
                    assert torch.equal(a[key], b[key]), (kind, key)
            last = [model(batch(n, n + 1), c).logits for c in caches]
            text = CPShare("r", 0, 0, 1, tokens[:n], blocks, slot)       # the same prompt read as text: differs
            prefill_share(model, caches[1], text, None, images)
            assert not torch.equal(model(batch(n, n + 1), caches[1]).logits, last[0])
        assert torch.equal(last[0], last[1])


def test_cp_image_share_matches_plain_prefill_on_cpu(tiny_checkpoint):
    cp_image_share_matches_plain_prefill(tiny_checkpoint, "cpu", "gloo")
