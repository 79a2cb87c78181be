"""The V4.1 block (reference model.py `Block`): attention and MoE inside mHC hyper-connections."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .args import ModelArgs
from .attention import Attention
from .engram import Engram
from .layers import RMSNorm
from .moe import MoE


class PendingPost(NamedTuple):
    """A sublayer's expand not yet applied: hc_post(y, res, post, comb) [T, hc, d]. Blocks hand it on so
    the next sublayer's mixes run in the same pass (ops.hc_post_mixes_pre)."""

    y: torch.Tensor
    res: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor

    def apply(self) -> torch.Tensor:
        return ops.hc_post(*self)

    def rows(self, idx) -> "PendingPost":
        return PendingPost(*(t[idx] for t in self))


def settle(h):
    """h as a tensor: a PendingPost applied, a tensor as it is."""
    return h.apply() if isinstance(h, PendingPost) else h


class Block(nn.Module):
    """Attention and MoE between mHC collapse (hc_pre) and expand (hc_post). Single-pass mHC: each
    sublayer collapses its input with the pre-mix the PREVIOUS sublayer computed; post / comb are
    its own."""

    attention_cls = Attention

    def __init__(self, args: ModelArgs, layer_id: int, parallel=None):
        super().__init__()
        self.layer_id, self.eps = layer_id, args.norm_eps
        self.hc, self.iters, self.hc_eps = args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps
        self.attn = self.attention_cls(args, layer_id)
        self.ffn = MoE(args, layer_id, parallel)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.engram = Engram(args, layer_id, parallel) \
            if layer_id in args.engram_layer_ids and layer_id < args.n_layers else None
        mix, hd = (2 + self.hc) * self.hc, self.hc * args.dim
        for sub in ("attn", "ffn"):
            self.register_buffer(f"hc_{sub}_fn", torch.zeros(mix, hd), persistent=False)
            self.register_buffer(f"hc_{sub}_base", torch.zeros(mix), persistent=False)
            self.register_buffer(f"hc_{sub}_scale", torch.ones(3), persistent=False)

    def hc_mixes(self, x: torch.Tensor, sub: str):
        """x [T, hc, d] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32)."""
        xf = x.flatten(1).float()
        rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        mixes = F.linear(xf, getattr(self, f"hc_{sub}_fn")) * rs
        return ops.hc_split_sinkhorn(mixes, getattr(self, f"hc_{sub}_scale"), getattr(self, f"hc_{sub}_base"),
                                     self.hc, self.iters, self.hc_eps)

    @staticmethod
    def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)

    @staticmethod
    def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        out = post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=1)
        return out.to(y.dtype)

    def forward(self, x, pre_mix, attn_fn, image_mask=None, attn_out: list | None = None, tap: list | None = None,
                defer_post: bool = False):
        """x [T, hc, d], or a PendingPost (the previous block's expand, applied here in one pass with
        this block's attention mixes); attn_fn(x_norm) -> [T, d]. Returns (x, the FFN's pre-mix for the
        next block); defer_post: x is this block's FFN expand as a PendingPost (the caller applies it,
        or hands it to the next block). tap: gets x.mean(dim=1) appended (a DSpark tap, from the read
        the attention mixes make anyway)."""
        if isinstance(x, PendingPost):
            res, a_pre, a_post, a_comb, xa, *mean = self.post_mixes_pre(x, "attn", pre_mix, tap is not None)
        else:
            res = x
            a_pre, a_post, a_comb, xa, *mean = self.mixes_pre(x, "attn", pre_mix, tap is not None)
        if tap is not None:
            tap.append(mean[0])
        a = attn_fn(self.attn_norm(xa))
        if attn_out is not None:
            attn_out.append(a)
        # the attention's expand and the FFN's mixes in one pass over the residual streams
        res, f_pre, f_post, f_comb, xf = self.post_mixes_pre(PendingPost(a, res, a_post, a_comb), "ffn", a_pre)
        y = self.ffn(self.ffn_norm(xf), image_mask)
        out = PendingPost(y, res, f_post, f_comb)
        return (out if defer_post else out.apply()), f_pre

    def post_mixes_pre(self, pending: PendingPost, sub: str, pre_prev: torch.Tensor, mean: bool = False):
        """pending.apply() and mixes_pre(that, sub, pre_prev, mean) in one pass (ops.hc_post_mixes_pre):
        (x, pre, post, comb, collapsed input[, mean])."""
        return ops.hc_post_mixes_pre(*pending, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                     getattr(self, f"hc_{sub}_base"), pre_prev, self.iters, self.hc_eps, self.eps,
                                     mean)

    def mixes_pre(self, x: torch.Tensor, sub: str, pre_prev: torch.Tensor, mean: bool = False):
        """hc_mixes(x, sub) and hc_pre(x, pre_prev) in one pass over x (ops.hc_mixes_pre):
        pre, post [T, hc], comb [T, hc, hc] fp32 and the collapsed input [T, d] (mean: then x's mean
        over the hc copies [T, d])."""
        return ops.hc_mixes_pre(x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                getattr(self, f"hc_{sub}_base"), pre_prev, self.iters, self.hc_eps, self.eps, mean)
