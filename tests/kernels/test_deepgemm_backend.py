"""The DeepGEMM GEMM backend (DEEPINFER_GEMM=deepgemm, kernels/deepgemm.py) on a CPU: the re-blocking
math, the activation re-expression, the dispatch and its fallbacks, prepare_deepgemm on real presets,
and the whole backend path against a torch stand-in for DeepGEMM that makes DeepGEMM's host checks.
The GPU half (DeepGEMM itself, CUDA graphs, the small preset's logits) is tests/kernels/test_deepgemm.py."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from deepinfer.kernels import deepgemm as dg
from deepinfer.kernels import select
from deepinfer.kernels.reference import (act_quant_fp8_ref, act_quant_ref, dequant_fp8_ref, e2m1_round,
                                         e8m0_to_float)

from kernel_utils import rand_fp8_weight, rel_err

# Logits of the small preset through the DeepGEMM numerics vs the exact path, in check-parity's err
# (max |diff| over the exact run's top-512 ids, in units of its logit std). The random-weight model is
# chaotic at its discrete choices (MoE top-k, indexer top-k): one bf16 ulp moved in one GEMM of a
# 24-token prefill moved later rows' logits by up to 1.0 (CPU probe), unrelated logits are ~20 apart.
# So the check decodes several tokens from one identical state (the exact path's prefill, rollback in
# between): the median token must agree to DECODE_TOL (the CPU emulation: 0 for most tokens, 0.002-0.09
# for 3 of 12), and every token to FLIP_TOL (a routing / index flip, not garbage).
DECODE_TOL = 0.1
FLIP_TOL = 2.5


def logit_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    top = ref.topk(512, dim=-1).indices
    return float(((got.gather(-1, top) - ref.gather(-1, top)).abs().amax(-1) / ref.std(-1)).max())


def fp4_origin_weight(g: int, n: int, k: int, spread: int, seed: int = 0):
    """FP4-origin expert stack as the loader makes it: e2m1 values in e4m3 [g, n, k] with E8M0 bytes
    per (row, 32) whose exponents span `spread` binades (inside every 128x128 tile too)."""
    gen = torch.Generator().manual_seed(seed)
    v = e2m1_round((torch.randn(g, n, k, generator=gen) * 2).clamp(-6, 6))
    e = torch.randint(-10 - spread, -9, (g, n, k // 32), generator=gen)
    e[..., 0] = -10 - spread                      # the spread is met in every row's first tile
    e[..., 1] = -10
    return v.to(torch.float8_e4m3fn), (e + 127).to(torch.uint8)


# ---- the re-blocking math --------------------------------------------------------------------------

@pytest.mark.parametrize("per_row", [False, True])
def test_reblock_weight_128_counts_every_moved_element(per_row):
    """Re-blocked weight x its 128-tile scales == the dequantized original, except exactly `changed`
    elements, each of them tiny next to its tile's scale (below the e4m3 normals after the shift)
    and off by at most half a subnormal step."""
    n, k = 512, 640
    if per_row:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(n, k, generator=gen) * torch.exp(2 * torch.randn(n, k // 32, 1, generator=gen)).expand(
            n, k // 32, 32).reshape(n, k)
        q, s = act_quant_fp8_ref(x)                                            # per (row, 32) pow2
        exact = q.float() * s.repeat_interleave(32, 1)
    else:
        q, s8 = rand_fp8_weight(n, k, "cpu", seed=3)
        s = e8m0_to_float(s8)
        exact = dequant_fp8_ref(q, s8)
    w128, s128, changed = dg.reblock_weight_128(q, s)
    assert w128.dtype == torch.float8_e4m3fn and s128.shape == (n // 128, k // 128)
    rows = n // s.shape[0]
    assert torch.equal(s128, s.view(n // 128, 128 // rows, k // 128, 4).amax((1, 3)))
    got = dg.dequant_tile128(w128, s128)
    moved = got != exact
    assert int(moved.sum()) == changed
    assert changed < (0.2 if per_row else 2e-3) * n * k, changed      # per row: 128 rows' scales, spread 2^+-3
    big = s128.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert (exact[moved].abs() < big[moved] * 2.0 ** -6).all()
    assert ((got - exact)[moved].abs() <= big[moved] * 2.0 ** -10).all()
    assert torch.equal(dg.to_tile128(q, s)[0].view(torch.uint8), w128.view(torch.uint8))


def test_fp4_experts_convert_exactly():
    """FP4-origin weights: exact on 128x128 tiles while the exponent spread in a tile is <= 14; past
    that the elements that moved are counted."""
    w, s8 = fp4_origin_weight(1, 256, 256, spread=14)
    w128, s128, changed = dg.fp4_weight_to_fp8_128(w[0], e8m0_to_float(s8[0]))
    exact = w[0].float() * e8m0_to_float(s8[0]).repeat_interleave(32, 1)
    assert changed == 0 and torch.equal(dg.dequant_tile128(w128, s128), exact)
    assert dg.fp4_origin(w[0])
    w, s8 = fp4_origin_weight(1, 256, 256, spread=17)
    w128, s128, changed = dg.fp4_weight_to_fp8_128(w[0], e8m0_to_float(s8[0]))
    exact = w[0].float() * e8m0_to_float(s8[0]).repeat_interleave(32, 1)
    assert changed > 0 and int((dg.dequant_tile128(w128, s128) != exact).sum()) == changed


def test_to_tile128_stacks_and_forms():
    """to_tile128 takes E8M0 bytes or f32, 2-D or a stack (group by group), FP4-origin per-row weights
    through the exact conversion; is_tile128 tells the forms apart by their scale shapes."""
    w, s8 = fp4_origin_weight(3, 256, 384, spread=10)
    w128, s128, changed = dg.to_tile128(w, s8)
    assert changed == 0 and s128.shape == (3, 2, 3) and dg.is_tile128(w128, s128)
    assert not dg.is_tile128(w, s8) and not dg.is_tile128(w, e8m0_to_float(s8))
    for i in range(3):
        assert torch.equal(dg.dequant_tile128(w128[i], s128[i]),
                           w[i].float() * e8m0_to_float(s8[i]).repeat_interleave(32, 1))
    q, t8 = rand_fp8_weight(256, 256, "cpu")
    assert not dg.is_tile128(q, e8m0_to_float(t8))
    assert dg.shapes_ok(256, 384) and not dg.shapes_ok(256, 320) and not dg.shapes_ok(96, 256)


def test_act_quant_fp8_ref():
    """(q, s) form of act_quant_ref: q * s is act_quant_ref bit for bit, at 32 and 128."""
    x = torch.randn(3, 5, 384) * torch.exp(3 * torch.randn(3, 5, 1))
    x[0, 0, :64] = 0
    x = x.bfloat16()
    for block in (32, 128):
        q, s = act_quant_fp8_ref(x, block)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (15, 384) and s.shape == (15, 384 // block)
        deq = (q.float().view(15, -1, block) * s[..., None]).view(3, 5, 384).bfloat16()
        assert torch.equal(deq, act_quant_ref(x, block))
    q, s = act_quant_fp8_ref(torch.zeros(0, 256), 128)
    assert q.shape == (0, 256) and s.shape == (0, 2)


def test_activation_128_is_reblock_of_per32():
    """The backend's activations: per-128 quantization of the act_quant values is bit for bit
    act_reblock_128 of their per-32 form, and holds the act_quant values except tiny elements in a
    32-block far below its 128-block's max (each below 2^-6 of the 128 scale, off by <= 2^-10 of it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=gen) * torch.exp(2.5 * torch.randn(64, 32, 1, generator=gen)).expand(
        64, 32, 32).reshape(64, 1024)
    x = x.bfloat16()
    xq = act_quant_ref(x)
    q128, s128 = dg.act_quant_128(x)
    assert torch.equal(q128.view(torch.uint8), act_quant_fp8_ref(xq, 128)[0].view(torch.uint8))
    r_q, r_s = dg.act_reblock_128(*act_quant_fp8_ref(xq, 32))
    assert torch.equal(q128.view(torch.uint8), r_q.view(torch.uint8)) and torch.equal(s128, r_s)
    pq, ps = dg.act_quant_128(xq, prerounded=True)
    assert torch.equal(pq.view(torch.uint8), q128.view(torch.uint8)) and torch.equal(ps, s128)
    big = s128.repeat_interleave(128, 1)
    got = q128.float() * big
    moved = got != xq.float()
    print(f"activation elements moved by the 128 re-expression: {int(moved.sum())} of {x.numel()}")
    assert int(moved.sum()) < 0.05 * x.numel()
    assert (xq.float()[moved].abs() < big[moved] * 2.0 ** -6).all()
    assert ((got - xq.float())[moved].abs() <= big[moved] * 2.0 ** -10).all()


