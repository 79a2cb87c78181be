"""Image parts of Chat Completions, Responses and Messages requests through the preprocess: the
placeholder as the checkpoint's tokenizer spells it, prompt-token counts with the image spans, the
pixels the contract carries (equal to the engine's own preprocessing of the original bytes), and the
API's own 400 for every kind of bad image input."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from deepinfer.ensemble.engine_driver import split_pixels
from deepinfer.model.vision import VisionArgs, image_from_pixels, load_image
from deepinfer.model.vision.preprocess import checkpoint_image_preparer
from deepinfer.recipe import Preprocessor, preprocess_outputs
from deepinfer.recipe.images import ImageLimits, public_address_only

IMG = 129264


def png(w, h, seed=0, fmt="PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat(*parts, **kw):
    return "chat.completions", {"model": "deepseek-flash", "messages": [{"role": "user", "content": list(parts)}], **kw}


def chat_image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def responses(*urls, text="what is it?"):
    content = [{"type": "input_text", "text": text}] + [{"type": "input_image", "image_url": u} for u in urls]
    return "responses", {"model": "deepseek-flash", "input": [{"role": "user", "content": content}]}


def messages(*datas, text="what is it?"):
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(d).decode()}} for d in datas]
    return "messages", {"model": "deepseek-flash", "max_tokens": 16,
                        "messages": [{"role": "user", "content": blocks + [{"type": "text", "text": text}]}]}


@pytest.fixture(scope="module")
def pre(tiny_checkpoint):
    return Preprocessor(tiny_checkpoint / "tokenizer.json", 4096, prepare_image=checkpoint_image_preparer(tiny_checkpoint))


@pytest.fixture(scope="module")
def vision(tiny_checkpoint):
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    return VisionArgs.from_hf(cfg["vision_config"])


def prepare(pre, api_body):
    api, body = api_body
    return pre.prepare(api, json.dumps(body))


@pytest.mark.parametrize("build", [
    lambda a, b: chat({"type": "text", "text": "compare"}, chat_image(data_url(a)), chat_image(data_url(b))),
    lambda a, b: responses(data_url(a), data_url(b)),
    lambda a, b: messages(a, b),
])
def test_three_apis_carry_images_to_the_engine(pre, vision, build):
    a, b = png(200, 120, 1), png(90, 300, 2)
    p = prepare(pre, build(a, b))
    assert not p.rejected, p.context.error_body
    assert p.prompt_token_ids.count(IMG) == 2
    spans = [load_image(x, vision).span_len for x in (a, b)]
    assert p.context.prompt_tokens == len(p.prompt_token_ids) + sum(s - 1 for s in spans)    # usage counts spans
    out = preprocess_outputs(p)
    pixels = split_pixels(out["image_pixels"], out["image_sizes"])
    assert out["image_pixels"].dtype == np.uint8 and len(pixels) == 2
    for x, rgb in zip((a, b), pixels):            # the engine's pixels = its own preprocessing of the original
        mine, theirs = load_image(x, vision), image_from_pixels(rgb, vision)
        assert mine.plan == theirs.plan and (mine.patches == theirs.patches).all()


def test_placeholder_spelling_and_typed_placeholders_stay_text(pre, tiny_checkpoint):
    from tokenizers import Tokenizer
    spelled = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).id_to_token(IMG)
    p = prepare(pre, chat({"type": "text", "text": f"a typed {spelled} and <｜image｜>"}, chat_image(data_url(png(50, 50)))))
    assert p.prompt_token_ids.count(IMG) == 1     # only the real image part
    text = prepare(pre, chat({"type": "text", "text": f"just {spelled}"}))
    assert IMG not in text.prompt_token_ids and text.images is None
    assert preprocess_outputs(text)["image_sizes"] == []


def test_prompt_tokens_match_the_recipes_adjustment(pre):
    """The recipe's image_token_adjustment (its own resolver) for the same request."""
    dr = pytest.importorskip("deepseek_recipe")
    a = png(640, 480, 3)
    release = Preprocessor(pre_tokenizer(pre), 1 << 20,
                           prepare_image=release_preparer)
    p = prepare(release, chat(chat_image(data_url(a))))
    mm = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor()).resolve(
        [dr.BytesImageSource(a)], dr.ImageQuota())
    assert p.context.prompt_tokens - len(p.prompt_token_ids) == mm.image_token_adjustment() == 205


def smooth_png(w, h) -> bytes:
    """A gradient (a few KB even when large: the test encodes it fast)."""
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_low_detail_takes_the_recipes_token_count(pre, api):
    """OpenAI `detail: "low"` caps the original's long side at 512 px before the plan, as the recipe
    does: 2000x1000 is 991 + 1 tokens in high detail, 201 + 1 in low (the recipe's own resolver on the
    same bytes and detail gives the same adjustment); the pixels the engine gets follow the low plan."""
    dr = pytest.importorskip("deepseek_recipe")
    a = smooth_png(2000, 1000)
    release = Preprocessor(pre_tokenizer(pre), 1 << 20,
                           prepare_image=release_preparer)

    def body(detail):
        if api == "chat":
            return chat({"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": data_url(a), "detail": detail}})
        return "responses", {"model": "deepseek-flash", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is it?"},
            {"type": "input_image", "image_url": data_url(a), "detail": detail}]}]}

    adjustments = {}
    for detail in ("low", "high", "auto"):
        p = prepare(release, body(detail))
        assert not p.rejected, p.context.error_body
        adjustments[detail] = p.context.prompt_tokens - len(p.prompt_token_ids)
        resolved = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor()).resolve(
            [dr.BytesImageSource(a, detail)], dr.ImageQuota())
        assert adjustments[detail] == resolved.image_token_adjustment()
        out = preprocess_outputs(p)
        (rgb,) = split_pixels(out["image_pixels"], out["image_sizes"])
        info = resolved.images[0]
        assert rgb.shape[:2] == (info.height, info.width)              # the recipe's size too
    assert adjustments == {"low": 201, "high": 991, "auto": 991}


