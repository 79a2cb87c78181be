"""DeepGEMM with our formats mapped onto its 1x128 / 128x128 scales: how far it lands from the
exact (per-32) reference, next to the Triton path."""

import pytest
import torch

from deepinfer.kernels.reference import act_quant_ref, dequant_fp8_ref
from tests.conftest import captured_graph

from kernel_utils import rand_fp8_weight, rel_err

pytestmark = pytest.mark.gpu


def test_deepgemm_mapping_close_to_reference():
    from deepinfer.kernels import deepgemm
    from deepinfer.kernels.reference import e8m0_to_float
    from deepinfer.kernels.triton_quant import act_quant_fp8
    if deepgemm.load() is None:
        pytest.skip("DeepGEMM not importable")
    n, k, m = 4096, 5120, 64
    w, s = rand_fp8_weight(n, k, "cuda")
    w128, s128, changed = deepgemm.reblock_weight_128(w, e8m0_to_float(s))
    x = torch.randn(m, k, device="cuda").bfloat16()
    q, sa = act_quant_fp8(x)
    q128, sa128 = deepgemm.act_reblock_128(q, sa)
    y = deepgemm.fp8_gemm_nt(q128, sa128, w128, s128)
    ref = torch.nn.functional.linear(act_quant_ref(x).float(), dequant_fp8_ref(w, s)).bfloat16()
    err = rel_err(y, ref)
    print(f"deepgemm 128-reblocked vs exact reference: rel err {err:.2e}, weight elements moved {changed}")
    assert err < 5e-3


# ---- the DEEPINFER_GEMM=deepgemm backend (kernels/select.py -> kernels/deepgemm.py) ----------------
# CPU half: tests/kernels/test_deepgemm_backend.py (the same path against a torch stand-in for DeepGEMM).

# V4.1-Flash shapes (N, K), as perf/bench_kernels.py times them
LINEARS = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
           "shared_w13": (4608, 5120), "shared_w2": (5120, 2304)}
EXPERTS = {"moe_w13": (4608, 5120), "moe_w2": (5120, 2304)}


def _need_deepgemm():
    from deepinfer.kernels import deepgemm, select
    if deepgemm.load() is None:
        pytest.skip("DeepGEMM not importable")
    if not select.deepgemm_usable(torch.zeros(1, device="cuda")):
        pytest.skip("DeepGEMM cannot run here (SM90 and the fast paths needed)")
    return deepgemm, select


def fp4_expert_stack(g: int, n: int, k: int, seed: int = 0):
    """FP4-origin experts as the loader stacks them: e2m1 values in e4m3 [g, n, k], E8M0 bytes per
    (row, 32) over 8 binades (the 128x128 conversion is exact up to 14)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cuda")
    codes = torch.randint(0, 16, (g, n, k), device="cuda", generator=gen, dtype=torch.int32)
    v = grid[(codes & 7).long()] * (1 - 2 * (codes >> 3)).float()
    e = torch.randint(-14, -6, (g, n, k // 32), device="cuda", generator=gen, dtype=torch.int32)
    return v.to(torch.float8_e4m3fn), (e + 127).to(torch.uint8)


@pytest.mark.parametrize("shape", [(1, 5120), (64, 2304), (7, 384), (128, 8192)])
def test_act_quant_fp8_block128_bit_exact(shape):
    """The backend's activations (act_quant, then act_quant_fp8 at block 128; K = 384 has one 128-block
    per program) and act_quant_fp8 at 32: the torch reference's values exactly (a -0 from act_quant
    may come back +0 under the interpreter's rounding; the GPU's cvt keeps the sign)."""
    from deepinfer.kernels.reference import act_quant_fp8_ref
    from deepinfer.kernels.triton_quant import act_quant, act_quant_fp8
    x = (torch.randn(shape, device="cuda") * torch.exp(3 * torch.randn(shape[0], 1, device="cuda"))).bfloat16()
    x.view(-1)[:40] = 0
    q, s = act_quant_fp8(act_quant(x), 128)
    rq, rs = act_quant_fp8_ref(act_quant_ref(x), 128)
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)     # values: +-0 alike
    q, s = act_quant_fp8(x)
    rq, rs = act_quant_fp8_ref(x)
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)


@pytest.mark.parametrize("name", list(LINEARS))
def test_fp8_linear_deepgemm_backend(name, monkeypatch):
    """select.fp8_linear with DEEPINFER_GEMM=deepgemm on V4.1 decode shapes (M 1 / 64 / 128): DeepGEMM
    actually called, the weight re-blocked once, and within the existing mapping test's bound of the
    exact reference (float64), next to the Triton path's error on the same inputs."""
    deepgemm, select = _need_deepgemm()
    n, k = LINEARS[name]
    w, s = rand_fp8_weight(n, k, "cuda", seed=len(name))
    exact_w = dequant_fp8_ref(w, s).double()
    for m in (1, 64, 128):
        x = torch.randn(m, k, device="cuda").bfloat16()
        exact = act_quant_ref(x).double() @ exact_w.T
        monkeypatch.setattr(select, "GEMM", "triton")
        y_t = select.fp8_linear(x, w, s)
        monkeypatch.setattr(select, "GEMM", "deepgemm")
        calls, built = deepgemm.STATS["gemm_calls"], deepgemm.STATS["linears"]
        y_d = select.fp8_linear(x, w, s)
        assert deepgemm.STATS["gemm_calls"] == calls + 1
        assert deepgemm.STATS["linears"] == built + (m == 1)                 # converted on the first call only
        assert y_d.shape == (m, n) and y_d.dtype == torch.bfloat16
        e_t, e_d = rel_err(y_t, exact), rel_err(y_d, exact)
        print(f"{name} M{m}: rel err vs exact: deepgemm {e_d:.2e}, triton {e_t:.2e}")
        assert e_d < 5e-3 and e_t < 5e-3
    ent = getattr(w, "_deepgemm_tile128")
    print(f"{name}: weight elements moved by the 128 re-blocking: {ent[4]} of {w.numel()}")


