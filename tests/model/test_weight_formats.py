"""Loader weight formats: "fp8" (FP8 linears kept as e4m3 + E8M0 and run by ops.fp8_linear, MXFP4
experts converted once to FP8 stacks) gives the same logits as "dense" (everything dequantized at
load) on the tiny preset, bit for bit on a CPU: both are act_quant + an fp32 matmul of the same exact
weight values. And "fp8" keeps no dense copy next to the FP8 bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.model import ops
from deepinfer.model.layers import Linear
from deepinfer.model.loader import load_model
from deepinfer.model.moe import MoE
from deepinfer.model.simple import SequenceRunner


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    torch.set_num_threads(1)
    return {
        "dense": load_model(tiny_checkpoint, progress=False, weight_format="dense"),
        "fp8": load_model(tiny_checkpoint, progress=False, weight_format="fp8"),
        "fp8-masked": load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=True),
        "fp8-fused": load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=True,
                                fuse_linears=True),
        # EngineArgs.dense_weights="bf16": dense linears dequantized at load, experts in FP8 stacks
        "fp8-dense-linears": load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_bf16=True,
                                        moe_masked=True),
        # and fused as CUDA loads it: wq_a + wkv and the shared w1 + w3 as stacked dense weights
        "fp8-dense-fused": load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_bf16=True,
                                      moe_masked=True, fuse_linears=True),
        # EngineArgs.dense_weights="bf16+fp8": the same, each bf16-held Linear keeping its FP8 bytes
        "fp8-dense-copy": load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_bf16=True,
                                     moe_masked=True, fuse_linears=True, dense_fp8_copy=True),
        # EngineArgs.expert_format="fp4": the experts' release bytes in FP4 stacks (masked form, and the
        # per-expert loop through the Linears' packed views)
        "fp4-experts": load_model(tiny_checkpoint, progress=False, weight_format="fp8", expert_format="fp4",
                                  moe_masked=True, dense_bf16=True, fuse_linears=True),
        "fp4-experts-loop": load_model(tiny_checkpoint, progress=False, weight_format="fp8", expert_format="fp4"),
    }


def _run(model) -> list[torch.Tensor]:
    """A 70-token prompt (every row's logits), three decodes, a 3-token step, a DSpark proposal."""
    torch.manual_seed(0)
    prompt = torch.randint(1000, 50000, (70,)).tolist()
    r = SequenceRunner(model, max_len=96)
    out = r.step(prompt, logits="all", dump_hidden=True)
    outs = [out.logits, out.hidden]
    for tok in (5, 77, 1234):
        o = r.step([tok])
        outs.append(o.logits)
    o = r.step([3, 4, 5], logits="all")
    outs += [o.logits, o.main_hidden]
    r.dspark_absorb(o.main_hidden, r._last_positions)
    draft = r.dspark_propose(int(o.logits[-1].argmax()), len(r.tokens))
    outs += [t for t in vars(draft).values() if isinstance(t, torch.Tensor)]
    return outs


def test_fp8_format_equals_dense(models):
    ref = _run(models["dense"])
    for fmt in ("fp8", "fp8-masked", "fp8-fused", "fp8-dense-linears", "fp8-dense-fused", "fp4-experts",
                "fp4-experts-loop"):
        got = _run(models[fmt])
        assert len(got) == len(ref)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert torch.equal(g, r), f"{fmt}: output {i} differs by {(g.float() - r.float()).abs().max()}"


def test_fp8_format_keeps_release_bytes(models):
    """Every FP8 linear but wo_a holds e4m3 + E8M0 and an empty dense buffer; experts are views of
    their layer's stacks; the whole model takes fewer bytes than the dense one."""
    dense, fp8 = models["dense"], models["fp8"]
    n_fp8 = 0
    for name, mod in fp8.named_modules():
        if not isinstance(mod, Linear):
            continue
        if name.endswith("wo_a"):
            assert mod.fp8 is None and mod.weight.numel() > 0        # the bf16 einsum reads .weight
        elif mod.fp8 is not None:
            n_fp8 += 1
            w, s = mod.fp8
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and mod.weight.numel() == 0
            assert torch.equal(ops.dequant_fp8(w, s), dict(dense.named_modules())[name].weight), name
    assert n_fp8 > 0
    for moe in (m for m in fp8.modules() if isinstance(m, MoE)):
        st = moe.stacks
        for e, ex in enumerate(moe.experts):
            assert ex.w1.fp8[0].data_ptr() == st.w13[e].data_ptr()
            assert ex.w3.fp8[0].data_ptr() == st.w13[e, moe.experts[0].w2.in_features:].data_ptr()
            assert ex.w2.fp8[1].data_ptr() == st.s2[e].data_ptr()

    def linear_bytes(model):
        """Storage behind every FP8/FP4 checkpoint linear (shared stacks counted once)."""
        seen, total = set(), 0
        for name, mod in model.named_modules():
            if not isinstance(mod, Linear) or not any(k in name for k in FP8_OR_FP4):
                continue
            for t in (mod.weight, *(mod.fp8 or ())):
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total

    # dense keeps fp32 on a CPU (4 B per weight); FP8 1 + 1/32 B (1 + 1/1024 for 32x32 tiles), and
    # wo_a stays dense in both
    assert linear_bytes(fp8) < 0.4 * linear_bytes(dense)


FP8_OR_FP4 = ("wq_a", "wq_b", "attn.wkv", "wo_a", "wo_b", "experts", "engram.wkv", "main_proj")


def test_bad_weight_format(tiny_checkpoint):
    with pytest.raises(ValueError, match="weight_format"):
        load_model(tiny_checkpoint, progress=False, weight_format="fp4")
    with pytest.raises(ValueError, match="expert_format"):
        load_model(tiny_checkpoint, progress=False, weight_format="fp8", expert_format="fp6")


def test_fp4_experts_hold_the_release_bytes(models, tiny_checkpoint):
    """expert_format="fp4": every layer's stacks are the checkpoint's MXFP4 bytes (fp4_kernel_layout) and
    E8M0 bytes, half the FP8 stacks' weight bytes, the experts' Linears views of them; every expert
    dequantizes to the FP8 stacks' weights."""
    from deepinfer.kernels.fp4_layout import fp4_release_layout
    fp4, fp8 = models["fp4-experts"], models["fp8"]
    moes4 = [m for m in fp4.modules() if isinstance(m, MoE)]
    moes8 = [m for m in fp8.modules() if isinstance(m, MoE)]
    assert moes4 and len(moes4) == len(moes8)
    for m4, m8 in zip(moes4, moes8):
        st4, st8 = m4.stacks, m8.stacks
        assert st4.fp4 and not st8.fp4 and st4.w13.dtype == torch.uint8
        assert st4.w13.numel() * 2 == st8.w13.numel() and st4.w2.numel() * 2 == st8.w2.numel()
        for e, ex in enumerate(m4.experts):
            assert ex.w1.packed[0].data_ptr() == st4.w13[e].data_ptr() and ex.w1.packed_kernel_layout
            assert torch.equal(ex.w1.dense(), m8.experts[e].w1.dense())
            assert torch.equal(ex.w2.dense(), m8.experts[e].w2.dense())
            assert torch.equal(ops.dequant_fp4(fp4_release_layout(st4.w2[e]), st4.s2[e]),
                               ops.dequant_fp8(st8.w2[e], st8.s2[e]))


def test_fp4_experts_out_of_range_scales_fall_back(tiny_checkpoint, tmp_path, caplog):
    """A valid checkpoint whose expert block scales the W4A16 decode cannot take (byte 1: 0.5 * 2^-126 is a
    subnormal bf16) loads with expert_format="fp4": that layer keeps FP8 stacks (said once in the log) and
    the model computes what the FP8 format does."""
    import shutil
    from safetensors.torch import load_file, save_file
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    hit = None
    for f in sorted(ckpt.glob("*.safetensors")):
        ts = load_file(f)
        names = [n for n in ts if ".experts.0.w2.scale" in n]
        if names and hit is None:
            hit = names[0]
            ts[hit] = ts[hit].clone()
            ts[hit].view(torch.uint8)[0, 0] = 1
            save_file(ts, f, metadata={"format": "pt"})
    assert hit is not None
    with caplog.at_level("WARNING"):
        m4 = load_model(ckpt, progress=False, weight_format="fp8", expert_format="fp4", moe_masked=True)
    assert "keep FP8 stacks" in caplog.text
    fmts = [m.stacks.fp4 for m in m4.modules() if isinstance(m, MoE)]
    assert fmts.count(False) == 1 and fmts.count(True) == len(fmts) - 1
    m8 = load_model(ckpt, progress=False, weight_format="fp8", moe_masked=True)
    for g, r in zip(_run(m4), _run(m8)):
        assert torch.equal(g, r)


# Run with TRITON_INTERPRET=1 DEEPINFER_KERNELS=fast (read at import, hence a subprocess).
_FAST_DISPATCH = """
import sys, torch
from deepinfer.kernels import select
from deepinfer.model.loader import load_model
m = load_model(sys.argv[1], progress=False, weight_format="fp8")
torch.manual_seed(0)
def both(f):
    select.KERNELS = "fast"; assert select.use_fast(torch.zeros(1)); a = f()
    select.KERNELS = "ref"; b = f()
    return a.float(), b.float()
checks = []
for lin in (m.layers[3].attn.wq_b, m.layers[3].attn.wo_b, m.layers[3].ffn.shared_experts.w2, m.layers[4].engram.wkv):
    x = torch.randn(5, lin.in_features).to(torch.bfloat16)
    checks.append(both(lambda: select.fp8_linear(x, *lin.fp8)))
st, E, T = m.layers[3].ffn.stacks, m.layers[3].ffn.n_experts, 7
masked_m = torch.tensor([0, 7, 3, 1, 0, 2, 7, 5], dtype=torch.int32)[:E]
for w, s in ((st.w13, st.s13), (st.w2, st.s2)):
    xp = select._ref.act_quant_ref(torch.randn(E, T, w.shape[2]).to(torch.bfloat16))
    valid = lambda y: torch.cat([y[e, :masked_m[e]] for e in range(E)])
    checks.append(both(lambda: valid(select.grouped_fp8_linear_masked(xp, w, s, masked_m, 3))))
m4 = load_model(sys.argv[1], progress=False, weight_format="fp8", expert_format="fp4")
st4 = m4.layers[3].ffn.stacks
for w, s in ((st4.w13, st4.s13), (st4.w2, st4.s2)):
    xp = select._ref.act_quant_ref(torch.randn(E, T, w.shape[2] * 2).to(torch.bfloat16))
    valid = lambda y: torch.cat([y[e, :masked_m[e]] for e in range(E)])
    checks.append(both(lambda: valid(select.grouped_fp8_linear_masked(xp, w, s, masked_m, 3))))
for a, b in checks:
    # the interpreter truncates float -> bf16 casts where a GPU rounds: one bf16 ulp apart at most
    assert ((a - b).abs() <= b.abs() * 2 ** -7 + 1e-30).all(), ((a - b).abs() / b.abs()).max()
print("ok", len(checks))
"""


def test_fp8_fast_dispatch_under_interpreter(tiny_checkpoint):
    """select.fp8_linear / grouped_fp8_linear_masked take the Triton W8A16 kernels on the model's
    own FP8 tensors (32x32-tile and per-row E8M0 scales, int32 masked_m, empty groups), and the W4A16 one
    on its FP4 stacks (expert_format="fp4"), through
    Triton's interpreter, and agree with the references to the last bf16 bit."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    r = subprocess.run([sys.executable, "-c", _FAST_DISPATCH, str(tiny_checkpoint)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok 8" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_fused_input_linears_share_one_weight(models):
    """fuse_linears: wq_a and wkv of every layer become views of one stacked FP8 weight (no copy kept
    beside it), and the stacked Linear is what qkv runs."""
    fused = [m for m in models["fp8-fused"].modules() if getattr(m, "wqkv_a", None) is not None]
    assert fused and all(getattr(m, "wqkv_a", None) is None for m in models["fp8"].modules())
    for att in fused:
        w, s = att.wqkv_a.fp8
        assert att.wq_a.fp8[0].data_ptr() == w.data_ptr()
        assert att.wkv.fp8[0].data_ptr() == w[att.wq_a.out_features:].data_ptr()
        assert w.shape[0] == att.wq_a.out_features + att.wkv.out_features
        assert att.wkv.fp8[1].data_ptr() == s[s.shape[0] - att.wkv.fp8[1].shape[0]:].data_ptr()


def test_fused_dense_linears_share_one_weight(models):
    """dense_bf16 + fuse_linears: wq_a / wkv and the shared expert's w1 / w3 become views of one stacked
    dense weight, the stacked Linears are what qkv and the shared expert run (MoE._shared's fused
    SwiGLU), and their act rounding is the originals'."""
    m = models["fp8-dense-fused"]
    atts = [mod for mod in m.modules() if getattr(mod, "wqkv_a", None) is not None]
    moes = [mod for mod in m.modules() if isinstance(mod, MoE) and mod.shared_w13 is not None]
    assert atts and moes and len(moes) == sum(isinstance(mod, MoE) for mod in m.modules())
    pairs = [(a.wqkv_a, a.wq_a, a.wkv) for a in atts] + [(e.shared_w13, e.shared_experts.w1, e.shared_experts.w3)
                                                          for e in moes]
    for fused, first, second in pairs:
        w = fused.weight
        assert fused.fp8 is None and fused.quantized == first.quantized == second.quantized
        assert first.weight.data_ptr() == w.data_ptr() and second.weight.data_ptr() == w[first.out_features:].data_ptr()
        assert w.shape == (first.out_features + second.out_features, first.in_features)


def test_fused_shared_expert_is_the_expert(models):
    """MoE._shared on the stacked w1 / w3 (one GEMM, the fused SwiGLU + act_quant, w2 told its input is
    rounded already) gives Expert.forward's bits (separate GEMMs, swiglu, w2's own act_quant)."""
    m = models["fp8-dense-fused"]
    moes = [mod for mod in m.modules() if isinstance(mod, MoE) and mod.shared_w13 is not None]
    assert moes and all(mod.shared_experts.w2.quantized for mod in moes)
    g = torch.Generator().manual_seed(4)
    for moe in moes:
        x = (torch.randn(9, moe.dim, generator=g) * 3).to(torch.bfloat16)
        assert torch.equal(moe._shared(x), moe.shared_experts(x))


def test_norms_hand_rounded_rows_to_their_linears(models, monkeypatch):
    """RMSNorm.with_rounded (attn_norm -> the fused wq_a / wkv, q_norm -> wq_b and the indexer's wq_b, ffn_norm
    -> the shared w1 / w3: the norm's launch rounds the rows those linears would round) gives the bits of each
    linear rounding its input itself, over prefill, decode, a multi-token step and a DSpark proposal."""
    from deepinfer.model.layers import RMSNorm
    m = models["fp8-dense-fused"]
    calls = []
    plain_quant = ops.rms_norm_quant

    def counted(*a):
        calls.append(a[0].shape)
        return plain_quant(*a)
    monkeypatch.setattr(ops, "rms_norm_quant", counted)
    fused = _run(m)
    assert len(calls) >= 3 * len(m.layers)           # three norms a layer took the rounded form
    monkeypatch.setattr(RMSNorm, "with_rounded", lambda self, x, *consumers: (self(x), None))
    for i, (g, r) in enumerate(zip(fused, _run(m))):
        assert torch.equal(g, r), f"output {i} differs by {(g.float() - r.float()).abs().max()}"


def test_act_quant_is_idempotent():
    """act_quant of act_quant's output is that output (what Linear.forward(rounded=True) relies on): blocks
    over 40 binades, blocks whose rounded max sits at 224 x scale (re-rounded one scale lower), subnormal
    e4m3 values, all-zero and sub-1e-4 blocks."""
    from deepinfer.kernels.reference import act_quant_ref
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-30, 10, (64, 8, 1), generator=g).float())
         .repeat_interleave(32, -1).view(64, 256)).to(torch.bfloat16)
    x[0, :32] = 0
    x[1, :32] = 3e-5
    x[2, :32] = torch.linspace(-224, 224, 32)        # max 224: the second rounding takes scale 1/2
    x[3, :32] = 2.0 ** -9
    x[3, 0] = 448.0
    once = act_quant_ref(x)
    assert torch.equal(act_quant_ref(once), once)


