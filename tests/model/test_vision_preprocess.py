"""Image preprocessing (reference inference/image_processor.py) on real PNG / JPEG / GIF / WebP files
made here with Pillow: the patch grid, span length and token count against the reference's worked
examples and against deepseek-recipe's own resolver (an independent, Rust/OpenCV implementation of
the same plan), the pixels against a direct PIL computation, and the errors bad files get."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from deepinfer.model.vision import ImageError, VisionArgs, load_image, plan_image

RELEASE = VisionArgs()


def encode(w: int, h: int, fmt: str, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    arr[: h // 2, : w // 2] = [200, 30, 60]        # some structure, so JPEG keeps edges
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def test_reference_worked_examples():
    p = plan_image(1024, 701, RELEASE)
    assert (p.width, p.height, p.n_vit_h, p.n_vit_w, p.n_llm_h, p.n_llm_w, p.span_len) == (1036, 714, 51, 74, 17, 25, 444)
    p = plan_image(1302, 1302, RELEASE)                # the largest square that fits
    assert (p.n_vit_h, p.n_llm_h, p.n_llm_w, p.span_len) == (93, 31, 31, 994)
    p = plan_image(100, 100, RELEASE)                  # small images scale up to 544^2 of area
    assert (p.width, p.height) == (546, 546) and p.span_len == 184
    for w, h in [(4000, 3000), (8000, 100), (100, 8000), (5000, 5000)]:
        assert plan_image(w, h, RELEASE).span_len <= RELEASE.max_n_token


SIZES = [(640, 480), (300, 200), (1024, 701), (2000, 1000), (100, 1000), (37, 513), (3000, 40), (1, 1)]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("w,h", SIZES)
def test_grid_span_and_count_equal_the_recipes(w, h, fmt):
    """The recipe's resolved size and image_token_adjustment (span - 1) for the same bytes."""
    dr = pytest.importorskip("deepseek_recipe")
    data = encode(w, h, fmt)
    im = load_image(data, RELEASE)
    p = im.plan
    assert im.patches.shape == (p.n_vit_h * p.n_vit_w, 3, 14, 14) and im.patches.dtype == torch.bfloat16
    assert (p.n_vit_h, p.n_vit_w) == (p.height // 14, p.width // 14)
    assert (p.n_llm_h, p.n_llm_w) == (-(-p.n_vit_h // 3), -(-p.n_vit_w // 3))
    assert p.span_len == p.n_llm_h * (p.n_llm_w + 1) + 2 == len(im.token_types)
    mm = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor()).resolve(
        [dr.BytesImageSource(data)], dr.ImageQuota())
    assert (mm.images[0].width, mm.images[0].height) == (p.width, p.height)
    assert mm.image_token_adjustment() == p.span_len - 1


LOW_SIZES = [(640, 480), (2000, 1000), (1000, 333), (333, 1000), (777, 555), (1234, 567), (4000, 37),
             (1001, 999), (513, 100), (511, 300), (2000, 3)]


@pytest.mark.parametrize("w,h", LOW_SIZES)
def test_low_detail_equals_the_recipes(w, h):
    """detail "low": the recipe caps the long side at 512 before its plan (sizes at the cap or under
    it are unchanged); our plan of the capped size and the span equal the recipe's resolved low image."""
    dr = pytest.importorskip("deepseek_recipe")
    y, x = np.mgrid[0:h, 0:w]
    buf = io.BytesIO()
    Image.fromarray(np.stack([x % 256, y % 256, (x * y) % 256], -1).astype(np.uint8)).save(buf, "PNG")
    data = buf.getvalue()
    low, high = load_image(data, RELEASE, detail="low"), load_image(data, RELEASE, detail="high")
    mm = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor()).resolve(
        [dr.BytesImageSource(data, "low")], dr.ImageQuota())
    assert (mm.images[0].width, mm.images[0].height) == (low.plan.width, low.plan.height)
    assert mm.image_token_adjustment() == low.span_len - 1
    assert low.span_len <= high.span_len and low.patches.shape[0] == low.plan.n_vit_h * low.plan.n_vit_w
    # the encoder's dedup / prefix-cache key: the same bytes in low detail are other pixels
    assert (low.content_hash == high.content_hash) == (max(w, h) <= 512)


def test_unknown_detail_is_an_image_error():
    with pytest.raises(ImageError, match="detail 'tiny'"):
        load_image(encode(20, 20, "PNG"), RELEASE, detail="tiny")


def test_where_the_recipe_differs_extreme_aspect():
    """1x4000 and 4000x1 (KVCACHE_VISION.md): the recipe caps a side at 16380 px, the reference's
    plan does not; the engine follows the reference (its span is what the model was trained on)."""
    dr = pytest.importorskip("deepseek_recipe")
    for w, h in [(1, 4000), (4000, 1)]:
        data = encode(w, h, "PNG")
        mm = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor()).resolve(
            [dr.BytesImageSource(data)], dr.ImageQuota())
        p = load_image(data, RELEASE).plan
        assert mm.image_token_adjustment() != p.span_len - 1
        assert p.span_len <= RELEASE.max_n_token


