"""Image requests through the engine on the tiny preset (a 2-layer vision tower): spans expanded from
placeholders, encoded once per request in one tower pass per step, never cut by the scheduler, the
same tokens alone or batched (batch-invariant mode), bad images refused before anything runs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.request import InvalidRequestError, Request
from deepinfer.sampling_params import SamplingParams

IMG = 129264


def png(w: int, h: int, seed: int, fmt: str = "PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from deepinfer.llm import LLM
    return LLM(str(tiny_checkpoint), max_num_seqs=4, max_num_batched_tokens=64, num_cache_blocks=48, block_tokens=16,
               max_model_len=256, batch_invariant=True)


GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPT = [0, 100, 200, IMG, 300, 400]


def test_same_image_alone_or_batched_gives_the_same_tokens(llm):
    a, b = png(200, 120, 0), png(90, 160, 1)
    alone = llm.generate([PROMPT], GREEDY, images=[[a]])[0]
    assert len(alone.prompt_token_ids) == len(PROMPT) - 1 + 20      # 200x120: 15x9 patches, 5x3 tokens, span 20
    both = llm.generate([PROMPT, PROMPT, PROMPT[:3] + [IMG]], GREEDY, images=[[a], [a], [b]])
    assert both[0].token_ids == both[1].token_ids == alone.token_ids
    other = llm.generate([PROMPT], GREEDY, images=[[b]])[0]
    text = llm.generate([PROMPT], GREEDY)[0]
    assert other.token_ids != alone.token_ids and text.token_ids != alone.token_ids   # the image matters


def test_images_are_encoded_once_per_request_in_one_pass(llm):
    enc, imgs = llm.engine.image_encoder, llm.engine.runner.images
    passes, encoded = enc.num_passes, enc.num_encoded
    counted = llm.stats()["counters"]["images_encoded_total"]
    a, b = png(120, 100, 5), png(100, 120, 6)
    llm.generate([PROMPT, [0, IMG, 5, IMG, 6]], GREEDY, images=[[a], [b, a]])
    assert enc.num_passes == passes + 1             # both requests added before one step: one tower pass
    assert enc.num_encoded == encoded + 2           # a (twice) and b: distinct images once each
    assert llm.stats()["counters"]["images_encoded_total"] == counted + 3     # the metric counts per request
    assert imgs.num_passes == 0                     # the runner only reads what the encoder made
    # finished requests are freed (the runner hears of the last ones at the next step)
    assert "llm-0" not in imgs.spans and len(imgs.spans) <= 2


def test_chunked_prompt_never_cuts_a_span_and_matches_unchunked(llm):
    a = png(200, 120, 2)                            # span 20 in the tiny plan: fits the budget of 24 below
    prompt = [0] + list(range(1000, 1030)) + [IMG] + list(range(2000, 2010))
    whole = llm.generate([prompt], GREEDY, images=[[a]])[0]
    sched = llm.engine.scheduler
    seen, orig = [], sched._record

    def record(req, num_new, out):
        seen.append((req.num_computed_tokens, num_new, req.image_spans))
        orig(req, num_new, out)
    sched._record, sched.max_num_batched_tokens = record, 24
    try:
        chunked = llm.generate([prompt], GREEDY, images=[[a]])[0]
    finally:
        sched._record, sched.max_num_batched_tokens = orig, 64
    (s, e), = seen[0][2]
    assert e - s <= 24
    for start, n, _ in seen:
        assert not (s < start + n < e) and not (s < start < e)   # no chunk boundary inside the span
    assert len([1 for start, n, _ in seen if start < len(whole.prompt_token_ids)]) >= 3   # it did chunk
    assert chunked.token_ids == whole.token_ids


def test_bad_images_are_refused_before_anything_runs(llm):
    eng = llm.engine
    with pytest.raises(InvalidRequestError, match="image 0: .*not a readable"):
        eng.add_request("bad-1", PROMPT, GREEDY, images=[b"not an image"])
    with pytest.raises(InvalidRequestError, match="unsupported image format BMP"):
        eng.add_request("bad-2", PROMPT, GREEDY, images=[png(30, 30, 0, "BMP")])
    with pytest.raises(InvalidRequestError, match="1 image placeholders but 2 images"):
        eng.add_request("bad-3", PROMPT, GREEDY, images=[png(30, 30, 0), png(30, 30, 1)])
    many = [0] + [IMG] * 6
    with pytest.raises(InvalidRequestError, match="over the context limit of 256"):
        eng.add_request("bad-4", many, GREEDY, images=[png(600, 500, k) for k in range(6)])
    # ImageInputs a caller made: grids that do not follow from the size, patches that do not fit them
    from dataclasses import replace

    from deepinfer.model.vision import ImageInput, load_image
    im = load_image(png(200, 120, 0), eng.model_args.vision)
    with pytest.raises(InvalidRequestError, match="image 0: an ImageInput's plan"):
        eng.add_request("bad-5", PROMPT, GREEDY, images=[ImageInput(im.patches, replace(im.plan, n_llm_w=99))])
    with pytest.raises(InvalidRequestError, match="image 0: an ImageInput's patches must be a float tensor"):
        eng.add_request("bad-6", PROMPT, GREEDY, images=[ImageInput(im.patches[:-1], im.plan)])
    with pytest.raises(InvalidRequestError, match="patches must be a float tensor"):
        eng.add_request("bad-7", PROMPT, GREEDY, images=[ImageInput(im.patches.to(torch.int16), im.plan)])
    assert not eng.scheduler.requests
    assert llm.generate([PROMPT], GREEDY, images=[[png(64, 64, 9)]])[0].finish_reason == "length"   # still serving
    assert llm.generate([PROMPT], GREEDY, images=[[im]])[0].finish_reason == "length"    # a well-made ImageInput


def test_a_span_larger_than_the_step_budget_is_refused(llm):
    sched = llm.engine.args
    big = png(600, 500, 3)                          # span 6 * 8 + 2 = 50 in the tiny plan; budget lowered below it
    old = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 40
    try:
        with pytest.raises(InvalidRequestError, match="more than one step holds"):
            llm.engine.add_request("big", PROMPT, GREEDY, images=[big])
    finally:
        sched.max_num_batched_tokens = old


def test_a_request_waits_until_its_images_are_encoded():
    """The scheduler admits nothing of a request whose ImagePrompt is not ready (FCFS: nor after it)."""
    from tests.engine.conftest import create_scheduler
    from deepinfer.model.vision import ImageInput, ImagePlan, expand_image_placeholders
    import torch
    im = ImageInput(torch.zeros(36, 3, 14, 14, dtype=torch.bfloat16), ImagePlan(84, 84, 6, 6, 2, 2))
    ip = expand_image_placeholders([1, IMG, 2], [im], IMG)
    ip.encoding = True                                            # submitted, not encoded yet
    sched = create_scheduler(max_num_batched_tokens=32)
    sched.add_request(Request("img", ip.token_ids, GREEDY, image_prompt=ip))
    sched.add_request(Request("txt", [5, 6, 7], GREEDY))
    assert sched.schedule().num_scheduled_tokens == {}
    ip.embeds = [torch.zeros(8, 4)]                               # the encoder's pass finished (CPU: no event)
    assert sched.schedule().num_scheduled_tokens == {"img": 10, "txt": 3}


def test_clip_to_spans():
    from deepinfer.model.vision import ImageInput, ImagePlan, expand_image_placeholders
    import torch
    plan = ImagePlan(84, 84, 6, 6, 2, 2)                          # span 8
    im = ImageInput(torch.zeros(36, 3, 14, 14, dtype=torch.bfloat16), plan)
    ip = expand_image_placeholders([1, 2, 3, IMG, 4, IMG, 5], [im, im], IMG)
    req = Request("r", ip.token_ids, GREEDY, image_prompt=ip)
    assert req.image_spans == [(3, 11), (12, 20)]
    assert req.clip_to_spans(0, 2) == 2          # text only
    assert req.clip_to_spans(0, 5) == 3          # would end inside span 1: stops before it
    assert req.clip_to_spans(0, 11) == 11        # ends right after span 1
    assert req.clip_to_spans(3, 4) == 0          # span 1 alone does not fit
    assert req.clip_to_spans(3, 9) == 9          # span 1 + the text token; 12 starts span 2 (not cut)
    assert req.clip_to_spans(3, 12) == 9         # would cut span 2
    assert req.clip_to_spans(11, 100) == 100


def test_images_on_two_ranks_give_the_tokens_of_one(llm, tiny_checkpoint):
    """Attention data parallel (gloo rank workers): the ImagePrompt travels to the rank that runs the
    request, whose runner encodes it; tokens equal the one-rank engine's under batch_invariant."""
    from deepinfer.llm import LLM
    a, b = png(200, 120, 11), png(90, 160, 12)
    prompts, images = [PROMPT, [0, 7, IMG, 8]], [[a], [b]]
    ref = llm.generate(prompts, GREEDY, images=images)
    dp = LLM(str(tiny_checkpoint), max_num_seqs=4, max_num_batched_tokens=64, num_cache_blocks=48, block_tokens=16,
             max_model_len=256, batch_invariant=True, data_parallel_size=2, worker_threads=1, device="cpu")
    try:
        outs = dp.generate(prompts, GREEDY, images=images)
    finally:
        dp.engine.shutdown()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_a_failed_encode_fails_only_its_request(tiny_checkpoint):
    """The tower raising on one request's image (injected: memory, a driver fault) fails that request
    alone, with the reason; the requests encoded in the same pass and a text one finish with the
    tokens they get without it, and the engine serves the next request."""
    from deepinfer.llm import LLM
    from tests.engine.conftest import drain
    llm = LLM(str(tiny_checkpoint), max_num_seqs=4, max_num_batched_tokens=64, num_cache_blocks=48, block_tokens=16,
              max_model_len=256, batch_invariant=True)
    engine = llm.engine
    good, bad = png(200, 120, 0), png(64, 64, 9)
    want = llm.generate([PROMPT, [7, 8, 9]], GREEDY, images=[[good], None])
    tower = engine.image_encoder.tower
    real = tower.encode
    bad_plan = engine.prepare_images("probe", [IMG], [bad]).images[0].plan

    def encode(images):
        if any(im.plan == bad_plan for im in images):
            raise RuntimeError("injected: CUDA out of memory")
        return real(images)

    tower.encode = encode
    try:
        reqs = {"ok": (PROMPT, [good]), "bad": (PROMPT, [bad]), "txt": ([7, 8, 9], None)}
        for rid, (prompt, images) in reqs.items():
            engine.add_request(rid, prompt, GREEDY, images=images)
        got, final = drain(engine)
    finally:
        tower.encode = real
    assert final["bad"].finish_reason == "error" and "image encoding failed" in final["bad"].error
    assert llm.stats()["counters"]["image_encode_failures_total"] == 1
    assert "out of memory" in final["bad"].error and got["bad"] == []
    assert got["ok"] == want[0].token_ids and got["txt"] == want[1].token_ids
    assert engine.kv_cache.num_used_blocks == 0
    assert llm.generate([PROMPT], GREEDY, images=[[bad]])[0].token_ids      # the engine goes on