def test_dense_fp8_copy_holds_the_same_values(models, tiny_checkpoint):
    """dense_fp8_copy: every act-rounded bf16-held Linear (wo_a excepted: never a Linear call) keeps FP8
    bytes that dequantize to its weight exactly; fused Linears' copies are views of one stacked copy at the
    same rows; the CPU run (no decode kernel there) is the dense_bf16 model's bit for bit."""
    m = models["fp8-dense-copy"]
    linears = {name: mod for name, mod in m.named_modules() if isinstance(mod, Linear) and ".experts." not in name}
    quantized = [mod for name, mod in linears.items() if mod.quantized and mod.weight.numel()]
    assert quantized and all(mod.fp8_decode is not None for mod in quantized)
    assert all(mod.fp8_decode is None for name, mod in linears.items() if name.endswith("wo_a"))
    for mod in quantized:
        w, s = mod.fp8_decode
        assert w.dtype == torch.float8_e4m3fn and w.shape == mod.weight.shape
        assert torch.equal(ops.dequant_fp8(w, s).to(mod.weight.dtype), mod.weight)
    att = next(mod for mod in m.modules() if getattr(mod, "wqkv_a", None) is not None)
    w = att.wqkv_a.fp8_decode[0]
    assert att.wq_a.fp8_decode[0].data_ptr() == w.data_ptr()
    assert att.wkv.fp8_decode[0].data_ptr() == w[att.wq_a.out_features:].data_ptr()
    for a, b in zip(_run(m), _run(models["fp8-dense-fused"])):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="dense_fp8_copy"):
        load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_fp8_copy=True)
    from deepinfer.model.args import ModelArgs
    from deepinfer.worker.loading import dense_fp8_copies, hold_dense_bf16
    args = ModelArgs.from_checkpoint(tiny_checkpoint)
    assert dense_fp8_copies("bf16+fp8", "cuda:0", args, total_memory=1) is True
    assert not dense_fp8_copies("bf16+fp8", "cpu", args) and not dense_fp8_copies("bf16", "cuda", args, 1 << 40)
    assert not dense_fp8_copies("auto", "cuda", args, total_memory=1)          # no room for the bf16 weights
    assert hold_dense_bf16("bf16+fp8", "cuda", args, total_memory=1)


