"""Cache keys of a prompt with images: what the prefix cache hashes instead of the token ids.

Every position of an image span carries the same id (image_token_id), so token ids alone would
let two prompts with different images share blocks. The prefix cache therefore keys a position by

    text position        its token id (>= 0)
    image-span position  a negative 63-bit number from the image's content key and the offset in
                         its span: -1 - (BLAKE2b(content key, offset) mod 2**62)

and hashes blocks (block_hash.py chain) and matches window-snapshot tails over these keys. The
content key is a digest of what the model sees of the image (its ViT patches, bf16 bits, and the
span's grid), so the same picture sent as bytes or as pixels keys the same, and two requests
with the same image hit each other's blocks while a different image never does.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def image_content_key(im) -> bytes:
    """16-byte digest of an ImageInput's patches (their bits) and span grid (deepinfer.model.vision)."""
    p = im.patches.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer-image")
    h.update(np.asarray([im.plan.n_llm_h, im.plan.n_llm_w, *p.shape], dtype=np.int64).tobytes())
    h.update(p.view(torch.uint8).numpy().tobytes())
    return h.digest()


def span_keys(content_key: bytes, span_len: int) -> np.ndarray:
    """[span_len] int64, all negative: the cache key of each position of one image span."""
    out = np.empty(span_len, dtype=np.int64)
    for off in range(span_len):
        d = hashlib.blake2b(content_key + off.to_bytes(4, "little"), digest_size=8).digest()
        out[off] = -1 - (int.from_bytes(d, "little") >> 2)
    return out


def prompt_cache_keys(image_prompt) -> list[int]:
    """The cache keys of an ImagePrompt's tokens (memoized on it: a prompt is hashed many times)."""
    keys = getattr(image_prompt, "cache_keys", None)
    if keys is None:
        arr = np.asarray(image_prompt.token_ids, dtype=np.int64).copy()
        for im in image_prompt.images:
            arr[im.start:im.start + im.span_len] = span_keys(image_content_key(im), im.span_len)
        keys = image_prompt.cache_keys = arr.tolist()
    return keys


def request_cache_keys(req) -> list[int]:
    """The cache keys of a Request's tokens (prompt + output): its token ids when it has no image."""
    if req.image_prompt is None:
        return req.all_token_ids
    keys = prompt_cache_keys(req.image_prompt)
    return keys + req.all_token_ids[len(keys):]
