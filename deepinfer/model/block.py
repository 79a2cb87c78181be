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
    """A sublayer's output not yet expanded into the residual stream: hc_post(y, res, post, comb) is
    made by the next sublayer's mixes in the same pass (ops.hc_post_mixes_pre), or by materialize()
    where the stream itself is needed."""
    y: torch.Tensor
    res: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor

    def materialize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The stream [T, hc, d], or its rows `rows` only (the rest never made)."""
        if rows is None:
            return ops.hc_post(*self)
        return ops.hc_post(*(t[rows] for t in self))


def materialized(h) -> torch.Tensor:
    """h as a tensor (a PendingPost expanded)."""
    return h.materialize() if isinstance(h, PendingPost) else h


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
        return ops.hc_pre(x, pre)

    @staticmethod
    def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        out = post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=1)
        return out.to(y.dtype)

    def forward(self, x, pre_mix, attn_fn, image_mask=None, attn_out: list | None = None, tap: list | None = None,
                defer_post: bool = False):
        """x [T, hc, d] (or the previous block's PendingPost); attn_fn(x_norm, act_quant(x_norm) or None) ->
        [T, d]. Returns (x, the FFN's pre-mix for the next block); defer_post: x as a PendingPost, for the
        next block's mixes to expand in their pass.
        tap: gets x.mean(dim=1) appended (a DSpark tap, from the read the attention mixes make anyway)."""
        res, a_pre, a_post, a_comb, xa, *mean = self.enter(x, "attn", pre_mix, tap is not None)
        if tap is not None:
            tap.append(mean[0])
        # the norm's launch also rounds its rows where the input linears would (RMSNorm.with_rounded)
        a = attn_fn(*self.attn_norm.with_rounded(xa, *self.attn.input_linears()))
        if attn_out is not None:
            attn_out.append(a)
        res, f_pre, f_post, f_comb, xf = self.enter(PendingPost(a, res, a_post, a_comb), "ffn", a_pre)
        xn, xq = self.ffn_norm.with_rounded(xf, self.ffn.shared_input_linear())
        y = self.ffn(xn, image_mask, xq)
        out = PendingPost(y, res, f_post, f_comb)
        return (out if defer_post else out.materialize()), f_pre

    def enter(self, x, sub: str, pre_prev: torch.Tensor, mean: bool = False):
        """A sublayer's way in: x (the stream, or the previous sublayer's PendingPost, expanded in the same
        pass) -> (the stream x, then mixes_pre's outputs)."""
        if isinstance(x, PendingPost):
            return ops.hc_post_mixes_pre(*x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                         getattr(self, f"hc_{sub}_base"), pre_prev, self.iters, self.hc_eps,
                                         self.eps, mean)
        return (x,) + self.mixes_pre(x, sub, pre_prev, mean)

    def mixes_pre(self, x: torch.Tensor, sub: str, pre_prev: torch.Tensor, mean: bool = False):
        """hc_mixes(x, sub) and hc_pre(x, pre_prev) in one pass over x (ops.hc_mixes_pre):
        pre, post [T, hc], comb [T, hc, hc] fp32 and the collapsed input [T, d] (mean: then x's mean
        over the hc copies [T, d])."""
        return ops.hc_mixes_pre(x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                getattr(self, f"hc_{sub}_base"), pre_prev, self.iters, self.hc_eps, self.eps, mean)
