"""The ViT of the V4.1 vision tower (reference inference/vision.py `ViT`), run over many images at once.

    patches [N, 3, p, p] -> patch_embed (Linear 3p^2 -> dim, bias; no conv, no CLS, no absolute
    positions) -> n_layers pre-norm blocks -> RMSNorm -> [N, dim]

    block:  x += wo(attn(rope2d(q), rope2d(k), v))   wqkv dim -> 3 dim (bias) = [q | k | v], heads
                                                      contiguous; full bidirectional attention
                                                      within one image, scale head_dim^-0.5
            x += w2(silu(gate) * up)                  w1 dim -> 2 inter = [gate | up] (no bias)
    RMSNorm eps 1e-6 in fp32; activations bf16 between ops.

2D RoPE: inv_freq = theta^(-arange(0, rope_dim, 2) / rope_dim) (rope_dim = head_dim / 2 entries per
axis / 2); a patch at grid (h, w) has phases [h * inv_freq | w * inv_freq]; rotate-half (x1, x2 the
two halves of the head) in fp32: [x1 cos - x2 sin | x2 cos + x1 sin].

Many images (of several requests) run as one flat sequence: every Linear sees all their patches,
attention runs image by image (cu_seqlens), so an image's features do not depend on the others
beyond GEMM blocking (batch-invariant mode removes that too).

Speed (the fast path; tests/model/test_vision.py holds it to loop references): q, k and v come out of
the one fused wqkv GEMM and stay views of it; q and k turn in one fp32 rope pass; attention is one
4-D SDPA call per run of consecutive images with the same patch count ([B, H, L, hd] views, no
copies), which is what lets torch pick its flash / memory-efficient kernel on CUDA (a 3-D call falls
back to the math kernel, which writes the [H, L, L] score matrix: ~10x slower on a photo). The rope
table is made on the patches' device, so a pass never copies from the host or waits on the GPU.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model import ops

from .config import VisionArgs

ACT = torch.bfloat16


class VisionLinear(nn.Module):
    """y = x W^T (+ b), bf16 out. Buffers (not Parameters), so the loader can place any dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features), persistent=False)
        self.register_buffer("bias", torch.empty(out_features) if bias else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        b = None if self.bias is None else self.bias.to(w.dtype)
        return F.linear(x.to(w.dtype), w, b).to(ACT)


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * (x * rsqrt(mean(x^2) + eps)) in fp32, rounded once (the reference's order): the
        model's RMSNorm op (kernels/select.py: one Triton kernel on the GPU, the torch reference
        rms_norm_ref elsewhere), where the spelled-out form is six kernels."""
        return ops.rms_norm(x, self.weight, self.eps)


@lru_cache(16)
def rope_2d_table(n_h: int, n_w: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [n_h * n_w, 1, rope_dim] fp32 for one patch grid in reading order (CPU)."""
    return rope_2d_tables([(n_h, n_w)], rope_dim, theta, torch.device("cpu"))


def rope_2d_tables(grids: list[tuple[int, int]], rope_dim: int, theta: float,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [sum n_h * n_w, 1, rope_dim] fp32 of several grids, computed on `device` (no host
    copy: the encoder's pass must not wait on the GPU)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    hh, ww = [], []
    for n_h, n_w in grids:
        rows = torch.arange(n_h, dtype=torch.float32, device=device)
        cols = torch.arange(n_w, dtype=torch.float32, device=device)
        hh.append(rows[:, None].expand(n_h, n_w).reshape(-1))           # each patch's row, reading order
        ww.append(cols[None, :].expand(n_h, n_w).reshape(-1))           # and column
    hh, ww = torch.cat(hh), torch.cat(ww)
    phases = torch.cat([hh[:, None] * inv_freq, ww[:, None] * inv_freq], dim=-1)   # [n, rope_dim]
    return phases.cos()[:, None], phases.sin()[:, None]


@lru_cache(64)
def attention_runs(cu_seqlens: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """cu_seqlens -> ((start, images, length), ...): consecutive images of one length, one SDPA call each."""
    runs: list[list[int]] = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if runs and runs[-1][2] == e - s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1, e - s])
    return tuple(tuple(r) for r in runs)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] -> rotated (rotate-half over the whole head, fp32), x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.n_heads, self.head_dim = v.n_heads, v.head_dim
        self.wqkv = VisionLinear(v.dim, 3 * v.dim, bias=True)
        self.wo = VisionLinear(v.dim, v.dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        n, H, hd = x.shape[0], self.n_heads, self.head_dim
        qkv = self.wqkv(x).view(n, 3, H, hd)
        qk = apply_rope_2d(qkv[:, :2], cos[:, None], sin[:, None])                 # q and k in one pass
        q, k, val = qk[:, 0], qk[:, 1], qkv[:, 2]                                   # [n, H, hd] views
        runs = attention_runs(tuple(cu_seqlens))
        if len(runs) == 1 and runs[0][1] == 1:
            out = self._sdpa(q, k, val, 1, n)                                       # one image
        else:
            out = torch.empty(n, H, hd, dtype=q.dtype, device=q.device)
            for s, b, length in runs:                                               # images of one length
                e = s + b * length
                out[s:e] = self._sdpa(q[s:e], k[s:e], val[s:e], b, length)
        return self.wo(out.reshape(n, -1))

    def _sdpa(self, q, k, v, b: int, length: int) -> torch.Tensor:
        """[b * length, H, hd] each -> same; 4-D [b, H, length, hd] views (stride-1 heads dim), so
        the fused kernels take them."""
        to4 = lambda t: t.view(b, length, self.n_heads, self.head_dim).transpose(1, 2)   # noqa: E731
        o = F.scaled_dot_product_attention(to4(q), to4(k), to4(v))                     # [b, H, length, hd]
        return o.transpose(1, 2).reshape(b * length, self.n_heads, self.head_dim)


class VisionMLP(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.w1 = VisionLinear(v.dim, 2 * v.inter_dim, bias=False)
        self.w2 = VisionLinear(v.inter_dim, v.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.norm1 = VisionRMSNorm(v.dim)
        self.attn = VisionAttention(v)
        self.norm2 = VisionRMSNorm(v.dim)
        self.mlp = VisionMLP(v)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.proj = VisionLinear(v.patch_dim, v.dim, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))                                # [N, 3p^2] -> [N, dim]


class ViT(nn.Module):
    """Attribute names are the release's `vision.*` names (the loader maps `vision.` here)."""

    def __init__(self, v: VisionArgs):
        super().__init__()
        self.args = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList([VisionBlock(v) for _ in range(v.n_layers)])
        self.norm = VisionRMSNorm(v.dim)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """patches [N, 3, p, p] of several images concatenated; grids [(n_vit_h, n_vit_w)] in the
        same order -> features [N, dim] bf16."""
        v = self.args
        cos, sin = rope_2d_tables(grids, v.rope_dim, v.rope_theta, patches.device)
        cu = [0]
        for h, w in grids:
            cu.append(cu[-1] + h * w)
        x = self.patch_embed(patches.to(ACT))
        for block in self.blocks:
            x = block(x, cos, sin, cu)
        return self.norm(x)