def test_fp8_copies_of_some_kinds_only(tiny_checkpoint, models):
    """dense_fp8_copy as a set of tensor kinds (what dense_weights="auto" picks): only those Linears keep FP8
    bytes, a fused pair keeps one stacked copy when both of its kinds are named, and the CPU run is the plain
    bf16 model's bit for bit."""
    from deepinfer.model.fused_linears import FUSED_GROUPS
    kinds = frozenset({"layers.N.attn.wq_b.weight", "layers.N.attn.wq_a.weight", "layers.N.attn.wkv.weight"})
    assert ("attn.wq_a.weight", "attn.wkv.weight") in FUSED_GROUPS
    m = load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_bf16=True, moe_masked=True,
                   fuse_linears=True, dense_fp8_copy=kinds)
    copied = {name for name, mod in m.named_modules() if isinstance(mod, Linear) and mod.fp8_decode is not None}
    layers = [name for name, _ in m.named_modules() if name.startswith("layers.") and name.count(".") == 1]
    want = {f"{layer}.attn.{lin}" for layer in layers for lin in ("wq_b", "wq_a", "wkv", "wqkv_a")}
    assert copied == want
    for a, b in zip(_run(m), _run(models["fp8-dense-fused"])):
        assert torch.equal(a, b)


def test_the_models_fused_linears_are_fused_groups(models):
    """fused_linears.FUSED_GROUPS (how worker/loading.py sizes a fused call) names what the model fuses."""
    from deepinfer.model.fused_linears import FUSED_GROUPS
    m = models["fp8-dense-fused"]
    att = next(mod for mod in m.modules() if getattr(mod, "wqkv_a", None) is not None)
    ffn = next(mod for mod in m.modules() if getattr(mod, "shared_w13", None) is not None)
    fused = {("attn.wq_a.weight", "attn.wkv.weight"): (att.wqkv_a, [att.wq_a, att.wkv]),
             ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"):
                 (ffn.shared_w13, [ffn.shared_experts.w1, ffn.shared_experts.w3])}
    assert set(fused) == set(FUSED_GROUPS)
    for stacked, parts in fused.values():
        assert stacked.out_features == sum(p.out_features for p in parts)


