"""MoE (reference model.py `Gate`, `Expert`, `MoE`): sqrt-softplus scores, the correction bias used
only to pick experts (a separate bias for image-span tokens), weights from the unbiased scores,
normalized and scaled by route_scale; clamped SwiGLU experts with the routing weight applied before
w2; one shared expert added to the fp32 sum of the routed outputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .layers import ACT, Linear


# Above this many token-expert pairs the padded groups cost more than the per-expert loop's
# overhead saves (CPU, 1 thread: small preset 256 pairs 5.5 vs 4.9 ms, 8192 pairs 466 vs 70 ms).
GROUPED_MAX_PAIRS = 192

# FP8 expert stacks on CUDA: steps up to this many token-expert pairs take the masked form (no host
# read: CUDA-graph capturable). 4096 covers every decode step the engine captures, up to 128
# sequences x (1 + 4 DSpark drafts) x top-6 = 3840 pairs. The capacity C = T costs transient
# buffers of E * T * (2 dim + 3 inter) * 2 bytes (48 local experts at full width, 4096 pairs: 1.1 GB)
# and the grid grows with E * T / BM tiles, most of which exit at once; larger steps (prefill
# chunks) loop over the experts in use, where one host read per layer is noise next to the GEMMs.
MASKED_MAX_PAIRS = 4096


@dataclass
class ExpertStacks:
    """A layer's routed experts in FP8 for the grouped GEMMs (weight_format="fp8"), converted once at
    load from MXFP4 (exact: ops.fp4_to_fp8_weight). w1 and w3 share one stack so one GEMM makes gate
    and up; each expert's Linear holds views of its rows (Expert.forward / the loop run unchanged).
    With DEEPINFER_GEMM=deepgemm, deepgemm.prepare_deepgemm re-expresses the stacks in place on
    128x128 tiles: the scales are then f32 [E, N/128, K/128] (kernels/deepgemm.py)."""
    w13: torch.Tensor    # [E, 2 * inter, dim] e4m3: w1 rows, then w3 rows
    s13: torch.Tensor    # [E, 2 * inter, dim / 32] E8M0 bytes, one per (row, 32)
    w2: torch.Tensor     # [E, dim, inter] e4m3
    s2: torch.Tensor     # [E, dim, inter / 32] E8M0 bytes

    @classmethod
    def empty(cls, n_experts: int, dim: int, inter: int, device) -> "ExpertStacks":
        f8, u8 = torch.float8_e4m3fn, torch.uint8
        return cls(torch.empty(n_experts, 2 * inter, dim, dtype=f8, device=device),
                   torch.empty(n_experts, 2 * inter, dim // 32, dtype=u8, device=device),
                   torch.empty(n_experts, dim, inter, dtype=f8, device=device),
                   torch.empty(n_experts, dim, inter // 32, dtype=u8, device=device))


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
        self.grouped_ok = not args.step_shape_invariant   # one formulation for every step size
        self.stacks: ExpertStacks | None = None            # FP8 experts (weight_format="fp8")
        # the masked form: None = on CUDA for steps up to MASKED_MAX_PAIRS; True = every step (a
        # CPU runs it too: tests); False = never
        self.masked: bool | None = None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] bf16 -> [T, d] bf16. Routed outputs are summed per token in ascending expert id
        order in fp32 (the reference's accumulation order), then the shared expert is added."""
        weights, indices = self.gate(x, image_mask)
        T, K = indices.shape
        outs = self._routed(x, weights, indices)
        # per token: add in ascending expert id
        rank = torch.argsort(indices, dim=1, stable=True)
        outs = outs.gather(1, rank[..., None].expand(-1, -1, self.dim))
        y = torch.zeros(T, self.dim, device=x.device)
        for k in range(K):
            y = y + outs[:, k].float()
        y = y + self.shared_experts(x).float()
        return y.to(ACT)

    def _routed(self, x, weights, indices) -> torch.Tensor:
        """[T, K, d] bf16 in the form this step's size and the weight format call for (on a CPU
        every form gives the same bits: tests/model/test_moe_grouped.py, test_moe_masked.py)."""
        pairs = indices.numel()
        if self.stacks is not None:
            auto = self.grouped_ok and x.is_cuda and pairs <= MASKED_MAX_PAIRS
            if self.masked or (self.masked is None and auto):
                return self._routed_masked(x, weights, indices)
            return self._routed_loop(x, weights, indices)
        if self.grouped_ok and pairs <= GROUPED_MAX_PAIRS and self._stacked(x.device) is not None:
            return self._routed_grouped(x, weights, indices)
        return self._routed_loop(x, weights, indices)

    def init_fp8_stacks(self, device) -> ExpertStacks:
        """Allocate the FP8 stacks and point every expert's Linear at its rows (views, no copies):
        the loader then fills the stacks through those views."""
        dim, inter = self.dim, self.experts[0].w2.in_features
        st = ExpertStacks.empty(self.n_experts, dim, inter, device)
        for e, ex in enumerate(self.experts):
            ex.w1.fp8 = (st.w13[e, :inter], st.s13[e, :inter])
            ex.w3.fp8 = (st.w13[e, inter:], st.s13[e, inter:])
            ex.w2.fp8 = (st.w2[e], st.s2[e])
            for lin in (ex.w1, ex.w3, ex.w2):
                lin.weight = torch.empty(0, device=device)
                lin.quantized = True
        self.stacks = st
        return st

    def _routed_loop(self, x, weights, indices) -> torch.Tensor:
        """[T, K, d] bf16: one Expert call per non-empty expert (packed FP4 experts dequantize per
        use; FP8 stacks run through their Linear views). NOTE(perf): the counts come to the host
        once per layer (a sync on CUDA): large steps only when the masked form is available."""
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
        return outs

    def _routed_masked(self, x, weights, indices) -> torch.Tensor:
        """[T, K, d] bf16 with no host read (CUDA-graph capturable): DeepGEMM's masked layout over
        the FP8 stacks with capacity C = T (an expert can take every token: nothing overflows).

            pair p = t*K + k; stable sort by expert (token order inside a group):
            e_sorted   0  0  0 | 2 | 5  5 ...      order: the pair at each position
            start      counts' exclusive cumsum: start[0] = 0, start[2] = 3, start[5] = 4
            rank       position - start[e_sorted] = 0 1 2 | 0 | 0 1: the pair's row in its slab
            xp[e, rank] = act_quant(x)[t]  -> [E, C, d], masked_m = counts (stays on the device)

        Same rounding points as Expert.forward: bf16 after each GEMM, fp32 clamped SwiGLU, the
        routing weight before w2, act_quant of the w2 input; SwiGLU and act_quant run on the T*K
        valid rows only (gathered from, then scattered back into, the slabs)."""
        st, ex = self.stacks, self.experts[0]
        T, K = indices.shape
        E, inter, dev = self.n_experts, st.w2.shape[2], x.device
        flat = indices.flatten()                                                # [T*K] pair -> expert
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        counts = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))                  # bincount syncs on CUDA
        rank = torch.arange(T * K, device=dev) - (counts.cumsum(0) - counts)[e_sorted]
        expected_m = -(-T * K // E)                                             # host ints: tile choice
        xp = x.new_empty(E, T, self.dim)          # rows >= counts[e] are never read back: no memset
        xp[e_sorted, rank] = ops.act_quant(x)[order // K]
        gu = ops.grouped_fp8_linear_masked(xp, st.w13, st.s13, counts, expected_m)   # [E, C, 2 inter]
        gu = gu[e_sorted, rank].float()                                         # [T*K, 2 inter] sorted
        gate, up = gu[:, :inter], gu[:, inter:]
        if ex.limit > 0:
            up = up.clamp(-ex.limit, ex.limit)
            gate = gate.clamp(max=ex.limit)
        h = (weights.flatten()[order, None] * (F.silu(gate) * up)).to(ACT)
        hp = x.new_empty(E, T, inter)
        hp[e_sorted, rank] = ops.act_quant(h)
        out = ops.grouped_fp8_linear_masked(hp, st.w2, st.s2, counts, expected_m)    # [E, C, d]
        outs = torch.empty(T * K, self.dim, dtype=ACT, device=dev)
        outs[order] = out[e_sorted, rank]
        return outs.view(T, K, self.dim)

    def _routed_grouped(self, x, weights, indices) -> torch.Tensor:
        """[T, K, d] bf16: token-expert pairs sorted by expert into padded groups [A, C, d] (A experts
        in use, C = the largest group), three batched matmuls, the pairs scattered back. Same
        rounding points as Expert.forward (bf16 after each linear, fp32 SwiGLU, weight before w2).
        Measured on CPU (1 thread, layer 3, us loop / grouped): tiny T=1 497/171, T=16 1011/234,
        T=64 1318/385; small T=1 728/448, T=16 3090/2086, T=64 4895/5481 (padding to the largest
        group costs more than the loop saves there; at 2048 tokens 466 vs 70 ms: GROUPED_MAX_PAIRS
        picks the loop for such steps). A batched matmul over all 32 experts of the
        small preset was 1.4-2.6x slower than the loop, hence only the experts in use."""
        w1, w3, w2 = self._stack
        T, K = indices.shape
        E, dev = self.n_experts, x.device
        flat = indices.flatten()                                           # [T*K] pair -> expert
        order = torch.argsort(flat, stable=True)                           # pairs grouped by expert
        e_sorted = flat[order]
        counts = torch.bincount(flat, minlength=E)
        rank = torch.arange(T * K, device=dev) - (counts.cumsum(0) - counts)[e_sorted]   # row in its group
        C = int(counts.max())                                              # CPU only: a free host read
        active = counts > 0                                                # groups of the experts in use only
        e_sorted = (active.cumsum(0) - 1)[e_sorted]
        w1, w3, w2 = w1[active], w3[active], w2[active]
        E = w1.shape[0]
        ex = self.experts[0]
        xin = ops.act_quant(x) if ex.w1.quantized else x
        xp = torch.zeros(E, C, self.dim, dtype=w1.dtype, device=dev)
        xp[e_sorted, rank] = xin[order // K].to(w1.dtype)
        gate = torch.bmm(xp, w1.transpose(1, 2)).to(ACT).float()          # [E, C, inter]
        up = torch.bmm(xp, w3.transpose(1, 2)).to(ACT).float()
        if ex.limit > 0:
            up = up.clamp(-ex.limit, ex.limit)
            gate = gate.clamp(max=ex.limit)
        h = F.silu(gate) * up
        wp = torch.zeros(E, C, 1, device=dev)
        wp[e_sorted, rank] = weights.flatten()[order, None]
        h = (wp * h).to(ACT)
        if ex.w2.quantized:
            h = ops.act_quant(h)
        out = torch.bmm(h.to(w2.dtype), w2.transpose(1, 2)).to(ACT)        # [E, C, d]
        outs = torch.empty(T * K, self.dim, dtype=ACT, device=dev)
        outs[order] = out[e_sorted, rank]
        return outs.view(T, K, self.dim)

    def _stacked(self, device) -> tuple | None:
        """Dense expert weights stacked [E, out, in], on the CPU (where experts are dequantized at
        load): each expert's weight becomes a view into the stack, so no memory is added. Packed
        FP4 experts (CUDA) keep the loop and their format."""
        if torch.device(device).type != "cpu" or self.stacks is not None or \
                any(e.w1.packed is not None for e in self.experts):
            return None
        if getattr(self, "_stack", None) is None:
            stack = []
            for name in ("w1", "w3", "w2"):
                w = torch.stack([getattr(e, name).weight for e in self.experts])
                for e, we in zip(self.experts, w):
                    getattr(e, name).weight = we
                stack.append(w)
            self._stack = tuple(stack)
        return self._stack