_INTERPRET_QUANT = """
import torch
from deepinfer.kernels import triton_quant
from deepinfer.kernels.reference import act_quant_fp8_ref, act_quant_ref
torch.manual_seed(0)
for m, k in ((5, 384), (3, 1024), (2, 128), (64, 2304)):
    x = (torch.randn(m, k) * torch.exp(3 * torch.randn(m, 1))).bfloat16()
    x[0, :40] = 0
    q, s = triton_quant.act_quant_fp8(triton_quant.act_quant(x), 128)
    rq, rs = act_quant_fp8_ref(act_quant_ref(x), 128)
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs), (m, k)      # values (+-0 alike)
print("ok")
"""


def test_act_quant_fp8_block128_under_interpreter():
    """The Triton kernels the backend runs on activations (act_quant, then act_quant_fp8 at block 128;
    K = 384 gives one 128-block per program), bit for bit the reference, under Triton's interpreter."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERPRET_QUANT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# ---- the knob and the dispatch -------------------------------------------------------------------

def test_knob_rejects_unknown_backend():
    env = dict(os.environ, DEEPINFER_GEMM="cublas")
    r = subprocess.run([sys.executable, "-c", "import deepinfer.kernels.select"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "DEEPINFER_GEMM" in r.stderr


def test_knob_falls_back_on_cpu(monkeypatch):
    """DEEPINFER_GEMM=deepgemm on a CPU: the same bits as the default, nothing converted, no DeepGEMM."""
    q, s8 = rand_fp8_weight(256, 384, "cpu")
    w, e8 = fp4_origin_weight(4, 256, 384, spread=6)
    x = torch.randn(3, 384).bfloat16()
    xp = act_quant_ref(torch.randn(4, 5, 384).bfloat16())
    mm = torch.tensor([0, 5, 2, 1], dtype=torch.int32)
    before = dict(dg.STATS)
    outs = {}
    for gemm in ("triton", "deepgemm"):
        monkeypatch.setattr(select, "GEMM", gemm)
        outs[gemm] = (select.fp8_linear(x, q, s8), select.grouped_fp8_linear_masked(xp, w, e8, mm, 2))
    assert not select.deepgemm_active(x) and not select.deepgemm_usable(x)
    assert torch.equal(outs["triton"][0], outs["deepgemm"][0]) and torch.equal(outs["triton"][1], outs["deepgemm"][1])
    assert dg.STATS == before and not hasattr(q, "_deepgemm_tile128") and not hasattr(w, "_deepgemm_tile128")
    monkeypatch.setattr(select, "GEMM", "deepgemm")
    model = types.SimpleNamespace(modules=lambda: [types.SimpleNamespace(fp8=(q, s8))])
    assert dg.prepare_deepgemm(model)["active"] is False


def test_tile128_weights_fall_back_to_the_exact_reference(monkeypatch):
    """Weights prepared in place (f32 128-tile scales) give the 32-form's reference bits where DeepGEMM
    cannot run, whatever the knob (the conversion of FP4-origin experts is exact)."""
    w, e8 = fp4_origin_weight(4, 256, 384, spread=12)
    w128, s128, changed = dg.to_tile128(w, e8)
    assert changed == 0
    x = torch.randn(7, 384).bfloat16()
    xp = act_quant_ref(torch.randn(4, 5, 384).bfloat16())
    mm = torch.tensor([0, 5, 2, 1], dtype=torch.int32)
    for gemm in ("triton", "deepgemm"):
        monkeypatch.setattr(select, "GEMM", gemm)
        assert torch.equal(select.fp8_linear(x, w128[1], s128[1]), select.fp8_linear(x, w[1], e8[1]))
        assert torch.equal(select.grouped_fp8_linear_masked(xp, w128, s128, mm, 2),
                           select.grouped_fp8_linear_masked(xp, w, e8, mm, 2))


# ---- the backend path against a torch stand-in for DeepGEMM --------------------------------------

class FakeDeepGEMM:
    """DeepGEMM's two SM90 entry points in torch (fp32 products of the exact 128-scaled operands), with
    the host checks DeepGEMM makes plus ours: whole MASKED_M_ALIGN-row groups, masked_m int32 on the
    tensors' device, expected_m a positive host int. Rows >= masked_m[g] come back NaN."""

    def __init__(self):
        self.calls = {"gemm": 0, "masked": 0}

    @staticmethod
    def _deq(t, s, rows):
        """rows 1: per-(row, 128) activation scales; 128: 128x128 weight tiles."""
        s = s.repeat_interleave(128, -1)
        return t.float() * (s if rows == 1 else s.repeat_interleave(128, -2))

    def fp8_gemm_nt(self, a_pair, b_pair, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
        (a, sa), (b, sb) = a_pair, b_pair
        m, k = a.shape
        n = b.shape[0]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.is_contiguous()
        assert sa.dtype == sb.dtype == torch.float32 and tuple(sa.shape) == (m, k // 128)
        assert tuple(sb.shape) == (n // 128, k // 128) and k % 128 == 0 and n % 128 == 0
        assert d.dtype == torch.bfloat16 and tuple(d.shape) == (m, n) and d.is_contiguous() and c is None
        d.copy_((self._deq(a, sa, 1) @ self._deq(b, sb, 128).T).bfloat16())
        self.calls["gemm"] += 1

    def m_grouped_fp8_gemm_nt_masked(self, a_pair, b_pair, d, masked_m, expected_m, recipe=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False):
        (a, sa), (b, sb) = a_pair, b_pair
        g, m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.is_contiguous()
        assert m % dg.MASKED_M_ALIGN == 0, "a group's last BLOCK_M box would spill into the next group"
        assert sa.dtype == sb.dtype == torch.float32 and tuple(sa.shape) == (g, m, k // 128)
        assert tuple(b.shape) == (g, n, k) and tuple(sb.shape) == (g, n // 128, k // 128)
        assert d.dtype == torch.bfloat16 and tuple(d.shape) == (g, m, n) and d.is_contiguous()
        assert masked_m.dtype == torch.int32 and masked_m.is_contiguous() and tuple(masked_m.shape) == (g,)
        assert masked_m.device == a.device and type(expected_m) is int and expected_m > 0
        d.fill_(float("nan"))
        for i in range(g):
            mi = int(masked_m[i])
            assert 0 <= mi <= m
            d[i, :mi] = (self._deq(a[i, :mi], sa[i, :mi], 1) @ self._deq(b[i], sb[i], 128).T).bfloat16()
        self.calls["masked"] += 1


@pytest.fixture
def fake_dg(monkeypatch):
    """The backend on with the stand-in: DEEPINFER_GEMM=deepgemm, DeepGEMM 'usable' for CPU tensors."""
    fake = FakeDeepGEMM()
    monkeypatch.setattr(dg, "load", lambda: fake)
    monkeypatch.setattr(select, "GEMM", "deepgemm")
    monkeypatch.setattr(select, "deepgemm_usable", lambda t: True)
    return fake


def test_backend_linear_through_fake_deepgemm(fake_dg):
    """fp8_linear: act_quant -> per-128 activations, the weight's 128-tile form built once and kept on
    the weight, DeepGEMM's normal GEMM; near the exact reference; dims off 128 stay on the old path."""
    q, s8 = rand_fp8_weight(384, 640, "cpu", seed=5)
    x = torch.randn(2, 3, 640).bfloat16()
    n0 = dg.STATS["linears"]
    y = select.fp8_linear(x, q, s8)
    assert y.shape == (2, 3, 384) and y.dtype == torch.bfloat16 and fake_dg.calls["gemm"] == 1
    w128, s128 = dg.cached_tile128(q, s8)
    aq, asc = dg.act_quant_128(x.view(6, 640))
    want = (aq.float() * asc.repeat_interleave(128, 1)) @ dg.dequant_tile128(w128, s128).T
    assert torch.equal(y.view(6, 384), want.bfloat16())
    exact = torch.nn.functional.linear(act_quant_ref(x).float(), dequant_fp8_ref(q, s8)).bfloat16()
    assert rel_err(y, exact) < 5e-3
    select.fp8_linear(x, q, s8)
    assert dg.STATS["linears"] == n0 + 1 and fake_dg.calls["gemm"] == 2          # converted once
    assert select.fp8_linear(torch.zeros(0, 640).bfloat16(), q, s8).shape == (0, 384)
    q2, t2 = rand_fp8_weight(96, 640, "cpu")                                       # N not a multiple of 128
    assert torch.equal(select.fp8_linear(x, q2, t2), torch.nn.functional.linear(
        act_quant_ref(x).float(), dequant_fp8_ref(q2, t2)).bfloat16())
    assert fake_dg.calls["gemm"] == 2


@pytest.mark.parametrize("c", [1, 5, 128, 130])
def test_backend_masked_through_fake_deepgemm(fake_dg, c):
    """grouped_fp8_linear_masked: capacity padded to whole 128-row groups, masked_m passed through on
    the device, expected_m a host int; valid rows exactly the emulated DeepGEMM on the exact FP4 expert
    values; rows past masked_m (garbage, NaN here) never reach valid rows."""
    g, n, k = 4, 256, 384
    w, e8 = fp4_origin_weight(g, n, k, spread=8, seed=2)
    x = act_quant_ref(torch.randn(g, c, k).bfloat16())
    counts = [0, c, min(2, c), c // 2]
    mm = torch.tensor(counts, dtype=torch.int32)
    for i in range(g):
        x[i, counts[i]:] = float("nan")
    y = select.grouped_fp8_linear_masked(x, w, e8, mm, max(1, c // 2))
    assert y.shape == (g, c, n) and fake_dg.calls["masked"] == 1
    w128, s128 = dg.cached_tile128(w, e8)
    for i in range(g):
        r = counts[i]
        aq, asc = dg.act_quant_128(x[i, :r], prerounded=True)
        want = ((aq.float() * asc.repeat_interleave(128, 1)) @ dg.dequant_tile128(w128[i], s128[i]).T).bfloat16()
        assert torch.equal(y[i, :r], want)
        exact = (x[i, :r].float() @ (w[i].float() * e8m0_to_float(e8[i]).repeat_interleave(32, 1)).T).bfloat16()
        if r:
            assert rel_err(y[i, :r], exact) < 5e-3
    y2 = select.grouped_fp8_linear_masked(x, w128, s128, mm.long())       # prepared form; int64 counts
    for i in range(g):
        assert torch.equal(y2[i, :counts[i]], y[i, :counts[i]])


def _run_model(model, prompt, decode=(5, 77)):
    from deepinfer.model.simple import SequenceRunner
    r = SequenceRunner(model, max_len=64)
    outs = [r.step(prompt, logits="all").logits]
    for tok in decode:
        outs.append(r.step([tok]).logits)
    return outs


def _fp8_linears(model):
    from deepinfer.model.layers import Linear
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Linear) and m.fp8 is not None]


def test_prepare_converts_the_small_preset(small_checkpoint):
    """prepare_deepgemm on the small preset (every dim a multiple of 128): every MoE's stacks in place
    on 128x128 tiles (f32 scales, same e4m3 storage, expert views re-pointed, 0 elements changed), every
    other FP8 linear with its 128-tile copy cached (changes counted exactly); where DeepGEMM cannot run
    (this CPU) the converted model gives the same logits bit for bit, masked and loop MoE forms."""
    from deepinfer.model.loader import load_model
    from deepinfer.model.moe import MoE
    torch.manual_seed(0)
    prompt = torch.randint(1000, 50000, (9,)).tolist()
    model = load_model(small_checkpoint, progress=False, weight_format="fp8", moe_masked=True)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    ref = {masked: (setattr_all(moes, masked), _run_model(model, prompt))[1] for masked in (True, False)}
    ptrs = [(m.stacks.w13.data_ptr(), m.stacks.w2.data_ptr()) for m in moes]
    expert_ids = {id(lin) for m in moes for ex in m.experts for lin in (ex.w1, ex.w2, ex.w3)}
    others = [(n, lin, lin.fp8) for n, lin in _fp8_linears(model) if id(lin) not in expert_ids]
    rep = dg.prepare_deepgemm(model, force=True)
    assert rep["active"] and rep["stacks"] == len(moes) and rep["expert_changed"] == 0 and rep["skipped"] == 0
    assert rep["linears"] == len(others) > 0
    for m, (p13, p2) in zip(moes, ptrs):
        st, inter = m.stacks, m.stacks.w2.shape[2]
        assert dg.is_tile128(st.w13, st.s13) and dg.is_tile128(st.w2, st.s2)
        assert (st.w13.data_ptr(), st.w2.data_ptr()) == (p13, p2)
        for e, ex in enumerate(m.experts):
            assert ex.w1.fp8[0].data_ptr() == st.w13[e].data_ptr()
            assert ex.w3.fp8[0].data_ptr() == st.w13[e, inter:].data_ptr()
            assert ex.w3.fp8[1].data_ptr() == st.s13[e, inter // 128:].data_ptr()
            assert ex.w2.fp8[1].data_ptr() == st.s2[e].data_ptr()
            assert all(dg.is_tile128(*lin.fp8) for lin in (ex.w1, ex.w2, ex.w3))
    moved = 0
    for name, lin, (w, s) in others:
        assert lin.fp8[0] is w and lin.fp8[1] is s and s.dtype == torch.uint8, name      # originals kept
        w128, s128 = dg.cached_tile128(w, s)
        moved += int((dg.dequant_tile128(w128, s128) != dequant_fp8_ref(w, s)).sum())
    assert moved == rep["linear_changed"]
    print(f"small preset: {rep}")
    for masked in (True, False):
        setattr_all(moes, masked)
        got = _run_model(model, prompt)
        assert all(torch.equal(a, b) for a, b in zip(got, ref[masked])), masked


def setattr_all(moes, masked):
    for m in moes:
        m.masked = masked


def test_prepare_leaves_the_tiny_preset_on_the_triton_path(tiny_checkpoint):
    """The tiny preset's dims are not multiples of 128: nothing converted, every FP8 weight counted
    as left on the existing path, logits unchanged."""
    from deepinfer.model.loader import load_model
    model = load_model(tiny_checkpoint, progress=False, weight_format="fp8")
    before = [(lin.fp8[0], lin.fp8[1]) for _, lin in _fp8_linears(model)]
    rep = dg.prepare_deepgemm(model, force=True)
    assert rep["active"] and rep["stacks"] == 0 and rep["linears"] == 0 and rep["skipped"] > 0
    after = [(lin.fp8[0], lin.fp8[1]) for _, lin in _fp8_linears(model)]
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(before, after))
    assert not any(hasattr(w, "_deepgemm_tile128") for w, _ in after)


def decode_errors(model, prompt, toks, to_deepgemm) -> list[float]:
    """Prefill `prompt` on the current (exact) path; decode each of `toks` from that same state
    (rollback in between) on it, then again after to_deepgemm(): the err of each token's logits."""
    from deepinfer.model.simple import SequenceRunner
    r = SequenceRunner(model, max_len=len(prompt) + 8)
    r.step(prompt)
    ref = []
    for t in toks:
        ref.append(r.step([t]).logits.float())
        r.rollback(1)
    to_deepgemm()
    errs = []
    for t, rf in zip(toks, ref):
        errs.append(logit_err(r.step([t]).logits, rf))
        r.rollback(1)
    return errs


def check_decode_errors(errs: list[float]) -> None:
    assert sorted(errs)[len(errs) // 2] <= DECODE_TOL and max(errs) <= FLIP_TOL, errs


def test_small_preset_through_fake_deepgemm(small_checkpoint, fake_dg):
    """The whole small preset through the backend path with DeepGEMM's numerics emulated: prepare at
    load, a prefill in the masked and the loop MoE forms (within FLIP_TOL of the exact path), and the
    decode check above; DeepGEMM called for the linears and the masked experts."""
    from deepinfer.model.loader import load_model
    from deepinfer.model.moe import MoE
    torch.manual_seed(1)
    prompt = torch.randint(1000, 50000, (12,)).tolist()
    toks = torch.randint(1000, 50000, (8,)).tolist()
    select.GEMM = "triton"                        # the exact model first (monkeypatch restores the knob)
    exact = load_model(small_checkpoint, progress=False, weight_format="fp8", moe_masked=True)
    ref = _run_model(exact, prompt)
    select.GEMM = "deepgemm"
    model = load_model(small_checkpoint, progress=False, weight_format="fp8", moe_masked=True)   # prepared at load
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert all(dg.is_tile128(m.stacks.w13, m.stacks.s13) for m in moes)
    errs = [logit_err(g, r) for g, r in zip(_run_model(model, prompt), ref)]
    assert fake_dg.calls["gemm"] > 0 and fake_dg.calls["masked"] > 0
    setattr_all(moes, False)
    calls = fake_dg.calls["gemm"]
    errs.append(logit_err(_run_model(model, prompt)[-1], ref[-1]))
    assert fake_dg.calls["gemm"] > calls
    print(f"small preset prefill + 2 decodes, emulated DeepGEMM vs exact: logit err {errs}")
    assert max(errs) <= FLIP_TOL, errs

    select.GEMM = "triton"
    exact = load_model(small_checkpoint, progress=False, weight_format="fp8")

    def to_deepgemm():
        select.GEMM = "deepgemm"
        assert dg.prepare_deepgemm(exact)["stacks"] == len(moes)
    masked0 = fake_dg.calls["masked"]
    errs = decode_errors(exact, prompt, toks, to_deepgemm)
    print(f"small preset, decodes from one state, emulated DeepGEMM vs exact: logit err {errs}")
    assert fake_dg.calls["masked"] == masked0        # the CPU decodes take the loop form (expert views)
    check_decode_errors(errs)
