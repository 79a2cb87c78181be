"""Prefix caching with images (tiny preset, CPU): blocks over an image span are keyed by the image's
content, so a second request with the same image hits them (and gets the cold run's tokens) and one
with a different image behind the same placeholder tokens never does."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from deepinfer.cache.image_keys import image_content_key, request_cache_keys, span_keys
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams

IMG = 129264
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def png(w: int, h: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def make_llm(ckpt, **kw):
    from deepinfer.llm import LLM
    kw = {"max_num_seqs": 2, "max_num_batched_tokens": 256, "num_cache_blocks": 64, "block_tokens": 8,
          "max_model_len": 256, **kw}
    return LLM(str(ckpt), enable_prefix_caching=True, **kw)


# an image early in a long prompt: the hit's blocks cover the whole span
PROMPT = [0] + list(range(1000, 1010)) + [IMG] + list(range(2000, 2060))


def counters(llm):
    return llm.stats()["counters"]


def test_same_image_hits_different_image_misses(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, window_snapshot_bytes=0)
    a, b = png(200, 120, 0), png(200, 120, 1)           # same size: the same span, the same token ids
    first = llm.generate([PROMPT], GREEDY, images=[[a]])[0]
    assert first.num_cached_tokens == 0
    same = llm.generate([PROMPT], GREEDY, images=[[a]])[0]
    n = len(first.prompt_token_ids)
    assert same.num_cached_tokens == (n - 1) // 8 * 8      # every full block before the last token
    # the prompt is shorter than the window: the replay restarts at 0 over the cached compressed KV,
    # in the same step shape as the cold run: the cold tokens
    assert same.token_ids == first.token_ids
    other = llm.generate([PROMPT], GREEDY, images=[[b]])[0]
    assert other.prompt_token_ids == first.prompt_token_ids    # identical placeholder ids ...
    assert other.num_cached_tokens == 11 // 8 * 8              # ... yet only the text blocks before the span hit
    text = llm.generate([PROMPT[:11] + [IMG] * 5], GREEDY)[0]  # literal image ids, no image: no span block
    assert text.num_cached_tokens <= 8


def test_cache_keys_follow_image_content_not_token_ids(tiny_checkpoint):
    from deepinfer.model.args import ModelArgs
    from deepinfer.model.vision import expand_image_placeholders, image_from_pixels, load_image
    v = ModelArgs.from_checkpoint(tiny_checkpoint).vision
    a = load_image(png(200, 120, 3), v)
    a_again = load_image(png(200, 120, 3), v)
    c = load_image(png(200, 120, 4), v)
    assert image_content_key(a) == image_content_key(a_again) != image_content_key(c)
    pa = expand_image_placeholders([5, IMG, 6], [a], IMG)
    pc = expand_image_placeholders([5, IMG, 6], [c], IMG)
    ka = request_cache_keys(Request("a", pa.token_ids, GREEDY, image_prompt=pa))
    kc = request_cache_keys(Request("c", pc.token_ids, GREEDY, image_prompt=pc))
    span = slice(1, 1 + a.span_len)
    assert ka[0] == kc[0] == 5 and ka[-1] == kc[-1] == 6                     # text keeps its ids
    assert all(k < 0 for k in ka[span]) and len(set(ka[span])) == a.span_len  # offsets differ
    assert not set(ka[span]) & set(kc[span])
    assert list(span_keys(image_content_key(a), 3)) == ka[1:4]
    # the same picture given as planned pixels (the preprocess model's path) keys as its bytes do
    from deepinfer.model.vision.preprocess import prepare_pixels
    px = image_from_pixels(prepare_pixels(png(200, 120, 3), v)[0], v)
    assert px.content_hash != a.content_hash and image_content_key(px) == image_content_key(a)


def test_image_conversation_turn_two_hits_the_snapshot_exactly(tiny_checkpoint):
    """Turn 2 resends turn 1 (its image included) plus new text: the window snapshot matches by the
    image's keys, and under batch_invariant the tokens and logits equal a cold run's bit for bit."""
    a = png(200, 120, 5)
    p1 = [0] + list(range(1000, 1010)) + [IMG] + list(range(2000, 2012))
    warm = make_llm(tiny_checkpoint, batch_invariant=True)
    t1 = warm.generate([p1], GREEDY, images=[[a]])[0]
    assert IMG not in t1.token_ids
    p2 = p1 + t1.token_ids + list(range(3000, 3005))
    hot = warm.generate([p2], GREEDY, images=[[a]], return_logits=True)[0]
    assert counters(warm)["prefix_cache_snapshot_hits_total"] == 1
    assert hot.num_cached_tokens == len(t1.prompt_token_ids) + len(t1.token_ids) - 1
    from deepinfer.llm import LLM
    cold = LLM(str(tiny_checkpoint), max_num_seqs=2, max_num_batched_tokens=256, num_cache_blocks=64, block_tokens=8,
               max_model_len=256, batch_invariant=True).generate([p2], GREEDY, images=[[a]], return_logits=True)[0]
    assert hot.token_ids == cold.token_ids and np.array_equal(hot.logits, cold.logits)
    # the same conversation with another image of the same size: no snapshot, no block past the text
    b = png(200, 120, 6)
    other = warm.generate([p2], GREEDY, images=[[b]])[0]
    assert counters(warm)["prefix_cache_snapshot_hits_total"] == 1 and other.num_cached_tokens == 8


def test_images_inside_the_cached_prefix_are_not_encoded(tiny_checkpoint):
    """A full hit whose replay starts past the image's span never reads its embeddings: the tower
    runs 0 images for it, and the tokens equal the cold run's. A hit whose replay covers the span
    (a short prompt) encodes it again: the replay reads its rows."""
    check_images_inside_the_cached_prefix_are_not_encoded(tiny_checkpoint)


@pytest.mark.gpu
def test_images_inside_the_cached_prefix_are_not_encoded_cuda(tiny_checkpoint):
    """The same on CUDA: the encoder's side stream, events over partly encoded prompts, async steps."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_images_inside_the_cached_prefix_are_not_encoded(tiny_checkpoint, device="cuda")


