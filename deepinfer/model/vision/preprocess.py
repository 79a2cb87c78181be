"""Image bytes -> ViT patches, following the reference's inference/image_processor.py.

    plan:    RGB; an image under min_pixels is scaled up to that area (sides int-truncated); sides
             rounded up to multiples of the patch; if the span would pass max_n_token, the largest
             aspect-preserving size whose span fits (solve_resize_ratio)
    pixels:  PIL ImageOps.pad to the planned size (aspect-preserving bicubic fit, centred, gray 127
             fill), or a plain resize for images wider than max_wh_ratio (off in the release)
    values:  (x / 255 - 0.5) / 0.5 in fp32, then bf16
    patches: [n_vit_h * n_vit_w, 3, p, p] in reading order, each (c, y, x)

The LLM sees n_llm_h x n_llm_w tokens (the 3x3 aligner unfold, ceil), laid out as

    [START] + ([IMAGE] * n_llm_w + [NEW_LINE]) * n_llm_h + [END]       (span_len tokens)

Examples (release limits): 1024x701 -> 1036x714 px, 74x51 patches, 25x17 tokens, span 444; the
largest square 1302x1302 -> 93x93 patches -> 31x31 tokens -> span 994.

The recipe (deepseek-recipe's OpenCvImagePreprocessor) produces the same sizes but re-encodes the
resized image as lossy WebP; the engine preprocesses the ORIGINAL bytes here, so its pixels are the
reference's (the recipe is used for counting tokens only).

`detail` (an OpenAI image part's "low" / "high" / "auto" / "original"): the reference has no such
notion, but the official recipe applies "low" before the plan, and its token counts are the API's:
an original whose long side passes 512 px is first scaled down so that side is 512 (the other side
rounded half up, at least 1 px), then planned as usual (so a big photo becomes ~200 tokens instead of
up to 1024; measured against deepseek-recipe 0.2.0 on 126 sizes: equal but where its plan differs
from the reference's anyway, e.g. 22x512). "high", "auto" and "original" are the plain plan there.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import VisionArgs

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)

FORMATS = ("PNG", "JPEG", "GIF", "WEBP")       # what the recipe accepts too (BMP and others rejected)
MAX_SIDE = 8192                                # the recipe's default per-side limit
LOW_DETAIL_MAX_SIDE = 512                      # the recipe's long-side cap for detail "low"
DETAILS = ("low", "high", "auto", "original")  # deepseek-recipe's ImageDetail


class ImageError(ValueError):
    """An image the engine cannot use (corrupt, unsupported format, too large): a 400 to its caller."""


@dataclass(frozen=True)
class ImagePlan:
    """Pixel size and grids of one image (a pure function of its original size and the limits)."""
    width: int
    height: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def span_len(self) -> int:
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


@dataclass
class ImageInput:
    """One preprocessed image: what the engine needs to encode it and lay out its span."""
    patches: torch.Tensor            # [n_vit_h * n_vit_w, 3, p, p] bf16
    plan: ImagePlan
    content_hash: str = ""           # sha256 of the original bytes (cache keys)
    start: int = -1                  # position of the span's first token in the prompt (set by expand)
    token_types: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_types = span_token_types(self.plan.n_llm_h, self.plan.n_llm_w)

    @property
    def span_len(self) -> int:
        return self.plan.span_len

    def __getstate__(self) -> dict:
        """Patches pickle by value (bf16 bits as int16): the engine hands requests to rank worker
        processes over plain pipes, where torch's shared-memory tensor pickling does not reach."""
        state = dict(self.__dict__)
        p = self.patches.detach().cpu()
        state["patches"] = (p.view(torch.int16).numpy() if p.dtype == torch.bfloat16 else p.numpy(), str(p.dtype))
        return state

    def __setstate__(self, state: dict) -> None:
        arr, dtype = state["patches"]
        t = torch.from_numpy(arr)
        state["patches"] = t.view(torch.bfloat16) if dtype == str(torch.bfloat16) else t
        self.__dict__.update(state)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_token_types(n_llm_h: int, n_llm_w: int) -> np.ndarray:
    """[span_len] int8: START, then each row's IMAGE tokens and a NEW_LINE, then END."""
    row = np.array([IMAGE] * n_llm_w + [IMAGE_NEW_LINE], dtype=np.int8)
    return np.concatenate([[IMAGE_START], np.tile(row, n_llm_h), [IMAGE_END]]).astype(np.int8)


