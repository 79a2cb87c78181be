"""The images of an API request: sources -> original bytes -> planned, padded pixels for the engine.

    RenderedPrompt.image_sources (deepseek-recipe: Chat `image_url`, Responses `input_image`,
    Messages `image` blocks, in placeholder order)
      data URL / bytes  -> decoded here
      http(s) URL       -> only with allow_image_urls; fetched by the recipe's ReqwestImageFetcher
                           behind a destination filter that admits public addresses only (no private,
                           loopback, link-local, multicast or reserved ones, also after redirects)
    -> prepare(bytes, max_side) -> ([H, W, 3] uint8, span_len): decode (PNG / JPEG / GIF / WebP), plan,
       pad; the preprocess model passes deepinfer.model.vision.prepare_pixels bound to the
       checkpoint's VisionArgs (this package stays a leaf: no deepinfer, no torch import)
    -> prompt tokens += sum(span_len - 1)   (the recipe's image_token_adjustment, same plan)

Pixels are made from the ORIGINAL bytes with the reference's image_processor.py semantics; the
recipe's own resolver (OpenCV resize + lossy WebP re-encode) is not used for pixels. Its sizes and
adjustment agree with ours except at extreme aspect ratios (tests/model/test_vision_preprocess.py);
`detail` is the recipe's: "low" caps the original's long side at 512 px before the plan (fewer
tokens), as deepseek-recipe does (deepinfer.model.vision.preprocess.detail_size).

Every failure is the API's own 400 (RecipeError), raised before anything reaches the engine.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import urllib.parse
from dataclasses import dataclass

import numpy as np

from .errors import RecipeError, api_error


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 16                  # per request
    max_bytes: int = 20 << 20             # encoded bytes per request (all images)
    max_side: int = 8192                  # pixels per side of an original image
    allow_image_urls: bool = False        # http(s) image URLs (fetched by the server: SSRF filtered)


@dataclass
class RequestImages:
    """What the engine gets besides the prompt ids: one pixel array per placeholder, in order."""
    pixels: list[np.ndarray]              # [H, W, 3] uint8 each, planned and padded
    span_lens: list[int]

    @property
    def token_adjustment(self) -> int:
        return sum(n - 1 for n in self.span_lens)

    def contract_values(self) -> dict:
        """image_pixels (all images' bytes, row-major HWC, concatenated) and image_sizes [h0, w0, h1, ..]."""
        flat = np.concatenate([p.reshape(-1) for p in self.pixels]) if self.pixels else np.zeros(0, np.uint8)
        sizes = [d for p in self.pixels for d in p.shape[:2]]
        return {"image_pixels": flat, "image_sizes": sizes}


def public_address_only(host: str, address: str) -> bool:
    """The SSRF destination filter: connect only to globally routable addresses."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def decode_data_url(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise ValueError("not a data URL")
    if head.endswith(";base64"):
        return base64.b64decode(payload, validate=True)
    return urllib.parse.unquote_to_bytes(payload)


class ImageStage:
    """One per preprocess instance: the checkpoint's image preparation plus the request limits."""

    def __init__(self, prepare=None, limits: ImageLimits | None = None):
        # prepare(bytes, max_side, detail) -> (pixels, span_len), raising ValueError; None = text-only checkpoint
        self.prepare = prepare
        self.limits = limits or ImageLimits()
        self._fetcher = None

    def resolve(self, api: str, sources) -> RequestImages:
        if not sources:
            return RequestImages([], [])
        if self.prepare is None:
            raise api_error(api, 400, "this model does not accept images (the checkpoint has no vision tower)")
        if len(sources) > self.limits.max_images:
            raise api_error(api, 400, f"too many images: {len(sources)}, at most {self.limits.max_images} "
                            "per request")
        datas = [self._bytes(api, s) for s in sources]
        total = sum(len(d) for d in datas)
        if total > self.limits.max_bytes:
            raise api_error(api, 400, f"images are {total} bytes in all, over the limit of {self.limits.max_bytes}")
        return self._plan(api, sources, datas)

    def _bytes(self, api: str, src) -> bytes:
        where = getattr(src, "path", "") or "image"
        try:
            if src.kind == "data_url":
                return decode_data_url(src.data_url)
            if src.data is not None:
                return bytes(src.data)
        except (ValueError, binascii.Error) as e:
            raise api_error(api, 400, f"{where}: the image data URL is not valid base64 ({e})") from None
        url = src.url or ""
        if not url.startswith(("http://", "https://")):
            raise api_error(api, 400, f"{where}: unsupported image URL {url[:60]!r}: use a data URL, base64 or http(s)")
        if not self.limits.allow_image_urls:
            raise api_error(api, 400, f"{where}: image URLs are not accepted by this server (allow_image_urls is "
                            "off); send the image as a base64 data URL")
        return self._fetch(api, where, url)

    def _fetch(self, api: str, where: str, url: str) -> bytes:
        import deepseek_recipe as dr
        if self._fetcher is None:
            self._fetcher = dr.ReqwestImageFetcher.with_max_bytes(self.limits.max_bytes) \
                .with_destination_filter(public_address_only)
        try:
            return bytes(self._fetcher.fetch(url))
        except dr.ImageError as e:
            kind = getattr(e, "kind", "")
            if kind == "DestinationRejected":
                raise api_error(api, 400, f"{where}: image URL {url[:80]!r} points to a private or local "
                                "address, which this server does not fetch") from None
            raise api_error(api, 400, f"{where}: could not fetch image URL {url[:80]!r} ({kind or e})") from None

    def _plan(self, api: str, sources, datas) -> RequestImages:
        pixels, spans = [], []
        for src, data in zip(sources, datas):
            try:
                rgb, span_len = self.prepare(data, self.limits.max_side, getattr(src, "detail", None) or "high")
            except ValueError as e:
                raise api_error(api, 400, f"{getattr(src, 'path', '') or 'image'}: {e}") from None
            pixels.append(rgb)
            spans.append(span_len)
        return RequestImages(pixels, spans)


def image_placeholder(tokenizer_json, image_token_id: int) -> str | None:
    """How the checkpoint's tokenizer spells the image token (release: <｜deepseek_image｜>; the V4
    file our generator writes: <｜image2｜>); the recipe's default <｜image｜> is another id."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_json)).id_to_token(image_token_id)


__all__ = ["ImageLimits", "ImageStage", "RecipeError", "RequestImages", "decode_data_url", "image_placeholder",
           "public_address_only"]