@pytest.mark.parametrize("w,h,fmt", [(300, 200, "PNG"), (97, 610, "JPEG"), (700, 120, "WEBP"), (50, 60, "GIF")])
def test_pixels_are_the_padded_image_in_patch_order(w, h, fmt):
    data = encode(w, h, fmt, seed=3)
    im = load_image(data, RELEASE)
    p = im.plan
    rgb = Image.open(io.BytesIO(data)).convert("RGB")
    padded = np.asarray(ImageOps.pad(rgb, (p.width, p.height), color=(127, 127, 127)), dtype=np.float32)
    want = torch.from_numpy((padded / 255 - 0.5) / 0.5).to(torch.bfloat16)          # [H, W, 3]
    for k in [0, 1, p.n_vit_w, p.n_vit_h * p.n_vit_w - 1]:
        gy, gx = divmod(k, p.n_vit_w)
        tile = want[gy * 14:(gy + 1) * 14, gx * 14:(gx + 1) * 14].permute(2, 0, 1)  # (c, y, x)
        assert torch.equal(im.patches[k], tile)


def test_padding_is_gray_127():
    """A tall image is fitted by height, centred, with gray bars left and right."""
    data = encode(40, 400, "PNG")
    im = load_image(data, RELEASE)
    gray = torch.tensor((127 / 255 - 0.5) / 0.5).to(torch.bfloat16)
    # 40x400 scales up to 172x1720 and pads to 182x1722: 5 gray columns on each side
    assert torch.all(im.patches[0][:, :, :4] == gray) and torch.all(im.patches[im.plan.n_vit_w - 1][:, :, -4:] == gray)
    assert not torch.all(im.patches[0][:, :, 6:] == gray)


def test_same_bytes_same_hash_and_patches():
    a, b = load_image(encode(120, 90, "PNG"), RELEASE), load_image(encode(120, 90, "PNG"), RELEASE)
    c = load_image(encode(120, 90, "PNG", seed=1), RELEASE)
    assert a.content_hash == b.content_hash != c.content_hash
    assert torch.equal(a.patches, b.patches)


@pytest.mark.parametrize("data,match", [
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not a readable|corrupt"),
    (b"definitely not an image", "not a readable"),
    (b"", "empty"),
])
def test_corrupt_images_are_image_errors(data, match):
    with pytest.raises(ImageError, match=match):
        load_image(data, RELEASE)


def test_truncated_png_is_an_image_error():
    data = encode(200, 200, "PNG")
    with pytest.raises(ImageError, match="corrupt"):
        load_image(data[: len(data) // 2], RELEASE)


def test_unsupported_format_and_size_limit():
    with pytest.raises(ImageError, match="unsupported image format BMP"):
        load_image(encode(20, 20, "BMP"), RELEASE)
    with pytest.raises(ImageError, match="over the limit of 100 pixels"):
        load_image(encode(120, 20, "PNG"), RELEASE, max_side=100)