def release_preparer(data, max_side, detail="high"):
    """The preprocess model's image step for the release vision_config."""
    from deepinfer.model.vision import prepare_pixels
    return prepare_pixels(data, VisionArgs(), max_side, detail)


def pre_tokenizer(pre):
    return pre._tokenizer_path


ERRORS = [
    (lambda: chat(chat_image("data:image/png;base64,@@@not-base64@@@")), "Invalid base64"),
    (lambda: chat(chat_image(data_url(b"garbage bytes"))), "not a readable"),
    (lambda: chat(chat_image(data_url(png(40, 40, fmt="BMP"), "image/bmp"))), "unsupported image"),   # the recipe's
    (lambda: chat(chat_image(data_url(png(40, 40, fmt="BMP")))), "unsupported image format BMP"),     # ours
    (lambda: chat(*[chat_image(data_url(png(20, 20, k))) for k in range(3)]), "too many images: 3, at most 2"),
    (lambda: chat(chat_image("https://example.com/cat.png")), "image URLs are not accepted"),
    (lambda: responses("http://example.com/cat.png"), "image URLs are not accepted"),
    (lambda: chat(chat_image(data_url(png(9000, 10)))), "over the limit of 8192 pixels"),
]


@pytest.fixture(scope="module")
def strict(tiny_checkpoint):
    return Preprocessor(tiny_checkpoint / "tokenizer.json", 4096, prepare_image=checkpoint_image_preparer(tiny_checkpoint),
                        image_limits=ImageLimits(max_images=2))


@pytest.mark.parametrize("build,match", ERRORS)
def test_bad_images_are_the_apis_400(strict, build, match):
    p = prepare(strict, build())
    assert p.rejected and p.context.error_status == 400 and p.prompt_token_ids == []
    err = json.loads(p.context.error_body)["error"]
    assert match in err["message"] and err["type"] == "invalid_request_error"


def test_messages_errors_are_anthropic_shaped(strict):
    p = prepare(strict, messages(b"not an image"))
    body = json.loads(p.context.error_body)
    assert p.context.error_status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "not a readable" in body["error"]["message"]


def test_too_many_image_tokens_for_the_context(tiny_checkpoint):
    small = Preprocessor(tiny_checkpoint / "tokenizer.json", 100, prepare_image=checkpoint_image_preparer(tiny_checkpoint))
    p = prepare(small, chat(*[chat_image(data_url(png(600, 500, k))) for k in range(2)], max_tokens=10))
    assert p.rejected and p.context.error_status == 400
    assert "maximum context length" in json.loads(p.context.error_body)["error"]["message"]


def test_text_only_checkpoint_refuses_images(tiny_checkpoint):
    text_only = Preprocessor(tiny_checkpoint / "tokenizer.json", 4096)
    p = prepare(text_only, chat(chat_image(data_url(png(30, 30)))))
    assert p.rejected and "does not accept images" in json.loads(p.context.error_body)["error"]["message"]


@pytest.mark.parametrize("addr,ok", [
    ("93.184.216.34", True), ("2606:2800:220:1:248:1893:25c8:1946", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.5", False), ("172.16.9.9", False),
    ("169.254.169.254", False), ("::1", False), ("fe80::1", False), ("0.0.0.0", False),
    ("::ffff:127.0.0.1", False), ("224.0.0.1", False), ("100.64.0.1", False), ("not-an-ip", False),
])
def test_ssrf_destination_filter(addr, ok):
    assert public_address_only("host", addr) is ok


def test_private_urls_are_refused_when_urls_are_on(tiny_checkpoint):
    on = Preprocessor(tiny_checkpoint / "tokenizer.json", 4096, prepare_image=checkpoint_image_preparer(tiny_checkpoint),
                      image_limits=ImageLimits(allow_image_urls=True))
    for url in ("http://127.0.0.1:9/x.png", "http://10.0.0.1/x.png", "http://169.254.169.254/latest/meta-data"):
        p = prepare(on, chat(chat_image(url)))
        assert p.rejected and p.context.error_status == 400
        assert "private or local address" in json.loads(p.context.error_body)["error"]["message"]


def test_total_image_bytes_limit(tiny_checkpoint):
    small = Preprocessor(tiny_checkpoint / "tokenizer.json", 4096, prepare_image=checkpoint_image_preparer(tiny_checkpoint),
                         image_limits=ImageLimits(max_bytes=5000))
    data = png(64, 64)                                    # ~12 KB of noise as PNG
    p = prepare(small, chat(chat_image(data_url(data))))
    assert p.rejected and p.context.error_status == 400
    assert f"images are {len(data)} bytes in all, over the limit of 5000" in json.loads(p.context.error_body)["error"]["message"]
