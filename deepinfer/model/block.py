"""The V4.1 block (reference model.py `Block`): attention and MoE inside mHC hyper-connections."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import ops, side_stream
from .args import ModelArgs
from .attention import Attention
from .engram import Engram
from .layers import RMSNorm
from .moe import MoE

# a sublayer's hc_post, the next sublayer's collapse and its norm as one kernel, that sublayer's mixes beside it
# (Block.expand_into; across blocks where the model loop defers a block's output). Three launches on the critical
# path become one at each boundary; the same bits as the three kernels (GPU tests, H100 2026-12-08), 1.00x-1.006x
# on an H100's step. DEEPINFER_FUSE_SUBLAYER_INPUT=0 turns it off.
FUSE_SUBLAYER_INPUT = os.environ.get("DEEPINFER_FUSE_SUBLAYER_INPUT", "1") == "1"


def fuses_sublayer_inputs(tokens: int) -> bool:
    """Whether a step of `tokens` rows makes its sublayer inputs with hc_post_norm (Block.expand_into): on (the
    default), and a small step (side_stream.MAX_TOKENS: decode, verification, small chunks), where it was measured."""
    return FUSE_SUBLAYER_INPUT and tokens <= side_stream.MAX_TOKENS


class Expand(NamedTuple):
    """A sublayer's mHC expand not yet made: out[j] = post[j] * y + sum_i comb[i, j] * res[i] (ops.hc_post)."""
    y: torch.Tensor         # [T, d] the sublayer's output
    res: torch.Tensor       # [T, hc, d] its input streams
    post: torch.Tensor      # [T, hc]
    comb: torch.Tensor      # [T, hc, hc]

    @property
    def shape(self) -> torch.Size:
        """The expanded streams' shape [T, hc, d] (what a hook reading a block's input sees)."""
        return self.res.shape

    def tensor(self) -> torch.Tensor:
        return ops.hc_post(self.y, self.res, self.post, self.comb)


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
                defer_out: bool = False):
        """x [T, hc, d] (or the previous block's Expand); attn_fn(x_norm, act_quant(x_norm) or None) -> [T, d].
        Returns (x, the FFN's pre-mix for the next block); defer_out: x as an Expand, for a next block that
        makes it with its own collapse (FUSE_SUBLAYER_INPUT; its tap's mean too).
        tap: gets x.mean(dim=1) appended (a DSpark tap, from the read the attention mixes make anyway)."""
        if isinstance(x, Expand) and fuses_sublayer_inputs(x.y.shape[0]):
            x, a_mix, xn, xq, *mean = self.expand_into("attn", x, pre_mix, tap is not None)
        else:
            if isinstance(x, Expand):
                x = x.tensor()
            a_mix, xa, *mean = self.mixes_pre(x, "attn", pre_mix, tap is not None)
            # the norm's launch also rounds its rows where the input linears would (RMSNorm.with_rounded)
            xn, xq = self.attn_norm.with_rounded(xa, *self.attn.input_linears())
        if tap is not None:
            tap.append(mean[0])
        res = x
        a = attn_fn(xn, xq)
        if attn_out is not None:
            attn_out.append(a)
        a_pre, a_post, a_comb = a_mix.wait()
        if fuses_sublayer_inputs(a.shape[0]):
            x, f_mix, xn, xq = self.expand_into("ffn", Expand(a, res, a_post, a_comb), a_pre)
        else:
            x = ops.hc_post(a, res, a_post, a_comb)
            f_mix, xf = self.mixes_pre(x, "ffn", a_pre)
            xn, xq = self.ffn_norm.with_rounded(xf, self.ffn.shared_input_linear())
        res = x
        y = self.ffn(xn, image_mask, xq)
        f_pre, f_post, f_comb = f_mix.wait()
        out = Expand(y, res, f_post, f_comb)
        return (out if defer_out else out.tensor()), f_pre

    def expand_into(self, sub: str, e: "Expand", pre: torch.Tensor, mean: bool = False):
        """The previous sublayer's hc_post and sublayer `sub`'s input: (x [T, hc, d], sub's mixes (wait() -> pre,
        post, comb), its normed input, act_quant of it or None[, x's mean over the hc copies (mean: a DSpark
        tap)]). hc_post, the collapse with the previous pre-mix and the norm are one kernel (ops.hc_post_norm);
        sub's own mixes read x only after it and are needed only after sub, so in a small captured step their
        whole pass runs on a side stream (side_stream.TAIL_LANE) beside the sublayer."""
        norm, consumers = (self.attn_norm, self.attn.input_linears()) if sub == "attn" else \
            (self.ffn_norm, (self.ffn.shared_input_linear(),))
        quant = any(c is not None and c.rounds_input(e.y) for c in consumers)
        x, xn, xq, *mean_out = ops.hc_post_norm(e.y, e.res, e.post, e.comb, pre, norm.weight, norm.eps, quant, mean)
        mixes = side_stream.branch(self.mixes, x, sub, pre, tokens=x.shape[0], lane=side_stream.TAIL_LANE,
                                   fork=side_stream.MHC_TAILS)
        return (x, mixes, xn, xq, *mean_out)

    def mixes(self, x: torch.Tensor, sub: str, pre_prev: torch.Tensor):
        """(pre, post, comb) of x's mixes: ops.hc_mixes_pre whole (its collapse, made elsewhere, unused)."""
        pre, post, comb, _ = ops.hc_mixes_pre(x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                              getattr(self, f"hc_{sub}_base"), pre_prev, self.iters, self.hc_eps,
                                              self.eps)
        return pre, post, comb

    def mixes_pre(self, x: torch.Tensor, sub: str, pre_prev: torch.Tensor, mean: bool = False, tail: bool = True):
        """hc_mixes(x, sub) and hc_pre(x, pre_prev) in one pass over x (ops.hc_mixes_pre): (mixes, the collapsed
        input [T, d][, x's mean over the hc copies [T, d]]), mixes.wait() -> pre, post [T, hc], comb [T, hc, hc]
        fp32. Only the collapsed input feeds the sublayer; the mixes' sums and Sinkhorn pass (their tail) are
        needed after it, so in a small captured step they run on a side stream (side_stream.TAIL_LANE) and the
        norm starts as soon as the collapse is written. tail=False: the mixes are not made (mixes is None)."""
        launch, y, *mean_out = ops.hc_mixes_pre(x, getattr(self, f"hc_{sub}_fn"), getattr(self, f"hc_{sub}_scale"),
                                                getattr(self, f"hc_{sub}_base"), pre_prev, self.iters, self.hc_eps,
                                                self.eps, mean, deferred=True)
        mixes = side_stream.branch(launch, tokens=x.shape[0], device=x.device, lane=side_stream.TAIL_LANE,
                                   fork=side_stream.MHC_TAILS) if tail else None
        return (mixes, y, *mean_out)
