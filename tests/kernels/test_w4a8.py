"""W4A8 on FP4 stacks (kernels/triton_w4a8.py) on the CPU: the kernel body under Triton's interpreter against the
reference (in a subprocess: TRITON_INTERPRET must not leak into other tests), the d-range rule, the decode's PTX
through an emulator of its instructions, and an offline sm_90a compile whose K loop must be cheaper per weight
than W4A16's (perf/ptx_check.py's count, the same way for both). The GPU tests: test_w4a8_gpu.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

# (G, C, N, K, masked_m, expected_m, cfg override): N and K off the tiles (K 160: BK 32; 320: BK 64), an empty
# expert, experts with more tokens than one tile, split-K, C % 4 == 0
CASES = [
    (3, 8, 96, 160, [8, 3, 0], 4, {}),
    (2, 40, 64, 256, [37, 0], 16, {}),
    (4, 12, 130, 384, [12, 5, 1, 0], 4, {"SPLIT_K": 3}),
    (2, 36, 200, 320, [36, 17], 16, {"BN": 64}),
    (1, 4, 128, 128, [4], 1, {}),
]


def _case(G, C, N, K, seed, span=None):
    """Integer-valued operands: activations in [-4, 4] through act_quant_fp8 (exact), MXFP4 weights over every
    byte with block bytes within the d rule (a few byte-0 blocks). -> a, sa_t, packed_k, scale (kernel form), the
    float64 weights of the release layout."""
    from deepinfer.kernels import reference as R
    from deepinfer.kernels.fp4_layout import fp4_kernel_weight
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (G, N, K // 2), generator=gen).to(torch.uint8)
    lo = 128 - (span if span is not None else 8)
    scale = torch.randint(lo, 129, (G, N, K // 32), generator=gen).to(torch.uint8)
    scale[torch.rand(scale.shape, generator=gen) < 0.05] = 0
    w = torch.stack([R.dequant_fp4_ref(packed[i], scale[i]) for i in range(G)]).double()
    x = torch.randint(-4, 5, (G * C, K), generator=gen).float()
    q, s = R.act_quant_fp8_ref(x)
    ld = R.slab_scales_ld(G, C)
    sat = torch.zeros(K // 32, ld)
    sat[:, :G * C] = s.T
    pk, sk = fp4_kernel_weight(packed, scale)
    return q.view(G, C, K), sat, pk, sk, w, x.view(G, C, K).double()


def interpreter_checks():
    """Run under TRITON_INTERPRET=1: every CASE's fp32 split-K partials summed equal x @ w^T exactly (integer-
    valued products: exact in fp32 in any order), the bf16 output within one bf16 ulp of it (the interpreter
    truncates float -> bf16 where the GPU rounds), and fp8_masked_moe_gemm_ref on the same values (an FP8 stack
    of the same weights) agrees."""
    from deepinfer.kernels import triton_w4a8 as tw
    for i, (G, C, N, K, mm, em, cfg) in enumerate(CASES):
        a, sat, pk, sk, w, x = _case(G, C, N, K, seed=i)
        mmt = torch.tensor(mm, dtype=torch.int32)
        ws = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mmt, em, cfg_override=cfg, partials=True)
        y = tw.w4a8_masked_moe_gemm(a, sat, pk, sk, mmt, em, cfg_override=cfg)
        ref = torch.einsum("gck,gnk->gcn", x, w)
        tot = ws.double().sum(0)
        for g, r in enumerate(mm):
            assert torch.equal(tot[g, :r], ref[g, :r]), (i, g)
            rb = ref[g, :r].float()
            ulp = torch.where(rb == 0, torch.ones_like(rb), rb.abs()) * 2.0 ** -7
            assert ((y[g, :r].float() - rb).abs() <= ulp).all(), (i, g)
    print("w4a8 interpreter checks passed")


def test_w4a8_interpreter_exact():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + sys.path))
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "passed" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# ------------------------------------------------------------------------------------------ the d rule
def test_decode_exact_over_the_d_range():
    """Every nibble at every d in [D_MIN, D_MAX] decodes to the e4m3 code of e2m1 * 2^d; one step outside
    the range some magnitude has no e4m3 normal (so the range is tight)."""
    from deepinfer.kernels import triton_w4a8 as tw
    from deepinfer.kernels.reference import e2m1_values
    nib = torch.arange(16)
    for d in range(tw.D_MIN, tw.D_MAX + 1):
        code = tw.decode_fp4_e4m3_ref(nib, torch.full_like(nib, 120 + d), torch.full_like(nib, 120))
        assert torch.equal(code.view(torch.float8_e4m3fn).float(), e2m1_values(nib) * 2.0 ** d), d
    mags = e2m1_values(torch.arange(1, 8))
    for d in (tw.D_MIN - 1, tw.D_MAX + 1):
        v = mags * 2.0 ** d
        normal = (v >= 2.0 ** -6) & (v <= 448) & (v.to(torch.float8_e4m3fn).float() == v)
        assert not normal.all(), d


def _rule_stack(span, zero_far=False):
    """One expert, 4 rows x 4 blocks: row 2's live blocks span `span` binades; zero_far: block 1 of row 3 far
    below its others but with all-zero nibbles (no part in the rule)."""
    from deepinfer.kernels.fp4_layout import fp4_kernel_weight
    packed = torch.full((1, 4, 64), 0x21, dtype=torch.uint8)           # magnitudes 1 and 0.5 (live blocks)
    scale = torch.full((1, 4, 4), 120, dtype=torch.uint8)
    scale[0, 2, 0] = 120 + span
    if zero_far:
        packed[0, 3, 16:32] = 0x88                                     # -0 / -0: block 1 of row 3 all zero
        scale[0, 3, 1] = 2
    return fp4_kernel_weight(packed, scale)


def test_d_rule_just_inside_and_outside():
    from deepinfer.kernels import triton_w4a8 as tw
    span = tw.D_MAX - tw.D_MIN
    pk, sk = _rule_stack(span, zero_far=True)
    e, reason = tw.w4a8_row_bases(pk, sk)
    assert reason is None and int(e[0, 2]) == 120 + span - tw.D_MAX and int(e[0, 3]) == 120 - tw.D_MAX
    assert tw.w4a8_decline_reason(pk, sk) is None
    pk, sk = _rule_stack(span + 1)
    e, reason = tw.w4a8_row_bases(pk, sk)
    assert e is None and "row 2" in reason and "binades" in reason
    assert tw.w4a8_decline_reason(pk, sk) == reason
    with pytest.raises(ValueError, match="binades"):
        tw.w4a8_masked_moe_gemm(torch.zeros(1, 4, 128, dtype=torch.float8_e4m3fn), torch.zeros(4, 4), pk, sk,
                                torch.zeros(1, dtype=torch.int32), 1)


def test_decline_reason_cached_per_stack():
    from deepinfer.kernels import triton_w4a8 as tw
    pk, sk = _rule_stack(3)
    tw._STACKS.clear()
    assert tw.w4a8_decline_reason(pk, sk) is None and len(tw._STACKS) == 1
    first = tw._STACKS[id(sk)][3]
    assert tw.w4a8_stack(pk, sk)[0] is first                          # no second pass
    sk[0, 2, 0] = 120 + tw.D_MAX - tw.D_MIN + 1                       # an in-place write: recomputed
    assert tw.w4a8_decline_reason(pk, sk) is not None
    assert "uint8" in tw.w4a8_decline_reason(pk.view(torch.int8), sk)
    assert tw.w4a8_decline_reason(pk[:, :, :40].contiguous(), sk) is not None


# ------------------------------------------------------------------------------------------ select's wiring
def test_select_w4a8_off_by_default_and_reference(monkeypatch):
    """DEEPINFER_W4A8 defaults off (W4A16 keeps FP4 stacks); on a CPU the op runs the reference, which equals
    the FP8 masked reference on an FP8 stack of the same weights."""
    from deepinfer.kernels import reference as R
    from deepinfer.kernels import select
    from deepinfer.kernels.fp4_layout import fp4_release_layout
    a, sat, pk, sk, w, x = _case(2, 8, 64, 128, seed=5)
    assert select.W4A8 == os.environ.get("DEEPINFER_W4A8", "0")
    xb = x.bfloat16()
    monkeypatch.setattr(select, "W4A8", "0")
    assert not select.masked_moe_w4a8_takes(xb, pk, sk, pk, sk)
    monkeypatch.setattr(select, "W4A8", "1")
    assert not select.masked_moe_w4a8_takes(xb, pk, sk, pk, sk)          # a CPU tensor: no fast path
    mm = torch.tensor([8, 5], dtype=torch.int32)
    y = select.w4a8_masked_moe_gemm(a, sat, pk, sk, mm, 4)
    rows = [select.row_scaled_fp8_weight(*select.fp4_to_fp8_weight(fp4_release_layout(pk[g]), sk[g])) for g in range(2)]
    w8 = torch.stack([r[0] for r in rows])
    r8 = torch.stack([r[1] for r in rows])
    ref = R.fp8_masked_moe_gemm_ref(a, sat, w8, r8, mm)
    assert torch.equal(y, ref)


# ------------------------------------------------------------------------------------------ the PTX, emulated
def _prmt(a, b, sel):
    """prmt.b32 default mode: byte i of the result = byte (sel >> 4i) & 7 of {b, a}, sign-replicated if & 8."""
    import numpy as np
    pool = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    sel = np.broadcast_to(np.asarray(sel, dtype=np.uint64), pool.shape)
    out = np.zeros(pool.shape, dtype=np.uint64)
    for i in range(4):
        s = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> ((s & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(s & np.uint64(8), (byte >> np.uint64(7)) * np.uint64(0xFF), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def _emulate_asm(w, tlo, thi):
    """triton_w4a8._W4A8_ASM instruction by instruction (uint32 numpy arrays) -> (lo, hi) registers."""
    import numpy as np
    m = w & np.uint32(0x77777777)
    mh = m >> np.uint32(16)
    a = _prmt(tlo, thi, m)
    b = _prmt(tlo, thi, mh)
    s = (w << np.uint32(4)) & np.uint32(0x80808080)
    lo = _prmt(a, b, 0x6420) | s
    hi = _prmt(a, b, 0x7531) | (w & np.uint32(0x80808080))
    return lo.astype(np.uint32), hi.astype(np.uint32)


def test_decode_ptx_emulated():
    """The asm's registers: byte i of lo / hi = the decode of byte i's low / high nibble, for 2^16 random words
    and every byte value in every position, at every d of the range (the table built as the kernel builds it)."""
    import numpy as np
    from deepinfer.kernels import triton_w4a8 as tw
    rng = np.random.default_rng(0)
    words = np.concatenate([rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32)] +
                           [(np.arange(256, dtype=np.uint32) << np.uint32(8 * i)) for i in range(4)])
    for d in range(tw.D_MIN, tw.D_MAX + 1):
        k, e = 120 + d, 120
        tlo = np.full_like(words, (k * tw.LUT_LO_STEP + tw.LUT_LO0 - e * tw.LUT_LO_STEP) & 0xFFFFFFFF)
        thi = np.full_like(words, (k * tw.LUT_HI_STEP + tw.LUT_HI0 - e * tw.LUT_HI_STEP) & 0xFFFFFFFF)
        lo, hi = _emulate_asm(words, tlo, thi)
        t = torch.from_numpy(words.astype(np.int64))
        for i in range(4):
            byte = (t >> (8 * i)) & 0xFF
            want_lo = tw.decode_fp4_e4m3_ref(byte & 15, torch.full_like(byte, k), torch.full_like(byte, e))
            want_hi = tw.decode_fp4_e4m3_ref(byte >> 4, torch.full_like(byte, k), torch.full_like(byte, e))
            assert np.array_equal((lo >> np.uint32(8 * i)) & np.uint32(0xFF), want_lo.numpy().astype(np.uint32)), (d, i)
            assert np.array_equal((hi >> np.uint32(8 * i)) & np.uint32(0xFF), want_hi.numpy().astype(np.uint32)), (d, i)


# ------------------------------------------------------------------------------------------ offline sm_90a
def _sm90_loop(fn_module, names, call):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import ptx_check
    fn, _grid, args, kw = ptx_check.record_launches(fn_module, names, call)[0]
    kernel = ptx_check.compile_call(fn, args, kw)
    r = ptx_check.analyze(kernel)
    weights = kw["BN"] * kw["BK"] // (32 * kw["num_warps"])          # weights a thread decodes per K step
    return r, weights


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for the GPU")
@pytest.mark.parametrize("n,k,em", [(4608, 5120, 1), (5120, 2304, 8), (4608, 5120, 32)])
def test_sm90_k_loop_cheaper_than_w4a16(n, k, em):
    """Both masked FP4 kernels compiled for sm_90a as launched at the release's expert shapes (48 experts):
    no spills, and W4A8's K loop spends fewer SASS instructions a weight than W4A16's."""
    import shutil
    from deepinfer.kernels import triton_gemm as tg
    from deepinfer.kernels import triton_w4a8 as tw
    if shutil.which("ptxas") is None and shutil.which("nvcc") is None:
        pytest.skip("no ptxas / nvcc")
    g, c = 48, 64
    pk = torch.zeros(g, n, k // 2, dtype=torch.uint8)
    sk = torch.full((g, n, k // 32), 120, dtype=torch.uint8)
    mm = torch.zeros(g, dtype=torch.int32)
    a = torch.zeros(g, c, k, dtype=torch.float8_e4m3fn)
    r8, w8 = _sm90_loop(tw, ["w4a8_masked_kernel"], lambda: tw.w4a8_masked_moe_gemm(
        a, torch.zeros(k // 32, g * c), pk, sk, mm, em))
    r16, w16 = _sm90_loop(tg, ["w8a16_pairs_kernel"], lambda: tg.w4a16_grouped_gemm_masked(
        torch.zeros(g, c, k).bfloat16(), pk, sk, mm, em))
    per8, per16 = r8["sass"] / w8, r16["sass"] / w16
    print(f"\nN {n} K {k} m {em}: W4A8 {r8['sass']} SASS / {w8} weights = {per8:.2f} a weight, {r8['regs']} regs, "
          f"spill {r8['spill']}; W4A16 {r16['sass']} / {w16} = {per16:.2f}, {r16['regs']} regs; "
          f"ops {dict(r8['sass_ops'])}")
    assert r8["spill"] == 0 and r8["ldg.loop"] == 0
    assert per8 < per16, (per8, per16)


if __name__ == "__main__":
    interpreter_checks()
