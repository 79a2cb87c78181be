"""Decode step of full-width DeepSeek-V4.1-Flash layers on one H200, composed from the fast ops
(kernels/triton_*.py) and captured as one CUDA graph; achieved HBM bandwidth over the measured copy
bandwidth; and an estimate of whole-model decode tokens/s per GPU at EP8 built from those timings.

    python perf/bench_layer_step.py [--batches 1 16 64 128] [--ctx 8192]   (layer_step.json/.png in $OUT)

Why not the `full-width-layers` checkpoint itself: it holds 384 FP4 experts in each of 7 layers
(~75 GB), more than the device machine's disk, and the model's torch path dequantizes experts
per use. This builds the same shapes and dtypes directly on the GPU (random weights):

  layer kinds   reuse   = attention over 128 window rows + 512 compressed rows picked by another
                          layer's indexer (32 of the 40 layers: ratio-2 and ratio-1 reusers, sources'
                          own compressor work aside)
                reindex = reuse + its own indexer: q projection, FP4 rounding, scores over the
                          request's whole context of index keys, candidate mask, top-512 (8 layers)
  per step      mHC mixes/Sinkhorn/collapse -> RMSNorm -> wq_a -> q_norm -> wq_b -> RoPE; wkv ->
                kv_norm -> RoPE -> FP8 rounding -> ring write; sparse sink attention; inverse RoPE;
                grouped wo_a (FP8 weights, bf16 activations: the reference's bf16 einsum values);
                wo_b; mHC post; mHC mixes -> RMSNorm -> router (sqrt-softplus, top-6) -> EP8 share
                of the routed experts (48 local experts, masked layout, FP4 experts held as exact
                FP8 + E8M0 per-row scales) with clamped SwiGLU -> shared expert -> combine -> mHC post
  KV            bf16 latent rows (1 KB/row; the V4 record would be 584 B)
Assumptions of the EP8 estimate: 8 DP attention ranks of `batch` tokens each, tokens spread evenly
over the 384 experts (each GPU serves 6*batch pairs over its 48 experts), dispatch/combine
all-to-all and the DSpark draft not included, Engram layers costed as plain layers, the head is a
bf16 [129280, 5120] GEMM on every rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import measure_ceilings, out_dir, save_json, time_calls  # noqa: E402

from deepinfer.kernels import deepgemm as dgm  # noqa: E402
from deepinfer.kernels import triton_gemm as tg  # noqa: E402
from deepinfer.kernels import triton_indexer as ti  # noqa: E402
from deepinfer.kernels import triton_mhc as tm  # noqa: E402
from deepinfer.kernels import triton_quant as tq  # noqa: E402
from deepinfer.kernels import triton_sparse_attn as tsa  # noqa: E402

D, H, HD, RD, QL, OG, OL, INTER = 5120, 64, 512, 64, 1280, 8, 1024, 2304
NE, TOPK, EP, HC, WIN, ITOPK, IH, ID = 384, 6, 8, 4, 128, 512, 32, 128
LOCAL = NE // EP
EPS = 1e-20
DEV = "cuda"


def fp8_weight(n, k, per_row=False, dev=None):
    """Random e4m3 [n, k] ~ N(0, 1/k) after scaling, with E8M0 scales per 32x32 tile or per (row, 32)."""
    dev = dev or DEV
    w = (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
    e = -6 - round(0.5 * math.log2(k))
    shape = (n, k // 32) if per_row else (n // 32, k // 32)
    return w, torch.full(shape, 127 + e, dtype=torch.uint8, device=dev)


class Lin8:
    """An FP8 linear in one of two modes. 'triton': our exact W8A16 kernel on (act_quant(x), e4m3,
    E8M0 32x32 tiles). 'deepgemm': the weight re-expressed on 128x128 tiles at construction and the
    FP8-rounded activation re-expressed per (row, 128) at run time (near-exact, see deepgemm.py)."""

    def __init__(self, w, s, mode):
        self.mode, self.n = mode, w.shape[0]
        if mode == "deepgemm":
            self.w, self.s, _ = dgm.reblock_weight_128(w, (s.to(torch.int32) << 23).view(torch.float32))
        else:
            self.w, self.s = w, s

    def __call__(self, x):
        if self.mode == "deepgemm":
            q, sa = tq.act_quant_fp8(tq.act_quant(x), block=128)
            return dgm.fp8_gemm_nt(q, sa, self.w, self.s)
        return tg.fp8_linear(x, self.w, self.s)


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w).to(torch.bfloat16)


def rope(x, cos, sin, inverse=False):
    """Adjacent pairs of the last 64 dims; cos/sin [B, 32] (broadcast over heads)."""
    shp = x.shape
    r = x[..., -RD:].float().unflatten(-1, (-1, 2))
    a, b = r[..., 0], r[..., 1]
    c = cos.view(cos.shape[0], *([1] * (x.dim() - 2)), -1)
    s = sin.view(sin.shape[0], *([1] * (x.dim() - 2)), -1)
    if inverse:
        s = -s
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-RD], rot], -1).view(shp)


class Layer:
    """One full-width decoder layer's weights and the static buffers of a decode step at batch B."""

    def __init__(self, B: int, ctx: int, reindex: bool, seed: int = 0, mode: str = "triton"):
        g = torch.Generator(device="cpu").manual_seed(seed)
        dev = DEV
        self.B, self.ctx, self.reindex, self.mode = B, ctx, reindex, mode
        self.fn = [torch.randn(24, HC * D, device=dev) * 1e-3 for _ in range(2)]
        self.hc_scale = torch.ones(3, device=dev)
        self.hc_base = torch.zeros(24, device=dev)
        self.norm_w = {k: torch.ones(n, device=dev) for k, n in (("attn", D), ("ffn", D), ("q", QL), ("kv", HD))}
        self.wq_a, self.wq_b, self.wkv = (Lin8(*fp8_weight(n, k), mode) for n, k in ((QL, D), (H * HD, QL), (HD, D)))
        wo_a, so_a = fp8_weight(OG * OL, H * HD // OG)
        self.wo_a = (wo_a.view(OG, OL, -1), so_a.view(OG, OL // 32, -1))
        self.wo_b = Lin8(*fp8_weight(D, OG * OL), mode)
        self.sink = torch.randn(H, device=dev)
        self.gate_w = torch.randn(NE, D, device=dev) / math.sqrt(D)
        self.gate_b = torch.randn(NE, device=dev) * 0.1
        self.sh_w13, self.sh_w2 = Lin8(*fp8_weight(2 * INTER, D), mode), Lin8(*fp8_weight(D, INTER), mode)
        self.ex_w13 = self._experts(2 * INTER, D)
        self.ex_w2 = self._experts(D, INTER)
        if reindex:
            self.idx_wq_b = Lin8(*fp8_weight(IH * ID, QL), mode)
            self.wproj = (torch.randn(IH, D, device=dev) / math.sqrt(D)).bfloat16()
            self.index_k = tq.fp4_quant(torch.randn(B * ctx, ID, device=dev).bfloat16(), 32)
            self.cand = torch.rand(B, ctx, device=dev) < 0.9
        # KV pool: per request a 128-row ring then ctx compressed rows
        self.rows_per = WIN + ctx
        self.kv = tq.act_quant(torch.randn(B * self.rows_per, HD, device=dev).bfloat16())
        base = torch.arange(B, device=dev)[:, None] * self.rows_per
        comp = torch.sort(torch.rand(B, ctx, generator=None, device=dev).topk(ITOPK, -1).indices, -1).values
        self.idx = torch.cat([base + torch.arange(WIN, device=dev), base + WIN + comp], 1).int()
        self.ring_rows = (base[:, 0] + 5).long()
        self.key_start = torch.arange(B, device=dev) * ctx
        self.lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
        ang = torch.rand(B, RD // 2, device=dev) * 6.28
        self.cos, self.sin = ang.cos(), ang.sin()
        # EP8 share: 6*B (token, expert) pairs land on this GPU's 48 experts
        pairs = TOPK * B
        counts = torch.bincount(torch.randint(0, LOCAL, (pairs,), generator=g), minlength=LOCAL)
        self.touched = int((counts > 0).sum())
        self.mmax = -(-max(16, int(counts.max())) // 64) * 64              # DeepGEMM masked: whole 64-row blocks
        self.expected_m = max(1, pairs // LOCAL)
        self.masked_m = counts.int().to(dev)
        src = torch.zeros(LOCAL, self.mmax, dtype=torch.long)
        dst = torch.full((LOCAL, self.mmax), B, dtype=torch.long)           # row B = dump row
        for e in range(LOCAL):
            c = int(counts[e])
            src[e, :c] = torch.randint(0, B, (c,), generator=g)
            dst[e, :c] = src[e, :c]
        self.src, self.dst = src.view(-1).to(dev), dst.view(-1).to(dev)
        self.route_w = (torch.rand(LOCAL * self.mmax, 1, device=dev) * 0.3)
        # static inputs
        self.X = torch.randn(B, HC, D, device=dev).bfloat16()
        self.pre_prev = torch.full((B, HC), 0.25, device=dev)

    def _experts(self, n, k):
        """LOCAL FP4-origin experts: e4m3 + E8M0 per (row, 32); in deepgemm mode re-expressed exactly
        on 128x128 tiles (E = max - 6 per tile, see deepgemm.fp4_weight_to_fp8_128)."""
        ws, ss = [], []
        for _ in range(LOCAL):
            w, s = fp8_weight(n, k, per_row=True)
            w = (w.float().clamp(-6, 6)).to(torch.float8_e4m3fn)          # FP4-grid magnitudes
            if self.mode == "deepgemm":
                w, s, _ = dgm.fp4_weight_to_fp8_128(w, (s.to(torch.int32) << 23).view(torch.float32))
            ws.append(w)
            ss.append(s)
        return torch.stack(ws), torch.stack(ss)

    def grouped(self, xe, w):
        """Masked grouped GEMM over the local experts: xe [LOCAL, mmax, K] bf16 (FP8-rounded)."""
        if self.mode == "deepgemm":
            k = xe.shape[-1]
            q, sa = tq.act_quant_fp8(xe.view(-1, k), block=128)
            return dgm.grouped_masked(q.view(LOCAL, self.mmax, k), sa.view(LOCAL, self.mmax, k // 128), *w,
                                      self.masked_m, self.expected_m)
        return tg.w8a16_grouped_gemm_masked(xe, *w, self.masked_m, self.expected_m)

    # ---- the step ---------------------------------------------------------------------------
    def attention(self, x, qr_out: list):
        B = self.B
        qr = rms(self.wq_a(x), self.norm_w["q"])
        qr_out.append(qr)
        q = rope(self.wq_b(qr).view(B, H, HD), self.cos, self.sin)
        kv = tq.act_quant(rope(rms(self.wkv(x), self.norm_w["kv"]), self.cos, self.sin))
        self.kv.index_copy_(0, self.ring_rows, kv)
        idx = self.idx
        if self.reindex:
            iq = self.idx_wq_b(qr).view(B, IH, ID)
            iq = tq.fp4_quant(rope(iq, self.cos, self.sin), 32)
            w = (F.linear(x, self.wproj) * (ID ** -0.5 * IH ** -0.5)).bfloat16()
            sc = ti.index_scores(iq, w, self.index_k, self.lens, key_start=self.key_start, num_keys=self.ctx)
            sc = sc.masked_fill(~self.cand, -math.inf)
            top = sc.topk(ITOPK, dim=-1, sorted=False).indices.sort(-1).values
            base = (torch.arange(B, device=x.device)[:, None] * self.rows_per + WIN)
            idx = torch.cat([self.idx[:, :WIN], (base + top).int()], 1)
        o = tsa.sparse_attn(q, self.kv, self.sink, idx, HD ** -0.5)
        o = rope(o, self.cos, self.sin, inverse=True).view(B, OG, -1).transpose(0, 1).contiguous()
        mm = torch.full((OG,), B, dtype=torch.int32, device=x.device)
        o = tg.w8a16_grouped_gemm_masked(o, *self.wo_a, mm, B)                   # [OG, B, OL]
        return self.wo_b(o.transpose(0, 1).reshape(B, OG * OL))

    def moe(self, x):
        B = self.B
        scores = F.softplus(F.linear(x.float(), self.gate_w)).sqrt()
        _, ids = (scores + self.gate_b).topk(TOPK, dim=-1)
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * 1.5
        xq = tq.act_quant(x)
        xe = xq.index_select(0, self.src).view(LOCAL, self.mmax, D)
        h = self.grouped(xe, self.ex_w13).float()
        gate, up = h[..., :INTER].clamp(max=10.0), h[..., INTER:].clamp(-10.0, 10.0)
        a = (F.silu(gate) * up * (self.route_w.view(LOCAL, self.mmax, 1) + wts.mean())).bfloat16()
        y = self.grouped(tq.act_quant(a), self.ex_w2)
        out = torch.zeros(B + 1, D, device=x.device)
        out.index_add_(0, self.dst, y.view(-1, D).float())
        hs = self.sh_w13(x).float()
        hs = (F.silu(hs[:, :INTER].clamp(max=10.0)) * hs[:, INTER:].clamp(-10.0, 10.0)).bfloat16()
        return (out[:B] + self.sh_w2(hs).float()).bfloat16()

    def step(self):
        X = self.X
        pre, post, comb, xin = tm.hc_mixes_pre(X, self.fn[0], self.hc_scale, self.hc_base, self.pre_prev, 20, 1e-6, EPS)
        qr = []
        a = self.attention(rms(xin, self.norm_w["attn"]), qr)
        X = tm.hc_post(a, X, post, comb)
        f_pre, f_post, f_comb, xin = tm.hc_mixes_pre(X, self.fn[1], self.hc_scale, self.hc_base, pre, 20, 1e-6, EPS)
        y = self.moe(rms(xin, self.norm_w["ffn"]))
        return tm.hc_post(y, X, f_post, f_comb)

    # ---- bytes the step must move (each input read once, each output written once) -------------
    def bytes(self) -> dict:
        B = self.B
        fp8 = lambda n, k: n * k * (1 + 1 / 1024)                        # noqa: E731  32x32 E8M0 tiles
        attn_w = fp8(QL, D) + fp8(H * HD, QL) + fp8(HD, D) + fp8(OG * OL, H * HD // OG) + fp8(D, OG * OL)
        mhc = 2 * 24 * HC * D * 4 + NE * D * 4
        shared = fp8(2 * INTER, D) + fp8(D, INTER)
        experts = self.touched * (2 * INTER * D + D * INTER) * (1 + 1 / 32)
        kv = B * (WIN + ITOPK) * HD * 2 + B * HD * 2
        index = (fp8(IH * ID, QL) + IH * D * 2 + B * self.ctx * (ID * 2 + 1)) if self.reindex else 0
        acts = 8 * B * HC * D * 2
        return dict(attn_weights=attn_w, mhc_router=mhc, shared=shared, experts=experts, kv=kv, index=index,
                    acts=acts, total=attn_w + mhc + shared + experts + kv + index + acts)


def head_time(B: int) -> float:
    head = torch.randn(129280, D, device="cuda").bfloat16()
    x = torch.randn(B, D, device="cuda").bfloat16()
    t = time_calls([lambda: F.linear(x, head)], iters=5)
    del head
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 128])
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--modes", nargs="+", default=["triton", "deepgemm"])
    ap.add_argument("--tag", default="", help="suffix of the output files")
    a = ap.parse_args()
    torch.manual_seed(0)
    C = measure_ceilings()
    bw = C["copy_bw"]
    print(f"copy {bw / 1e12:.3f} TB/s; bf16 {C['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    res = []
    if dgm.load() is None:
        a.modes = [m for m in a.modes if m != "deepgemm"]
    for mode in a.modes:
        for B in a.batches:
            r = {"batch": B, "mode": mode}
            for kind in ("reuse", "reindex"):
                try:
                    layer = Layer(B, a.ctx, reindex=kind == "reindex", mode=mode)
                    t = time_calls([layer.step], iters=5, reps=5)
                except Exception as e:  # noqa: BLE001
                    print(f"B{B} {kind} {mode} failed: {e!r}"[:300], flush=True)
                    break
                by = layer.bytes()
                r[kind] = dict(us=t * 1e6, bytes=by, GBps=by["total"] / t / 1e9, frac_copy=by["total"] / t / bw,
                               touched_experts=layer.touched)
                print(f"{mode:8s} B{B:4d} {kind:8s} {t * 1e6:8.1f} us  {by['total'] / 1e6:8.1f} MB  "
                      f"{by['total'] / t / 1e12:.2f} TB/s = {by['total'] / t / bw:.2f} of copy  (experts touched "
                      f"{layer.touched}/48, expert bytes {by['experts'] / by['total']:.0%})", flush=True)
                del layer
                torch.cuda.empty_cache()
            if "reindex" not in r:
                continue
            th = head_time(B)
            step = 32 * r["reuse"]["us"] + 8 * r["reindex"]["us"] + th * 1e6
            r["head_us"] = th * 1e6
            r["model_step_ms"] = step / 1e3
            r["tok_s_per_gpu"] = B / (step / 1e6)
            print(f"{mode:8s} B{B:4d} whole-model estimate: 32 x reuse + 8 x reindex + head {th * 1e6:.0f} us = "
                  f"{step / 1e3:.2f} ms per step -> {r['tok_s_per_gpu']:.0f} tok/s per GPU at EP8", flush=True)
            res.append(r)
    save_json(f"layer_step{a.tag}.json", {"ceilings": C, "ctx": a.ctx, "results": res})
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for mode in a.modes:
            rr = [r for r in res if r["mode"] == mode]
            bs = [r["batch"] for r in rr]
            for kind in ("reuse", "reindex"):
                ax[0].plot(bs, [r[kind]["frac_copy"] for r in rr], "o-", label=f"{kind} ({mode})")
            ax[1].plot(bs, [r["tok_s_per_gpu"] for r in rr], "o-", label=mode)
        ax[0].axhline(0.7, color="r", ls="--", lw=0.8, label="goal 0.7")
        ax[0].set_xscale("log", base=2)
        ax[0].set_xlabel("decode batch (tokens per GPU)")
        ax[0].set_ylabel("achieved bytes/s over copy bandwidth")
        ax[0].set_title(f"full-width layer decode step, ctx {a.ctx}")
        ax[0].legend()
        ax[1].legend()
        ax[1].set_xscale("log", base=2)
        ax[1].set_xlabel("decode batch (tokens per GPU)")
        ax[1].set_ylabel("estimated decode tok/s per GPU (EP8)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir(), f"layer_step{a.tag}.png"), dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed", e)


if __name__ == "__main__":
    main()