def test_auto_fp8_copies_follow_the_measured_table(tmp_path):
    """decode_copy_kinds (the release's shapes, every one distinct): a kind is copied where a measured row of <= 64
    tokens has the decode GEMM 1.03x the bf16-held path, in the backbone and DSpark's blocks alike; a fused pair
    is one call of the stacked shape, copied whole or not at all; the most time saved per element goes first
    while the budget lasts."""
    import json

    from deepinfer.checkpoint.generator import hf_config, text_config
    from deepinfer.model.args import ModelArgs
    from deepinfer.model.loader import expected_tensors
    from deepinfer.worker.loading import decode_copy_kinds
    (tmp_path / "config.json").write_text(json.dumps(hf_config(text_config("release-ep8"))))
    args = ModelArgs.from_checkpoint(tmp_path)
    wq_b, wo_b, qkv = (32768, 1280), (5120, 8192), (1792, 5120)        # qkv: wq_a [1280, 5120] + wkv [512, 5120]

    def rows(gains: dict):
        return lambda n, k: [dict(m=m, decode_us=10.0, bf16_held_us=10.0 + g) for m, g in gains.get((n, k), [])]

    def kinds(*tails):
        return {f"{p}.N.{t}.weight" for p in ("layers", "mtp") for t in tails}
    table = {wq_b: [(64, 5.0)], wo_b: [(16, 1.0), (64, 0.2)], qkv: [(32, 8.0), (128, 30.0)]}
    assert decode_copy_kinds(args, rows(table), budget=1 << 40) == kinds("attn.wq_b", "attn.wo_b", "attn.wq_a",
                                                                         "attn.wkv")   # wo_b: by its M 16 row
    assert decode_copy_kinds(args, rows({qkv: [(128, 30.0)], wo_b: [(64, 0.2)]}), budget=1 << 40) == frozenset()
    elements = {shape: sum(s[0] * s[1] for name, (kind, s) in expected_tensors(args).items() if tuple(s) == shape)
                for shape in (wq_b, wo_b)}
    table = {wq_b: [(64, 5.0)], wo_b: [(64, 8.0)]}        # wo_b saves more per element (same size, more us)
    budget = max(elements.values())
    assert decode_copy_kinds(args, rows(table), budget=budget) == kinds("attn.wo_b")
    # one element short: the backbone's 40 wo_b fit, DSpark's 3 no longer do (nor anything of wq_b)
    assert decode_copy_kinds(args, rows(table), budget=budget - 1) == {"layers.N.attn.wo_b.weight"}