def check_images_inside_the_cached_prefix_are_not_encoded(ckpt, **kw):
    a = png(200, 120, 7)
    long_prompt = [0] + list(range(1000, 1010)) + [IMG] + list(range(2000, 2170))   # > 128 tokens after the span
    llm = make_llm(ckpt, window_snapshot_bytes=0, max_num_batched_tokens=512, max_model_len=512,
                   num_cache_blocks=128, **kw)
    enc = llm.engine.image_encoder
    first = llm.generate([long_prompt], GREEDY, images=[[a]])[0]
    assert enc.num_encoded == 1
    span_end = 11 + (len(first.prompt_token_ids) - len(long_prompt) + 1)
    again = llm.generate([long_prompt], GREEDY, images=[[a]])[0]
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 8 * 8
    assert again.num_cached_tokens - 128 >= span_end           # the replay starts past the span
    assert enc.num_encoded == 1                                 # nothing encoded for the hit
    assert again.token_ids == first.token_ids
    # a shorter prompt over the same blocks: the hit's replay starts at 0 and reads the span again
    short = llm.generate([PROMPT], GREEDY, images=[[a]])[0]
    assert short.num_cached_tokens == (len(short.prompt_token_ids) - 1) // 8 * 8 > span_end
    assert enc.num_encoded == 2


def test_a_hit_shorter_than_expected_asks_for_the_skipped_images():
    """The engine skips images by the hit it sees at add_request; if admission starts earlier (the
    blocks were evicted meanwhile, or a preemption), the scheduler asks for them and waits."""
    import torch
    from tests.engine.conftest import create_scheduler
    from deepinfer.model.vision import ImageInput, ImagePlan, expand_image_placeholders
    im = ImageInput(torch.zeros(36, 3, 14, 14, dtype=torch.bfloat16), ImagePlan(84, 84, 6, 6, 2, 2))
    ip = expand_image_placeholders([1, IMG, 2], [im], IMG)
    ip.encoding, ip.embeds = True, [None]          # submitted with its image skipped
    asked = []
    sched = create_scheduler(max_num_batched_tokens=32)
    sched.encode_images = lambda req, idx: (asked.append(list(idx)), req.image_prompt.asked.update(idx))
    sched.add_request(Request("img", ip.token_ids, GREEDY, image_prompt=ip))
    assert ip.ready_from(9) and not ip.ready_from(0)
    assert sched.schedule().num_scheduled_tokens == {}   # no hit: starts at 0, reads the span
    assert asked == [[0]]
    sched.schedule()
    assert asked == [[0]]                                # asked once
    ip.embeds = [torch.zeros(8, 4)]
    assert sched.schedule().num_scheduled_tokens == {"img": 10}