@pytest.mark.parametrize("c", [1, 64, 200])
@pytest.mark.parametrize("name", list(EXPERTS))
def test_grouped_masked_deepgemm_backend(name, c, monkeypatch):
    """select.grouped_fp8_linear_masked with DEEPINFER_GEMM=deepgemm on the V4.1 expert shapes (8
    experts; capacity 1 / 64 / 200, padded to 128-row groups): DeepGEMM's masked GEMM called; valid
    rows within 5e-3 of the exact float64 product (FP4 experts converted exactly), finite although
    the rows past masked_m hold NaN; the in-place prepared form (f32 128-tile scales) gives the same
    bits as the cached one; the Triton path on the same inputs for comparison."""
    deepgemm, select = _need_deepgemm()
    from deepinfer.kernels.reference import e8m0_to_float
    n, k = EXPERTS[name]
    g = 8
    w, e8 = fp4_expert_stack(g, n, k, seed=c)
    counts = [0, c, 1, c // 2, c, min(3, c), c - 1, c // 3]
    mm = torch.tensor(counts, dtype=torch.int32, device="cuda")
    x = act_quant_ref(torch.randn(g, c, k, device="cuda").bfloat16())
    for i, r in enumerate(counts):
        x[i, r:] = float("nan")
    em = max(1, -(-sum(counts) // g))                 # a host int from the shapes, as MoE passes it
    monkeypatch.setattr(select, "GEMM", "triton")
    y_t = select.grouped_fp8_linear_masked(x, w, e8, mm, em)
    monkeypatch.setattr(select, "GEMM", "deepgemm")
    calls = deepgemm.STATS["masked_calls"]
    y_d = select.grouped_fp8_linear_masked(x, w, e8, mm, em)
    assert deepgemm.STATS["masked_calls"] == calls + 1 and y_d.shape == (g, c, n)
    w128, s128, changed = deepgemm.to_tile128(w, e8)
    assert changed == 0
    y_p = select.grouped_fp8_linear_masked(x, w128, s128, mm, em)
    worst = {"deepgemm": 0.0, "triton": 0.0}
    for i, r in enumerate(counts):
        if r == 0:
            continue
        wd = w[i].double() * e8m0_to_float(e8[i]).double().repeat_interleave(32, 1)
        exact = x[i, :r].double() @ wd.T
        assert torch.isfinite(y_d[i, :r]).all() and torch.equal(y_p[i, :r], y_d[i, :r])
        worst["deepgemm"] = max(worst["deepgemm"], rel_err(y_d[i, :r], exact))
        worst["triton"] = max(worst["triton"], rel_err(y_t[i, :r], exact))
    print(f"{name} C{c}: worst group rel err vs exact: {worst}")
    assert worst["deepgemm"] < 5e-3 and worst["triton"] < 5e-3


def test_deepgemm_backend_no_host_sync_and_graph_capture(monkeypatch):
    """The backend's linear and masked MoE GEMM, once their weights are converted: no host sync
    (torch's sync debug mode set to error), and captured into a CUDA graph whose replay on new inputs
    gives the eager bits (masked rows compared where valid)."""
    deepgemm, select = _need_deepgemm()
    monkeypatch.setattr(select, "GEMM", "deepgemm")
    w, s = rand_fp8_weight(4608, 5120, "cuda")
    we, e8 = fp4_expert_stack(8, 5120, 2304)
    x = torch.randn(64, 5120, device="cuda").bfloat16()
    xp = act_quant_ref(torch.randn(8, 16, 2304, device="cuda").bfloat16())
    counts = [16, 0, 3, 7, 16, 1, 2, 9]
    mm = torch.tensor(counts, dtype=torch.int32, device="cuda")

    def step():
        return select.fp8_linear(x, w, s), select.grouped_fp8_linear_masked(xp, we, e8, mm, 7)

    step()                                            # converts and caches the weights, JIT-compiles
    torch.cuda.synchronize()
    calls = (deepgemm.STATS["gemm_calls"], deepgemm.STATS["masked_calls"])
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (deepgemm.STATS["gemm_calls"], deepgemm.STATS["masked_calls"]) == (calls[0] + 1, calls[1] + 1)
    graph, (y_g, o_g) = captured_graph(step)
    x.copy_(torch.randn(64, 5120, device="cuda").bfloat16())
    xp.copy_(act_quant_ref(torch.randn(8, 16, 2304, device="cuda").bfloat16()))
    graph.replay()
    y_e, o_e = step()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y_e)
    for i, r in enumerate(counts):
        assert torch.equal(o_g[i, :r], o_e[i, :r])


@pytest.mark.xfail(strict=True, reason=(
    "open defect, measured on the H200 (2026-11-30, perf/deepgemm_drift.py): DeepGEMM vs Triton median "
    "1.01 / max 1.40 logit std over 12 decodes where the torch reference vs Triton is 0.02 / 1.21, with "
    "or without fused input linears; every per-op DeepGEMM test in this file passes and the CPU "
    "emulation of its numerics (test_deepgemm_backend.py) stays within DECODE_TOL. Cause not found yet: "
    "DEEPINFER_GEMM=deepgemm stays opt-in"))
def test_small_preset_decode_logits_deepgemm_vs_triton(small_checkpoint, monkeypatch):
    """The small preset (every dim a multiple of 128: every FP8 linear and MoE goes to DeepGEMM) on
    CUDA: a 24-token prefill on the Triton path, then 12 tokens each decoded from that same state
    (rollback in between) on the Triton path and, after prepare_deepgemm (experts in place, 0 elements
    changed), with DEEPINFER_GEMM=deepgemm. Median token within DECODE_TOL = 0.1 logit std of the Triton
    logits (check-parity's err over the top-512), every token within FLIP_TOL = 2.5 (a routing / index
    flip of this chaotic random model; unrelated logits are ~20 apart). The torch-reference path's
    distance to Triton on the same decodes is printed as the yardstick."""
    deepgemm, select = _need_deepgemm()
    from test_deepgemm_backend import check_decode_errors, decode_errors
    from deepinfer.model.loader import load_model
    from deepinfer.model.moe import MoE
    monkeypatch.setattr(select, "GEMM", "triton")
    torch.manual_seed(0)
    prompt = torch.randint(1000, 50000, (24,)).tolist()
    toks = torch.randint(1000, 50000, (12,)).tolist()
    model = load_model(small_checkpoint, device="cuda", progress=False, weight_format="fp8")   # masked MoE on CUDA
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and not any(deepgemm.is_tile128(m.stacks.w13, m.stacks.s13) for m in moes)
    kernels = select.KERNELS
    try:
        def to_ref():
            monkeypatch.setattr(select, "KERNELS", "ref")
            select._fast_ok.cache_clear()
        yard = decode_errors(model, prompt, toks, to_ref)
    finally:
        monkeypatch.setattr(select, "KERNELS", kernels)
        select._fast_ok.cache_clear()
    rep = {}
    before = dict(deepgemm.STATS)

    def to_deepgemm():
        monkeypatch.setattr(select, "GEMM", "deepgemm")
        rep.update(deepgemm.prepare_deepgemm(model))
    errs = decode_errors(model, prompt, toks, to_deepgemm)
    print(f"prepare: {rep}\ntorch reference vs Triton: {[round(e, 4) for e in yard]}\n"
          f"DeepGEMM vs Triton: {[round(e, 4) for e in errs]}")
    assert rep["active"] and rep["stacks"] == len(moes) and rep["expert_changed"] == 0
    assert rep["linears"] > 0 and rep["skipped"] == 0
    assert deepgemm.STATS["gemm_calls"] > before["gemm_calls"]
    assert deepgemm.STATS["masked_calls"] > before["masked_calls"]
    check_decode_errors(errs)
