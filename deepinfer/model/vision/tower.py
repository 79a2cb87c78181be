"""VisionTower: ViT + aligner + the three learned span vectors; images -> span embeddings.

    encode([img_0, img_1, ...]) -> [[span_len_0, dim], [span_len_1, dim], ...] bf16

One ViT pass and one aligner pass over all the images given (several requests' images batched);
each span then takes the aligner rows at its IMAGE slots in reading order and the learned
`image_start` / `image_newline` / `image_end` vectors at its delimiters (reference model.py
`merge_image_embeddings`). The model writes the span rows over the token embeddings before the hc
expansion (Transformer.forward).
"""

from __future__ import annotations

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
        grids = [(im.plan.n_vit_h, im.plan.n_vit_w) for im in images]
        patches = torch.cat([im.patches for im in images]).to(dev, non_blocking=True)
        rows = self.aligner(self.vit(patches, grids), grids)                  # [sum n_llm_h * n_llm_w, dim]
        spans, off = [], 0
        for im in images:
            n = im.plan.n_llm_h * im.plan.n_llm_w
            spans.append(self.span_embeddings(torch.from_numpy(im.token_types).to(dev), rows[off:off + n]))
            off += n
        return spans

    def span_embeddings(self, types: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """types [L] (IMAGE_START / IMAGE / IMAGE_NEW_LINE / IMAGE_END), rows [#IMAGE, dim] -> [L, dim]."""
        span = torch.empty(types.numel(), rows.shape[-1], dtype=ACT, device=rows.device)
        span[types == IMAGE_START] = self.image_start.to(ACT)
        span[types == IMAGE_END] = self.image_end.to(ACT)
        span[types == IMAGE_NEW_LINE] = self.image_newline.to(ACT)
        span[types == IMAGE] = rows.to(ACT)
        return span
