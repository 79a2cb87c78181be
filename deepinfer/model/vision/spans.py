"""Prompt layout with images: each image placeholder id becomes that image's span.

    prompt:  ... t5 t6 [IMG] t7 ...              one placeholder (image_token_id) per image
    tokens:  ... t5 t6 [IMG x span_len] t7 ...   every span position carries image_token_id
    types:   ... -1 -1  0 1 1 .. 1 2 1 .. 2 3 -1 TEXT elsewhere; START, IMAGE, NEW_LINE, END inside

The types drive everything that differs at span positions: the aligner rows and learned vectors
replace the embeddings, the MoE gate picks experts with bias_vl, Engram treats them as DEAD.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from .preprocess import TEXT, ImageInput


@dataclass
class ImagePrompt:
    """A prompt with its image spans laid out (the engine's view of a multimodal request)."""
    token_ids: list[int]
    token_types: np.ndarray          # [len(token_ids)] int8
    images: list[ImageInput]         # in prompt order, .start set
    # set by the engine's ImageEncoder (worker/image_embeds.py) when it encodes ahead of scheduling:
    encoding: bool = False           # submitted: an image a run needs is usable once its embeds exist and `event` fired
    embeds: list | None = None       # [span_len, dim] per image, on the device; None for one not encoded (yet):
                                     # its span lies wholly inside the request's cached prefix, never read
    event: object | None = None      # CUDA event after the latest encode (None: done synchronously)
    asked: set = field(default_factory=set)   # image indices handed to the encoder
    cache_keys: list | None = None   # prefix-cache keys of token_ids (cache/image_keys.py), made on first use
    ahead_key: str | None = None     # rank workers: the key its rank holds its encoded copy by (parallel/image_ahead.py)

    def __getstate__(self) -> dict:
        """To a rank worker: the images, not this process's device embeddings (the worker encodes)."""
        return {**self.__dict__, "encoding": False, "embeds": None, "event": None, "asked": set()}

    def needed(self, start: int) -> list[int]:
        """Indices of the images a run from position `start` reads: spans ending past it. A span
        wholly before it sits in the cached prefix (a replay start never lies inside a span)."""
        return [i for i, im in enumerate(self.images) if im.start + im.span_len > start]

    def missing(self, start: int) -> list[int]:
        """Images a run from `start` reads that have no embeddings yet."""
        return [i for i in self.needed(start) if self.embeds is None or self.embeds[i] is None]

    def ready_from(self, start: int) -> bool:
        """May the scheduler run this prompt's tokens from `start`? (no early encode asked, or the
        images it reads are encoded)"""
        if not self.encoding:
            return True
        return not self.missing(start) and (self.event is None or self.event.query())

    @property
    def ready(self) -> bool:
        return self.ready_from(0)

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(im.start, im.start + im.span_len) for im in self.images]

    @property
    def num_image_tokens(self) -> int:
        return sum(im.span_len for im in self.images)


def expand_image_placeholders(prompt_ids, images: list[ImageInput], image_token_id: int) -> ImagePrompt:
    """Replace the k-th placeholder by the k-th image's span; ValueError when the counts differ."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    where = np.flatnonzero(ids == image_token_id)
    if len(where) != len(images):
        raise ValueError(f"the prompt has {len(where)} image placeholders but {len(images)} images were given")
    pieces, types, placed, prev, shift = [], [], [], 0, 0
    for pos, im in zip(where.tolist(), images):
        im = copy.copy(im)                 # the same image may sit in several prompts
        pieces += [ids[prev:pos], np.full(im.span_len, image_token_id, dtype=np.int64)]
        types += [np.full(pos - prev, TEXT, dtype=np.int8), im.token_types]
        im.start = pos + shift
        placed.append(im)
        shift += im.span_len - 1
        prev = pos + 1
    pieces.append(ids[prev:])
    types.append(np.full(len(ids) - prev, TEXT, dtype=np.int8))
    return ImagePrompt(np.concatenate(pieces).tolist(), np.concatenate(types), placed)
