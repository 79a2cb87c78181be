"""VisionTower: ViT + aligner + the three learned span vectors; images -> span embeddings.

    encode([img_0, img_1, ...]) -> [[span_len_0, dim], [span_len_1, dim], ...] bf16

One ViT pass and one aligner pass over all the images given (several requests' images batched);
each span then takes the aligner rows at its IMAGE slots in reading order and the learned
`image_start` / `image_newline` / `image_end` vectors at its delimiters (reference model.py
`merge_image_embeddings`). The model writes the span rows over the token embeddings before the hc
expansion (Transformer.forward).

The pass never makes the host wait on the GPU (the engine's ImageEncoder runs it on its own stream
from the thread that launches the decode steps; a wait there would hold the next step back until the
whole tower had run): patches go up from pinned memory without blocking, the rope table is made on
the device, and the spans are one gather by a host-made index (a boolean-mask assignment would read
the mask's count back from the GPU). Images are ordered by patch count for the ViT, so images of one
size share one attention call.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .aligner import Aligner
from .config import VisionArgs
from .preprocess import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageInput
from .vit import ACT, ViT


class VisionTower(nn.Module):
    def __init__(self, v: VisionArgs, dim: int):
        super().__init__()
        self.args = v
        self.vit = ViT(v)
        self.aligner = Aligner(v, dim)
        for name in ("image_start", "image_end", "image_newline"):
            self.register_buffer(name, torch.empty(dim), persistent=False)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        if not images:
            return []
        dev = self.image_start.device
        order = sorted(range(len(images)), key=lambda i: images[i].patches.shape[0])   # same sizes together
        ordered = [images[i] for i in order]
        grids = [(im.plan.n_vit_h, im.plan.n_vit_w) for im in ordered]
        patches = _to_device(ordered, dev)
        rows = self.aligner(self.vit(patches, grids), grids)                  # [sum n_llm_h * n_llm_w, dim]
        index, lens, off = [], {}, 0
        n_rows = rows.shape[0]
        for im in ordered:
            index.append(span_gather_index(im.token_types, off, n_rows))
            lens[id(im)] = len(im.token_types)
            off += im.plan.n_llm_h * im.plan.n_llm_w
        table = torch.cat([rows.to(ACT), torch.stack([self.image_start, self.image_end, self.image_newline]).to(ACT)])
        flat = table[_host_to(np.concatenate(index), dev)]                    # every span, one gather
        by_image = dict(zip((id(im) for im in ordered), flat.split([lens[id(im)] for im in ordered])))
        return [by_image[id(im)] for im in images]

    def span_embeddings(self, types: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """types [L] (IMAGE_START / IMAGE / IMAGE_NEW_LINE / IMAGE_END), rows [#IMAGE, dim] -> [L, dim]
        (one image; encode gathers all spans at once the same way)."""
        table = torch.cat([rows.to(ACT), torch.stack([self.image_start, self.image_end, self.image_newline]).to(ACT)])
        idx = span_gather_index(types.cpu().numpy(), 0, rows.shape[0])
        return table[_host_to(idx, rows.device)]


def span_gather_index(types: np.ndarray, row_offset: int, n_rows: int) -> np.ndarray:
    """A span's rows in [aligner rows (all images) | start | end | newline]: IMAGE slots take this
    image's rows from row_offset in reading order, the delimiters their learned vectors."""
    types = np.asarray(types)
    idx = np.empty(len(types), np.int64)
    image = types == IMAGE
    idx[image] = row_offset + np.arange(int(image.sum()))
    idx[types == IMAGE_START] = n_rows
    idx[types == IMAGE_END] = n_rows + 1
    idx[types == IMAGE_NEW_LINE] = n_rows + 2
    return idx


def _host_to(arr: np.ndarray, dev: torch.device) -> torch.Tensor:
    """A host array on dev without a blocking copy (pinned staging on CUDA)."""
    t = torch.from_numpy(arr)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _to_device(images: list[ImageInput], dev: torch.device) -> torch.Tensor:
    """All images' patches, concatenated, on dev (on CUDA through a pinned buffer: non-blocking)."""
    if dev.type != "cuda":
        return torch.cat([im.patches for im in images]).to(dev)
    first = images[0].patches
    buf = torch.empty((sum(im.patches.shape[0] for im in images), *first.shape[1:]), dtype=first.dtype,
                      pin_memory=True)
    torch.cat([im.patches for im in images], out=buf)
    return buf.to(dev, non_blocking=True)