def test_fusing_needs_one_weight_form():
    """fuse_linears declines Linears that cannot share a weight: mixed forms, different K or dtype."""
    from deepinfer.model.fused_linears import fuse_dense_linears, fuse_linears
    a, b, c = Linear(8, 4), Linear(8, 6), Linear(16, 4)
    for lin in (a, b, c):
        lin.weight = torch.randn(lin.out_features, lin.in_features)
    assert fuse_dense_linears([a]) is None and fuse_dense_linears([a, c]) is None
    b.quantized = True
    assert fuse_dense_linears([a, b]) is None                          # act rounding differs
    b.quantized = False
    b.weight = b.weight.double()
    assert fuse_dense_linears([a, b]) is None
    b.weight = b.weight.float()
    x = torch.randn(3, 8)
    want = torch.cat([a(x), b(x)], dim=-1)
    fused = fuse_linears([a, b])
    assert fused is not None and torch.equal(fused(x), want)
    e = Linear(8, 4)
    e.fp8 = (torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.zeros(4, 1, dtype=torch.uint8))
    assert fuse_linears([a, e]) is None                               # an FP8 Linear beside a dense one


def test_dense_linears_form(models, tiny_checkpoint):
    """dense_bf16: no dense Linear keeps FP8 bytes (wo_a included), the routed experts keep their FP8
    stacks; and it only goes with the fp8 format."""
    m = models["fp8-dense-linears"]
    linears = [mod for name, mod in m.named_modules() if isinstance(mod, Linear) and ".experts." not in name]
    assert linears and all(mod.fp8 is None and mod.fp8_blocks is None for mod in linears)
    assert any(mod.quantized and mod.weight.numel() for mod in linears)
    assert all(mod.stacks is not None for mod in m.modules() if isinstance(mod, MoE))
    with pytest.raises(ValueError, match="dense_bf16"):
        load_model(tiny_checkpoint, progress=False, weight_format="dense", dense_bf16=True)
    from deepinfer.config import EngineArgs
    with pytest.raises(ValueError, match="dense_weights"):
        EngineArgs("unused", dense_weights="fp16")