def _llm_grid(height: int, width: int, v: VisionArgs) -> tuple[int, int]:
    r = v.downsample_ratio
    return math.ceil(height // v.patch_size / r), math.ceil(width // v.patch_size / r)


def _fit_size(height: float, width: float, v: VisionArgs) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose span fits max_n_token (the span is
    n_h * (n_w + 1) + 2, solved for n_w with n_h = n_w * height / width)."""
    aspect = height / width
    max_w = math.sqrt((v.max_n_token - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    cell = v.patch_size * v.downsample_ratio
    if max_w < 1.0:                      # very tall: one column
        return (v.max_n_token - 2) // 2 * cell, cell
    if max_h < 1.0:                      # very wide: one row
        return cell, (v.max_n_token - 3) * cell
    scale = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    p = v.patch_size
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_image(width: int, height: int, v: VisionArgs) -> ImagePlan:
    """The reference's plan_image_grid for an image of this original size."""
    p = v.patch_size
    w, h = width, height
    if v.max_wh_ratio is not None and w > h * v.max_wh_ratio:
        w = h * v.max_wh_ratio
    if 0 < w * h < v.min_pixels:
        up = (v.min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    ph, pw = math.ceil(h / p) * p, math.ceil(w / p) * p
    n_h, n_w = _llm_grid(ph, pw, v)
    if num_image_tokens(n_h, n_w) > v.max_n_token:
        ph, pw = _fit_size(h, w, v)
        n_h, n_w = _llm_grid(ph, pw, v)
        assert num_image_tokens(n_h, n_w) <= v.max_n_token
    return ImagePlan(pw, ph, ph // p, pw // p, n_h, n_w)


def detail_size(width: int, height: int, detail: str = "high") -> tuple[int, int]:
    """The original size the plan starts from: for "low", the long side capped at 512 as the recipe
    does (aspect kept, the other side rounded half up, at least 1 px); the original size otherwise."""
    if detail not in DETAILS:
        raise ImageError(f"image detail {detail!r} is not one of {', '.join(DETAILS)}")
    long_side = max(width, height)
    if detail != "low" or long_side <= LOW_DETAIL_MAX_SIDE:
        return width, height
    s = LOW_DETAIL_MAX_SIDE / long_side
    return max(1, math.floor(width * s + 0.5)), max(1, math.floor(height * s + 0.5))


def apply_detail(img, detail: str = "high"):
    """The decoded RGB image as the plan sees it: scaled down (bicubic, antialiased) for "low"."""
    from PIL import Image
    size = detail_size(img.width, img.height, detail)
    return img if size == img.size else img.resize(size, Image.Resampling.BICUBIC)


def decode_image(data: bytes, max_side: int = MAX_SIDE):
    """Bytes -> RGB PIL image; ImageError for corrupt data, other formats and oversized images."""
    from PIL import Image, UnidentifiedImageError
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError("image data is empty")
    try:
        with Image.open(io.BytesIO(data)) as src:
            fmt = src.format
            if fmt not in FORMATS:
                raise ImageError(f"unsupported image format {fmt}: use PNG, JPEG, GIF or WebP")
            if max(src.size) > max_side:
                raise ImageError(f"image of {src.size[0]}x{src.size[1]} pixels is over the limit of "
                                 f"{max_side} pixels per side")
            return src.convert("RGB")
    except UnidentifiedImageError:
        raise ImageError("image data is not a readable PNG, JPEG, GIF or WebP image") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"corrupt image: {e}") from None


def padded_rgb(img, plan: ImagePlan, v: VisionArgs) -> np.ndarray:
    """RGB PIL image -> [H, W, 3] uint8 at the planned size (the pixels the ensemble carries)."""
    from PIL import ImageOps
    size = (plan.width, plan.height)
    if v.max_wh_ratio is not None and img.width >= v.max_wh_ratio * img.height:
        img = img.resize(size)
    else:
        img = ImageOps.pad(img, size, color=(127, 127, 127))
    return np.asarray(img, dtype=np.uint8)


def to_patches(rgb: np.ndarray, plan: ImagePlan, p: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> (x / 255 - 0.5) / 0.5 in fp32, bf16 -> [n_vit_h * n_vit_w, 3, p, p] in reading order."""
    rgb = np.ascontiguousarray(rgb) if rgb.flags.writeable else rgb.copy()    # views of a request's bytes are read-only
    x = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    x = x.reshape(3, plan.n_vit_h, p, plan.n_vit_w, p)                   # [c, gy, y, gx, x]
    return x.permute(1, 3, 0, 2, 4).reshape(plan.n_vit_h * plan.n_vit_w, 3, p, p).contiguous()


def load_image(data: bytes, v: VisionArgs, max_side: int = MAX_SIDE, detail: str = "high") -> ImageInput:
    """Original image bytes -> ImageInput (decode, detail, plan, pad, normalize, patches)."""
    original = decode_image(data, max_side)
    img = apply_detail(original, detail)
    plan = plan_image(img.width, img.height, v)
    return ImageInput(to_patches(padded_rgb(img, plan, v), plan, v.patch_size), plan,
                      content_hash(data, None if img is original else img.size))


def content_hash(data: bytes, scaled_to: tuple[int, int] | None = None) -> str:
    """sha256 of the original bytes, plus the size when detail scaled them down (other pixels, other
    embeddings: the encoder's dedup and the prefix cache must not take one for the other)."""
    h = hashlib.sha256(data)
    if scaled_to is not None:
        h.update(f"|detail {scaled_to[0]}x{scaled_to[1]}".encode())
    return h.hexdigest()


def prepare_pixels(data: bytes, v: VisionArgs, max_side: int = MAX_SIDE,
                   detail: str = "high") -> tuple[np.ndarray, int]:
    """Original bytes -> (planned, padded [H, W, 3] uint8 pixels, span length): the preprocess
    model's part (image_from_pixels is the engine's). ImageError on bad images."""
    img = apply_detail(decode_image(data, max_side), detail)
    plan = plan_image(img.width, img.height, v)
    return padded_rgb(img, plan, v), plan.span_len


def padded_plan(width: int, height: int, v: VisionArgs) -> ImagePlan:
    """The plan of an image already planned and padded to width x height: its grids follow from the size.
    ImageError when the size is not a planned one."""
    p, r = v.patch_size, v.downsample_ratio
    if height % p or width % p or not height or not width:
        raise ImageError(f"image of {width}x{height} pixels: sides must be positive multiples of {p}")
    plan = ImagePlan(width, height, height // p, width // p, -(-(height // p) // r), -(-(width // p) // r))
    if plan.span_len > v.max_n_token:
        raise ImageError(f"image of {width}x{height} pixels takes {plan.span_len} tokens, over {v.max_n_token}")
    return plan


def image_from_pixels(rgb: np.ndarray, v: VisionArgs) -> ImageInput:
    """[H, W, 3] uint8 already planned and padded (padded_rgb, e.g. made by the preprocess model) ->
    ImageInput; the grids follow from the size. ImageError when the size is not a planned one."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ImageError(f"image pixels must be [H, W, 3] uint8, got {list(rgb.shape)} {rgb.dtype}")
    h, w, _ = rgb.shape
    plan = padded_plan(w, h, v)
    return ImageInput(to_patches(rgb, plan, v.patch_size), plan, hashlib.sha256(rgb.tobytes()).hexdigest())


def check_image_input(im: ImageInput, v: VisionArgs) -> ImageInput:
    """An ImageInput made by a caller: its grids follow from its size and its patches fit them
    (ImageError otherwise; the tower would fail on it at encode time, beside other requests)."""
    plan, p = im.plan, v.patch_size
    if padded_plan(plan.width, plan.height, v) != plan:
        raise ImageError(f"an ImageInput's plan {plan} is not this checkpoint's plan of a "
                         f"{plan.width}x{plan.height} image")
    shape = (plan.n_vit_h * plan.n_vit_w, 3, p, p)
    if not isinstance(im.patches, torch.Tensor) or tuple(im.patches.shape) != shape \
            or not im.patches.dtype.is_floating_point:
        got = tuple(im.patches.shape) if isinstance(im.patches, torch.Tensor) else type(im.patches).__name__
        raise ImageError(f"an ImageInput's patches must be a float tensor of shape {shape}, got {got}")
    return im


def checkpoint_image_preparer(checkpoint):
    """prepare(bytes, max_side, detail) -> (pixels, span_len) for this checkpoint's vision_config (the
    preprocess model's ImageStage); None for a text-only checkpoint."""
    import json
    from pathlib import Path
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    v = VisionArgs.from_hf(cfg.get("vision_config"), cfg.get("image_token_id", 129264))
    if v is None:
        return None
    return lambda data, max_side=MAX_SIDE, detail="high": prepare_pixels(data, v, max_side, detail)
