"""MoE (reference model.py `Gate`, `Expert`, `MoE`): sqrt-softplus scores, the correction bias used
only to pick experts (a separate bias for image-span tokens), weights from the unbiased scores,
normalized and scaled by route_scale; clamped SwiGLU experts with the routing weight applied before
w2; one shared expert added to the fp32 sum of the routed outputs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ops, side_stream
from .fused_linears import fuse_linears
from .layers import ACT, Linear, linear_fp32


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
# steps of at least this many pairs take the grouped contiguous form (graph-safe too) instead of the
# masked one where it is on (DEEPINFER_MOE_CONTIGUOUS_FROM_PAIRS; unset: the masked form up to
# MASKED_MAX_PAIRS). perf/bench_moe_forms.py measures the two side by side at verify-step sizes.
CONTIGUOUS_FROM_PAIRS = int(os.environ.get("DEEPINFER_MOE_CONTIGUOUS_FROM_PAIRS") or 0) or None
# masked steps of a token count that is not a multiple of 4 (decode graphs of batch 1 and 2, odd packed verify
# steps) padded to one so the FP8 x FP8 form takes them (its slab capacity C = T must be:
# cuda_fp8_decode.MASKED_SLAB_RULE); else they run W8A16. On by default ("0" turns it off): 1-3% faster decode
# steps at batch 1 / 2 / 3 / 6 on an H100 with the GPU checks passing (perf/round94.steps, round95.steps)
PAD_MASKED_SLABS = os.environ.get("DEEPINFER_MOE_PAD_SLABS", "1") == "1"


@dataclass
class ExpertStacks:
    """A layer's routed experts for the grouped GEMMs (weight_format="fp8"). w1 and w3 share one stack so
    one GEMM makes gate and up; each expert's Linear holds views of its rows (Expert.forward / the loop
    run unchanged). Two forms (loader expert_format):
        "fp8"  e4m3 stacks converted once at load from MXFP4 (exact: ops.fp4_to_fp8_weight): twice the
               release's bytes, run by the W8A16 and FP8 x FP8 kernels. With DEEPINFER_GEMM=deepgemm,
               deepgemm.prepare_deepgemm re-expresses them in place on 128x128 tiles (scales f32
               [E, N/128, K/128], kernels/deepgemm.py).
        "fp4"  the release's MXFP4 bytes in fp4_layout.fp4_kernel_layout (uint8 [E, N, K/2]) with their E8M0
               bytes (0 mapped away): half the memory, run by the W4A16 kernels (the masked GEMMs) and
               dequantized per step for the prefill's bf16 grouped GEMM. ops.* tell the forms apart by
               dtype (uint8 = FP4)."""
    w13: torch.Tensor    # [E, 2 * inter, dim] e4m3 (or [E, 2 * inter, dim / 2] packed FP4): w1 rows, then w3 rows
    s13: torch.Tensor    # [E, 2 * inter, dim / 32] E8M0 bytes, one per (row, 32)
    w2: torch.Tensor     # [E, dim, inter] e4m3 (or [E, dim, inter / 2] packed FP4)
    s2: torch.Tensor     # [E, dim, inter / 32] E8M0 bytes
    # one f32 pow2 scale per row [E, N, 1] once to_row_scales re-expressed the stack (s13 / s2 then
    # hold that same scale in every block, so the per-expert Linear views stay valid)
    r13: torch.Tensor | None = None
    r2: torch.Tensor | None = None

    @property
    def fp4(self) -> bool:
        return self.w13.dtype == torch.uint8

    def to_row_scales(self) -> bool:
        """Re-express both stacks in place with one scale per row (ops.row_scaled_fp8_weight: the
        masked GEMMs' K loop then reads no scale). Per stack, only if every expert converts exactly;
        True if both did. FP4 stacks keep their block scales (the W4A16 decode multiplies by them)."""
        if self.fp4:
            return False
        for wname, sname, rname in (("w13", "s13", "r13"), ("w2", "s2", "r2")):
            w, s = getattr(self, wname), getattr(self, sname)
            conv = [ops.row_scaled_fp8_weight(w[e], s[e]) for e in range(w.shape[0])]
            if any(c is None for c in conv):
                continue
            rows = torch.stack([r for _, r in conv])                              # [E, N, 1] f32
            for e, (we, _) in enumerate(conv):
                w[e].copy_(we)
            s.view(torch.uint8).copy_((torch.frexp(rows).exponent + 126).to(torch.uint8).expand(s.shape))
            setattr(self, rname, rows)
        return self.r13 is not None and self.r2 is not None

    def masked_weights(self) -> tuple:
        """(w13, scale, w2, scale) for the masked GEMMs: the row scales where present."""
        return (self.w13, self.r13 if self.r13 is not None else self.s13,
                self.w2, self.r2 if self.r2 is not None else self.s2)

    @classmethod
    def empty(cls, n_experts: int, dim: int, inter: int, device, fp4: bool = False) -> "ExpertStacks":
        wt, per = (torch.uint8, 2) if fp4 else (torch.float8_e4m3fn, 1)          # FP4: two weights a byte
        u8 = torch.uint8
        return cls(torch.empty(n_experts, 2 * inter, dim // per, dtype=wt, device=device),
                   torch.empty(n_experts, 2 * inter, dim // 32, dtype=u8, device=device),
                   torch.empty(n_experts, dim, inter // per, dtype=wt, device=device),
                   torch.empty(n_experts, dim, inter // 32, dtype=u8, device=device))

    def to_fp8(self) -> "ExpertStacks":
        """FP4 stacks as FP8 ones (the same weights): the fallback where a layer's block scales are outside
        the W4A16 decode's range (fp4_layout.fp4_scales_ok)."""
        from deepinfer.kernels.fp4_layout import fp4_release_layout
        E, n13, n2 = self.w13.shape[0], self.w13.shape[1], self.w2.shape[1]
        out = ExpertStacks.empty(E, n2, n13 // 2, self.w13.device)
        for e in range(E):
            for w, s, wd, sd in ((self.w13, self.s13, out.w13, out.s13), (self.w2, self.s2, out.w2, out.s2)):
                w8, s8 = ops.fp4_to_fp8_weight(fp4_release_layout(w[e]), s[e])
                wd[e].copy_(w8)
                sd[e].copy_(s8)
        return out


def _pick_rows(out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[P, d]: each pick's output row of the slab out (row slot[p] of out viewed as [rows, d]); a dropped
    pick (slot -1) gives zeros."""
    rows = out.reshape(-1, out.shape[-1])[slot.clamp(min=0)]
    return torch.where((slot >= 0)[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """t with `pad` zero rows appended (t itself where pad is 0)."""
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


class Gate(nn.Module):
    def __init__(self, args, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.route_scale, self.temp = topk, args.route_scale, args.gate_temp
        self.norm_topk_prob = args.norm_topk_prob
        self.register_buffer("weight", torch.empty(n_experts, args.dim), persistent=False)
        self.register_buffer("bias", torch.zeros(n_experts), persistent=False)
        self.register_buffer("bias_vl", torch.zeros(n_experts), persistent=False)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None):
        """sqrt(softplus(x W^T / temp)), the top-k of it plus the correction bias (bias_vl on image
        tokens), their scores normalized (ops.router_topk: one kernel on a GPU after the fp32 GEMM)."""
        return ops.router_topk(linear_fp32(x, self.weight), self.bias, self.topk, float(self.temp), self.route_scale,
                               self.norm_topk_prob, bias_alt=None if image_mask is None else self.bias_vl,
                               alt_mask=image_mask)


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter), Linear(inter, dim), Linear(dim, inter)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        h = swiglu(self.w1(x), self.w3(x), self.limit)
        if weights is not None:
            h = weights * h
        return self.w2(h.to(ACT))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The experts' clamped SwiGLU in fp32 (limit 0: no clamp)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


class MoE(nn.Module):
    def __init__(self, args, layer_id: int, parallel=None):
        super().__init__()
        n_experts, topk = args.get_moe_config(layer_id)
        self.dim, self.layer_id = args.dim, layer_id
        self.gate = Gate(args, n_experts, topk)
        # expert parallel (deepinfer/parallel/): this rank holds a slice of the physical slots; experts[i]
        # is local slot i and self.n_experts counts the local ones (the gate keeps the logical count)
        self.ep = _ExpertParallel(parallel, layer_id) if parallel is not None and \
            parallel.ep_layer(layer_id, args.n_layers) else None
        self.n_experts = n_experts if self.ep is None else parallel.placement.num_local
        self.experts = nn.ModuleList([Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                      for _ in range(self.n_experts)])
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
        self.shared_w13: Linear | None = None             # shared w1 and w3 stacked (fuse_input_linears)
        self.grouped_ok = not args.step_shape_invariant   # one formulation for every step size
        self.stacks: ExpertStacks | None = None            # FP8 experts (weight_format="fp8")
        # the masked form: None = on CUDA for steps up to MASKED_MAX_PAIRS; True = every step (a
        # CPU runs it too: tests); False = never
        self.masked: bool | None = None

    def shared_input_linear(self) -> Linear | None:
        """The fused shared w1 / w3 (Block: ffn_norm.with_rounded hands it rounded rows), or None."""
        return self.shared_w13

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,
                x_rounded: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] bf16 -> [T, d] bf16. Routed outputs are summed per token in ascending expert id
        order in fp32 (the reference's accumulation order), then the shared expert is added.
        x_rounded: act_quant(x) from the norm's launch, read by the fused shared w1 / w3.
        The shared expert reads only x: in a small step it runs on the side stream beside the router,
        the dispatch and the routed experts (model/side_stream.py)."""
        T = x.shape[0]
        shared = side_stream.branch(self._shared, x, x_rounded, tokens=T) if T else None
        if self.ep is not None:
            return self._forward_ep(x, image_mask, shared)
        if T == 0:
            return x
        weights, indices = self.gate(x, image_mask)
        if self._use_masked(x, indices.numel()):
            xs, ws, ids, pad = self._pad_slabs(x, weights, indices)
            out, slot = self._masked_experts(xs, ws, ids, expected_pairs=indices.numel())
            y = ops.moe_combine(out, slot, ids, _pad_rows(shared.wait(), pad))
            return y[:T] if pad else y
        if self._use_contiguous(x):
            out, slot = self._contiguous_experts(x, weights, indices)
            return ops.moe_combine(out, slot, indices, shared.wait())
        T, K = indices.shape
        outs = self._routed(x, weights, indices)
        # per token: add in ascending expert id
        rank = torch.argsort(indices, dim=1, stable=True)
        outs = outs.gather(1, rank[..., None].expand(-1, -1, self.dim))
        y = torch.zeros(T, self.dim, device=x.device)
        for k in range(K):
            y = y + outs[:, k].float()
        y = y + shared.wait().float()
        return y.to(ACT)

    def _forward_ep(self, x: torch.Tensor, image_mask: torch.Tensor | None,
                    shared: side_stream.Pending | None) -> torch.Tensor:
        """Expert parallel: route, send each pick to the rank holding its physical slot, compute the
        pairs this rank received, bring every pick's output back, then the same fp32 sum in ascending
        logical expert id + shared as one rank does (so outputs equal a 1-rank run's: each pair is
        computed alone and the sum order is the logical one). T may be 0 (an idle rank)."""
        T, K = x.shape[0], self.gate.topk
        if T:
            weights, indices = self.gate(x, image_mask)                          # [T, K] logical
        else:
            weights = torch.empty(0, K, device=x.device)
            indices = torch.empty(0, K, dtype=torch.long, device=x.device)
        self.ep.record(indices)
        outs = self._ep_dense(x, weights, indices)
        if outs is None:
            local, handle = self.ep.dispatcher.dispatch(x, self.ep.maps.to_physical(indices), weights)
            outs = self.ep.dispatcher.combine(self._local_pairs(local), handle)  # [T, K, d]
        if T == 0:
            return x
        # the masked form's contract: out [K, T, d] with pair (t, k) at row k * T + t (a strided view, no copy)
        ar = torch.arange(T * K, device=x.device)
        slot = (ar % K) * T + ar // K
        return ops.moe_combine(outs.permute(1, 0, 2), slot, indices, shared.wait())

    def _ep_dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        """[T, K, d] bf16 through the dispatcher's fixed-shape form (no host read, fixed shapes: decode
        steps), or None where it does not apply: every gathered token with its K picks, other ranks' picks
        dropped by the masked form's routing, the pick outputs (zeros where dropped) reduce-scattered home.
        Decided alike on every rank (M is the step's, the rest the layer's), so the collectives line up.
        The bits equal the pair-list path's: a pick's output depends on its row and expert alone."""
        disp, K = self.ep.dispatcher, self.gate.topk
        if not getattr(disp, "dense", False) or self.stacks is None:
            return None
        M = disp.step_tokens(x.shape[0], x.device)
        rows = disp.world_size * M
        if M == 0 or not self._use_masked(x, rows * K):
            return None
        xs, local, ws, handle = disp.dispatch_dense(x, self.ep.maps.to_physical(indices), weights, M)
        # the tile choice's pair count: this rank's share of the picks, as if balanced
        out, slot = self._masked_experts(xs, ws, local, expected_pairs=M * K)
        return disp.combine_dense(_pick_rows(out, slot).view(rows, K, self.dim), handle)

    def _local_pairs(self, local) -> torch.Tensor:
        """[P, d] bf16: each received (token, local slot, weight) pair through its expert, as a
        one-pick token (every form of _routed then applies unchanged)."""
        P = local.pair_token.shape[0]
        if P == 0:
            return torch.empty(0, self.dim, dtype=ACT, device=local.x.device)
        xp = local.x[local.pair_token]
        return self._routed(xp, local.pair_weight[:, None].float(), local.pair_expert[:, None])[:, 0]

    def _use_masked(self, x, pairs: int) -> bool:
        """The masked form for a step of `pairs` token-expert pairs: FP8 stacks, and forced (self.masked)
        or a CUDA step of at most MASKED_MAX_PAIRS pairs (and below CONTIGUOUS_FROM_PAIRS where the
        contiguous form takes it)."""
        if self.stacks is None or self.masked is False:
            return False
        if self.masked:
            return True
        if CONTIGUOUS_FROM_PAIRS is not None and pairs >= CONTIGUOUS_FROM_PAIRS and self._use_contiguous(x):
            return False
        return self.grouped_ok and x.is_cuda and pairs <= MASKED_MAX_PAIRS

    def _use_contiguous(self, x) -> bool:
        """The grouped contiguous form (prefill-sized steps past the masked form): FP8 stacks, and a
        grouped contiguous GEMM switched on and able to take both projections (ops.grouped_contiguous_ok:
        DEEPINFER_MOE_CONTIGUOUS=1 on W8A16, or DEEPINFER_PREFILL_GEMM=fp8)."""
        st = self.stacks
        return (st is not None and self.masked is not True and self.grouped_ok
                and ops.grouped_contiguous_ok(x, self.dim, self.experts[0].w2.in_features, fp4=st.fp4))

    def _contiguous_experts(self, x, weights, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [K, T, d] bf16, slot [T*K]): pairs sorted by expert into one contiguous slab (pair p at
        flat row slot[p] = the rows of experts < e, + its rank among e's pairs in token order), one
        grouped GEMM per projection over all experts, the fused SwiGLU + weight + act_quant between
        them, and moe_combine after: no per-expert launch and no host read. Same rounding points as
        Expert.forward (the masked form's kernels, on a [K, T] slab instead of [E, T])."""
        st, ex = self.stacks, self.experts[0]
        T, K = indices.shape
        E, inter = self.n_experts, self.experts[0].w2.in_features
        counts, slot = ops.moe_route(indices, E, contiguous=True)               # [E] int32, [T*K] row in the slab
        xp = ops.moe_dispatch(x, slot, K, K).view(T * K, self.dim)              # act_quant(x) rows, sorted
        w13, s13, w2, s2 = st.masked_weights()
        rows = ops.GroupedRows(counts)                                          # one tile map for both GEMMs
        gu = ops.grouped_fp8_linear_contiguous(xp, w13, s13, rows)              # [T*K, 2 inter]
        hp = ops.moe_swiglu_quant(gu.view(K, T, 2 * inter), slot, weights, ex.limit, inter)
        out = ops.grouped_fp8_linear_contiguous(hp.view(T * K, inter), w2, s2, rows)     # [T*K, d]
        return out.view(K, T, self.dim), slot

    def _routed(self, x, weights, indices) -> torch.Tensor:
        """[T, K, d] bf16 in the form this step's size and the weight format call for (on a CPU
        every form gives the same bits: tests/model/test_moe_grouped.py, test_moe_masked.py)."""
        pairs = indices.numel()
        if self.stacks is not None:
            if self._use_masked(x, pairs):
                return self._routed_masked(x, weights, indices)
            if self._use_contiguous(x):        # an EP rank's received pairs of a prefill step
                out, slot = self._contiguous_experts(x, weights, indices)
                return out.reshape(-1, self.dim)[slot].view(*indices.shape, self.dim)
            return self._routed_loop(x, weights, indices)
        if self.grouped_ok and pairs <= GROUPED_MAX_PAIRS and self._stacked(x.device) is not None:
            return self._routed_grouped(x, weights, indices)
        return self._routed_loop(x, weights, indices)

    def fuse_input_linears(self) -> bool:
        """The shared expert's w1 and w3 (both read x) as one GEMM, FP8 or dense (model/fused_linears.py;
        the loader calls this on CUDA); True if fused."""
        self.shared_w13 = fuse_linears([self.shared_experts.w1, self.shared_experts.w3])
        return self.shared_w13 is not None

    def _shared(self, x: torch.Tensor, x_rounded: torch.Tensor | None = None) -> torch.Tensor:
        """The shared expert [T, d] bf16: Expert.forward, with gate and up from one GEMM when fused (reading
        x_rounded, act_quant(x), where the norm made it)."""
        se = self.shared_experts
        if self.shared_w13 is None:
            return se(x)
        if x_rounded is not None:
            gu = self.shared_w13(x_rounded, rounded=True)
        else:
            gu = self.shared_w13(x)
        inter = se.w1.out_features
        if not se.w2.quantized:
            # a dense w2 (a bf16 checkpoint) reads the SwiGLU unrounded: no act_quant to fuse
            return se.w2(swiglu(gu[:, :inter], gu[:, inter:], se.limit).to(ACT))
        # SwiGLU, bf16 and act_quant in one pass; w2's own act_quant would leave those rows unchanged
        return se.w2(ops.swiglu_quant(gu, se.limit, inter), rounded=True)

    def init_fp8_stacks(self, device) -> ExpertStacks:
        """Allocate the FP8 stacks and point every expert's Linear at its rows (views, no copies):
        the loader then fills the stacks through those views."""
        return self.set_stacks(ExpertStacks.empty(self.n_experts, self.dim, self.experts[0].w2.in_features, device))

    def init_fp4_stacks(self, device) -> ExpertStacks:
        """The same for FP4 stacks (expert_format="fp4"): each Linear holds packed views in the kernels'
        layout (Linear.packed_kernel_layout), dequantized per use off the masked / contiguous forms."""
        return self.set_stacks(ExpertStacks.empty(self.n_experts, self.dim, self.experts[0].w2.in_features, device,
                                                  fp4=True))

    def set_stacks(self, st: ExpertStacks) -> ExpertStacks:
        """Hold st and point every expert's Linear at its rows (views, no copies)."""
        inter = self.experts[0].w2.in_features
        for e, ex in enumerate(self.experts):
            views = ((st.w13[e, :inter], st.s13[e, :inter]), (st.w13[e, inter:], st.s13[e, inter:]), (st.w2[e], st.s2[e]))
            for lin, view in zip((ex.w1, ex.w3, ex.w2), views):
                lin.fp8, lin.packed, lin.packed_kernel_layout = (None, view, True) if st.fp4 else (view, None, False)
                lin.weight = torch.empty(0, device=st.w13.device)
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

    def _masked_experts(self, x, weights, indices, expected_pairs: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [E, C, d] bf16, slot [T*K]) with no host read (CUDA-graph capturable): DeepGEMM's
        masked layout over the FP8 stacks with capacity C = T (an expert can take every token:
        nothing overflows). Pair p = t*K + k lives at row slot[p] = e*T + rank of the slabs (rank:
        its place among e's pairs in token order; kernels/reference.py moe_route_ref draws it); rows
        >= counts[e] are never read. Same rounding points as Expert.forward: act_quant of x, bf16
        after each GEMM, fp32 clamped SwiGLU, the routing weight before the bf16 cast, act_quant of
        the w2 input (kernels/triton_moe.py fuses the glue between the GEMMs)."""
        st, ex = self.stacks, self.experts[0]
        T, K = indices.shape
        E, inter = self.n_experts, self.experts[0].w2.in_features
        counts, slot = ops.moe_route(indices, E)                                # [E] int32, [T*K]
        expected_m = -(-(T * K if expected_pairs is None else expected_pairs) // E)    # host ints: tile choice
        if ops.masked_moe_fp8_takes(x, st.w13, st.r13, st.w2, st.r2):
            # FP8 x FP8 on the row-scaled stacks: the slabs travel as e4m3 bytes + scales (same values)
            xq, sx = ops.moe_dispatch(x, slot, K, E, fp8=True)                  # [E, C, d] e4m3
            gu = ops.fp8_masked_moe_gemm(xq, sx, st.w13, st.r13, counts, expected_m)
            hq, sh = ops.moe_swiglu_quant(gu, slot, weights, ex.limit, inter, fp8=True)
            return ops.fp8_masked_moe_gemm(hq, sh, st.w2, st.r2, counts, expected_m), slot
        if st.fp4 and ops.masked_moe_w4a8_takes(x, st.w13, st.s13, st.w2, st.s2):
            # W4A8 on the FP4 stacks (DEEPINFER_W4A8=1): the same FP8 slabs, the packed bytes decoded to e4m3
            xq, sx = ops.moe_dispatch(x, slot, K, E, fp8=True)                  # [E, C, d] e4m3
            gu = ops.w4a8_masked_moe_gemm(xq, sx, st.w13, st.s13, counts, expected_m)
            hq, sh = ops.moe_swiglu_quant(gu, slot, weights, ex.limit, inter, fp8=True)
            return ops.w4a8_masked_moe_gemm(hq, sh, st.w2, st.s2, counts, expected_m), slot
        xp = ops.moe_dispatch(x, slot, K, E)                                    # [E, C, d]
        w13, s13, w2, s2 = st.masked_weights()
        gu = ops.grouped_fp8_linear_masked(xp, w13, s13, counts, expected_m)    # [E, C, 2 inter]
        hp = ops.moe_swiglu_quant(gu, slot, weights, ex.limit, inter)           # [E, C, inter]
        out = ops.grouped_fp8_linear_masked(hp, w2, s2, counts, expected_m)     # [E, C, d]
        return out, slot

    def _routed_masked(self, x, weights, indices) -> torch.Tensor:
        """[T, K, d] bf16: the masked form's per-pair outputs (the forward combines them in place
        instead: ops.moe_combine)."""
        xs, ws, ids, _ = self._pad_slabs(x, weights, indices)
        out, slot = self._masked_experts(xs, ws, ids, expected_pairs=indices.numel())
        return out.reshape(-1, self.dim)[slot[:indices.numel()]].view(*indices.shape, self.dim)

    def _pad_slabs(self, x, weights, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(x, weights, indices, pad): the step padded by `pad` tokens to a multiple of 4 where that lets the
        masked FP8 x FP8 form take it (PAD_MASKED_SLABS), else as given with pad 0. A padding token is a zero
        row with the first token's picks (distinct experts) at weight 0; it adds rows to those experts' slabs,
        each computed alone (a pair's output depends on its row and expert only), and its outputs are dropped.
        The real pairs keep their slab rows' ranks (the padding comes after them in token order)."""
        T, st = x.shape[0], self.stacks
        pad = -T % 4
        if not PAD_MASKED_SLABS or pad == 0 or T == 0 or st is None or \
                not ops.masked_moe_fp8_takes(x.new_empty(1, 1).expand(T + pad, x.shape[1]), st.w13, st.r13,
                                             st.w2, st.r2):
            return x, weights, indices, 0
        return (_pad_rows(x, pad), _pad_rows(weights, pad),
                torch.cat([indices, indices[:1].expand(pad, indices.shape[1])]), pad)

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


class _ExpertParallel:
    """One MoE layer's share of the parallel state: its maps on the device, the shared dispatcher,
    the load recorder (EPLB)."""

    def __init__(self, parallel, layer_id: int) -> None:
        from deepinfer.parallel.placement import LayerPlacement
        self.parallel, self.layer_id = parallel, layer_id
        self.maps = LayerPlacement(parallel.placement, layer_id, "cpu")
        self.dispatcher = parallel.make_dispatcher()

    def to(self, device) -> None:
        self.maps.log2phy, self.maps.logcnt = self.maps.log2phy.to(device), self.maps.logcnt.to(device)

    def record(self, indices: torch.Tensor) -> None:
        """This layer's picks into the EPLB load window: no host read (a captured decode step records
        too), padding rows of a captured step (recorder.real_rows) not counted."""
        rec = self.parallel.recorder
        if rec is not None:
            flat = indices.flatten()
            ones = torch.ones_like(flat) if rec.real_rows is None else \
                rec.real_rows.to(flat.dtype).repeat_interleave(indices.shape[1])
            rec.record(self.layer_id, torch.zeros(rec.num_experts, dtype=flat.dtype, device=flat.device)
                       .index_add_(0, flat, ones))

    def local_logical(self) -> list[int]:
        return self.parallel.placement.local_logical(self.layer_id, self.parallel.rank)