def test_auto_dense_weights_fit_the_device(tiny_checkpoint):
    """dense_weights="auto" holds the dense linears in bf16 on CUDA only while the extra byte per element
    fits DENSE_BF16_MAX_SHARE of the device; "bf16" / "fp8" are taken as asked; never on a CPU."""
    from deepinfer.model.args import ModelArgs
    from deepinfer.worker.loading import DENSE_BF16_MAX_SHARE, dense_fp8_elements, hold_dense_bf16
    args = ModelArgs.from_checkpoint(tiny_checkpoint)
    extra = dense_fp8_elements(args)
    wq_a = args.q_lora_rank * args.dim
    assert extra > args.n_layers * wq_a                          # every layer's linears counted
    roomy, tight = int(extra / DENSE_BF16_MAX_SHARE) + 1, int(extra / DENSE_BF16_MAX_SHARE) - 1
    assert hold_dense_bf16("auto", "cuda", args, total_memory=roomy)
    assert not hold_dense_bf16("auto", "cuda:1", args, total_memory=tight)
    assert hold_dense_bf16("bf16", "cuda", args, total_memory=tight)
    assert not hold_dense_bf16("fp8", "cuda", args, total_memory=roomy)
    assert not hold_dense_bf16("auto", "cpu", args) and not hold_dense_bf16("bf16", "cpu", args)


