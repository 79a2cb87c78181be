"""MoE (reference model.py `Gate`, `Expert`, `MoE`): sqrt-softplus scores, the correction bias used
only to pick experts (a separate bias for image-span tokens), weights from the unbiased scores,
normalized and scaled by route_scale; clamped SwiGLU experts with the routing weight applied before
w2; one shared expert added to the fp32 sum of the routed outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ACT, Linear


class Gate(nn.Module):
    def __init__(self, args, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.route_scale, self.temp = topk, args.route_scale, args.gate_temp
        self.norm_topk_prob = args.norm_topk_prob
        self.register_buffer("weight", torch.empty(n_experts, args.dim), persistent=False)
        self.register_buffer("bias", torch.zeros(n_experts), persistent=False)
        self.register_buffer("bias_vl", torch.zeros(n_experts), persistent=False)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None):
        scores = F.linear(x.float(), self.weight.float()) / self.temp
        scores = F.softplus(scores).sqrt()
        bias = self.bias if image_mask is None else torch.where(image_mask[:, None], self.bias_vl, self.bias)
        indices = (scores + bias).topk(self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter), Linear(inter, dim), Linear(dim, inter)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(ACT))


class MoE(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        n_experts, topk = args.get_moe_config(layer_id)
        self.dim, self.n_experts = args.dim, n_experts
        self.gate = Gate(args, n_experts, topk)
        self.experts = nn.ModuleList([Expert(args.dim, args.moe_inter_dim, args.swiglu_limit) for _ in range(n_experts)])
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] bf16 -> [T, d] bf16. Routed outputs are summed per token in ascending expert id
        order in fp32 (the reference's accumulation order), then the shared expert is added."""
        weights, indices = self.gate(x, image_mask)
        T, K = indices.shape
        outs = torch.zeros(T, K, self.dim, dtype=ACT, device=x.device)
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        pos = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[pos:pos + c]
            pos += c
            t, k = sel // K, sel % K
            outs[t, k] = self.experts[e](x[t], weights[t, k, None])
        # per token: add in ascending expert id
        rank = torch.argsort(indices, dim=1, stable=True)
        outs = outs.gather(1, rank[..., None].expand(-1, -1, self.dim))
        y = torch.zeros(T, self.dim, device=x.device)
        for k in range(K):
            y = y + outs[:, k].float()
        y = y + self.shared_experts(x).float()
        return y.to(ACT)
