"""Image requests on a multi-rank engine (2 gloo ranks, the tiny preset's vision tower): each rank
encodes its requests' images ahead of their steps (parallel/image_ahead.py), the scheduler admits a
request only once its rank reports them done, the tokens equal one rank's, and a rank frees what it
holds once the request is over (finished, aborted while waiting, or its id reused for other images)."""

from __future__ import annotations

import pytest

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tests.engine.conftest import drain
from tests.engine.test_engine_images import IMG, png
from tests.parallel.faulty_images import FailsOnTheRank

GREEDY = SamplingParams(max_tokens=6, temperature=0)
KW = dict(max_num_seqs=4, max_num_batched_tokens=64, num_cache_blocks=48, block_tokens=16, max_model_len=256,
          batch_invariant=True, device="cpu")
PROMPTS = [[0, 100, 200, IMG, 300, 400], [0, IMG, 5, IMG, 6], [7, 8, 9], [1, IMG, 2]]
IMAGES = [[png(200, 120, 0)], [png(90, 160, 1), png(200, 120, 0)], None, [png(64, 64, 3)]]


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), **KW)


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), data_parallel_size=2, worker_threads=1, **KW)
    yield llm
    llm.engine.shutdown()


def _image_gauges(llm) -> list[dict]:
    return [{k: v for k, v in p.items() if "image" in k} for p in llm.engine.runner.ping()]


def test_ranks_encode_ahead_and_give_one_ranks_tokens(one_rank, two_ranks):
    ref = one_rank.generate(PROMPTS, GREEDY, images=IMAGES)
    before = _image_gauges(two_ranks)
    counted = two_ranks.stats()["counters"]["images_encoded_total"]
    outs = two_ranks.generate(PROMPTS, GREEDY, images=IMAGES)
    assert two_ranks.stats()["counters"]["images_encoded_total"] == counted + 4     # per request's image
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    after = _image_gauges(two_ranks)
    assert all(a["images_encoded_inline"] == 0 for a in after)          # no step encoded in its own stream
    ahead = sum(a["images_encoded_ahead"] - b["images_encoded_ahead"] for a, b in zip(after, before))
    assert 3 <= ahead <= 4        # 4 images, 3 distinct: the repeated one once if its requests share a rank
    assert two_ranks.engine.image_encoder.images_done >= 4
    assert sorted(len(s.requests) for s in two_ranks.engine.scheduler.schedulers) == [0, 0]


def test_a_request_waits_for_its_ranks_report(two_ranks):
    engine = two_ranks.engine
    engine.add_request("wait-0", PROMPTS[0], GREEDY, images=IMAGES[0])
    prompt = engine.scheduler.requests["wait-0"].image_prompt
    assert prompt.encoding and not prompt.ready           # asked, not yet reported: not admitted
    outs, _ = drain(engine)
    assert prompt.ready and len(outs["wait-0"]) == GREEDY.max_tokens


def test_finished_and_aborted_requests_are_dropped_by_their_rank(two_ranks):
    engine = two_ranks.engine
    engine.add_request("drop-0", PROMPTS[3], GREEDY, images=IMAGES[3])
    engine.abort("drop-0")                                # aborted before its job was ever sent
    engine.add_request("drop-1", PROMPTS[0], GREEDY, images=IMAGES[0])
    drain(engine)
    engine.add_request("text", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    drain(engine)                                        # its steps tell the ranks drop-1 is over
    assert [g["image_prompts_held"] for g in _image_gauges(two_ranks)] == [0, 0]
    assert not engine.image_encoder._held


def test_a_reused_request_id_reads_its_own_images(one_rank, two_ranks):
    """The same id right after it finished, with another image: the rank must not hand it the old
    request's embeddings (held prompts are keyed per request, not per id)."""
    other = [png(120, 100, 7)]
    want = one_rank.generate([PROMPTS[3]], GREEDY, images=[other])[0].token_ids
    engine = two_ranks.engine
    engine.add_request("same", PROMPTS[3], GREEDY, images=IMAGES[3])
    first = drain(engine)[0]["same"]
    engine.add_request("same", PROMPTS[3], GREEDY, images=other)
    second = drain(engine)[0]["same"]
    assert second == want and first != second


def test_a_ranks_prefix_hit_skips_the_images_it_covers(tiny_checkpoint):
    """Prefix caching over ranks: the repeat lands on the rank that holds the prefix, whose expected hit
    starts past the image's span, so that rank encodes nothing for it; the tokens are the cold run's."""
    from tests.engine.test_prefix_cache_images import make_llm
    a = png(200, 120, 7)
    long_prompt = [0] + list(range(1000, 1010)) + [IMG] + list(range(2000, 2170))   # > 128 tokens after the span
    llm = make_llm(tiny_checkpoint, window_snapshot_bytes=0, max_num_batched_tokens=512, max_model_len=512,
                   num_cache_blocks=128, data_parallel_size=2, worker_threads=1, device="cpu")
    try:
        first = llm.generate([long_prompt], GREEDY, images=[[a]])[0]
        encoded = sum(g["images_encoded_ahead"] for g in _image_gauges(llm))
        again = llm.generate([long_prompt], GREEDY, images=[[a]])[0]
        assert again.num_cached_tokens > 128 and again.token_ids == first.token_ids
        assert encoded == 1 and sum(g["images_encoded_ahead"] for g in _image_gauges(llm)) == 1
    finally:
        llm.engine.shutdown()


def test_a_failed_encode_on_a_rank_fails_only_its_request(one_rank, two_ranks):
    from deepinfer.model.vision import load_image
    engine = two_ranks.engine
    im = load_image(png(64, 64, 9), engine.model_args.vision)
    bad = FailsOnTheRank(im.patches, im.plan, content_hash="fails-on-the-rank")
    want = one_rank.generate(PROMPTS[:3], GREEDY, images=IMAGES[:3])
    for i, (prompt, images) in enumerate(zip(PROMPTS[:3], IMAGES[:3])):
        engine.add_request(f"ok-{i}", prompt, GREEDY, images=images)
    engine.add_request("bad", PROMPTS[3], GREEDY, images=[bad])
    got, final = drain(engine)
    assert final["bad"].finish_reason == "error" and "could not read this image" in final["bad"].error
    assert two_ranks.stats()["counters"]["image_encode_failures_total"] == 1
    assert [got[f"ok-{i}"] for i in range(3)] == [w.token_ids for w in want]
    assert engine.dead is None and two_ranks.generate([PROMPTS[0]], GREEDY, images=IMAGES[:1])[0].token_ids
    # the ranks hold only the last request's prompt (finished ones go at the next step): the failed one
    # was dropped where it failed
    assert sum(g["image_prompts_held"] for g in _image_gauges(two_ranks)) == 1