def test_auto_expert_format_where_the_experts_crowd_the_device(tiny_checkpoint, monkeypatch):
    """expert_format="auto": FP4 stacks on CUDA only where the FP8 stacks would take over
    EXPERT_FP4_MIN_SHARE of the device (this rank's share of them under EP); never on a CPU, in
    batch-invariant mode or on the DeepGEMM backend; "fp8" / "fp4" as asked on CUDA."""
    from deepinfer.kernels import select
    from deepinfer.model.args import ModelArgs
    from deepinfer.parallel.planner import model_bytes, release_config_dir
    from deepinfer.worker.loading import EXPERT_FP4_MIN_SHARE, fp8_expert_bytes, resolved_expert_format
    args = ModelArgs.from_checkpoint(tiny_checkpoint)
    need = fp8_expert_bytes(args)
    per_layer = 3 * args.moe_inter_dim * args.dim * 33 // 32
    assert need >= args.n_routed_experts * per_layer                  # every layer's experts counted
    tight, roomy = int(need / EXPERT_FP4_MIN_SHARE) - 1, int(need / EXPERT_FP4_MIN_SHARE) + 1
    assert resolved_expert_format("auto", "cuda", False, args, total_memory=tight) == "fp4"
    assert resolved_expert_format("auto", "cuda", False, args, total_memory=roomy) == "fp8"
    assert resolved_expert_format("auto", "cuda", False, args, expert_share=0.5, total_memory=tight) == "fp8"
    assert resolved_expert_format("auto", "cuda", True, args, total_memory=tight) == "fp8"
    assert resolved_expert_format("auto", "cpu", False, args, total_memory=tight) == "fp8"
    assert resolved_expert_format("fp4", "cpu") == "fp8" and resolved_expert_format("fp4", "cuda") == "fp4"
    assert resolved_expert_format("fp4", "cuda", True) == "fp8"           # batch invariance needs fixed tiles
    monkeypatch.setattr(select, "GEMM", "deepgemm")
    assert resolved_expert_format("auto", "cuda", False, args, total_memory=tight) == "fp8"
    assert resolved_expert_format("fp4", "cuda") == "fp8"
    monkeypatch.setattr(select, "GEMM", "triton")
    # the release at EP8 on an H200: FP4 stacks (its FP8 ones would be ~half of the device)
    release = ModelArgs.from_checkpoint(release_config_dir())
    assert resolved_expert_format("auto", "cuda", False, release, expert_share=1 / 8, total_memory=141 * 10**9) == "fp4"
    assert fp8_expert_bytes(release, 1 / 8) < model_bytes(release).routed_expert_bytes * 48 * 43


def test_fused_linears_on_a_bf16_checkpoint(fixture_dir):
    """A checkpoint with dense (bf16) weights: no act rounding anywhere, so the fused shared expert must
    not act_quant its SwiGLU (it did: the H200 fast path's hidden states left the bf16 fixture's rule at
    layer 0). Fused and unfused give the same bits on a CPU."""
    ckpt = fixture_dir("v41-tiny-bf16")
    plain = load_model(ckpt, progress=False, weight_format="fp8", fuse_linears=False)
    fused = load_model(ckpt, progress=False, weight_format="fp8", fuse_linears=True)       # as CUDA loads it
    moes = [m for m in fused.modules() if isinstance(m, MoE)]
    assert moes and all(m.shared_w13 is not None and not m.shared_experts.w2.quantized for m in moes)
    for i, (g, r) in enumerate(zip(_run(fused), _run(plain))):
        assert torch.equal(g, r), f"output {i} differs by {(g.float() - r.float()).abs().max()}"
