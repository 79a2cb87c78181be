"""The aligner (reference inference/vision.py `Aligner`): ViT features -> LLM-width image tokens.

    features [n_h * n_w, vdim] -> [vdim, n_h, n_w] -> zero-pad bottom / right to multiples of r
    -> unfold r x r, stride r: one row per r x r cell in reading order, features ordered
       (c, kh, kw) (torch F.unfold's order), r^2 * vdim wide
    -> w1 (bias) -> exact erf GELU -> w2 (bias) -> [ceil(n_h/r) * ceil(n_w/r), dim]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionArgs
from .vit import VisionLinear


def unfold_cells(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[n_h * n_w, C] -> [ceil(n_h/r) * ceil(n_w/r), C * r * r] (F.unfold order: c, kh, kw)."""
    x = x.view(n_h, n_w, -1).permute(2, 0, 1)                             # [C, n_h, n_w]
    x = F.pad(x, (0, -n_w % r, 0, -n_h % r))
    return F.unfold(x.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)


class Aligner(nn.Module):
    def __init__(self, v: VisionArgs, dim: int):
        super().__init__()
        self.r = v.downsample_ratio
        self.w1 = VisionLinear(v.dim * self.r ** 2, dim, bias=True)
        self.w2 = VisionLinear(dim, dim, bias=True)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """features [N, vdim] of several images concatenated (grids as for ViT) -> [sum of cells, dim]."""
        cells, off = [], 0
        for h, w in grids:
            cells.append(unfold_cells(features[off:off + h * w], h, w, self.r))
            off += h * w
        return self.w2(F.gelu(self.w1(torch.cat(cells))))
