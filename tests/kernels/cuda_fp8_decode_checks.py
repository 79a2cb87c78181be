"""The CUDA FP8 x FP8 decode GEMM (kernels/cuda_fp8_decode.py) against plain torch on an SM90 GPU. Run by
test_cuda_fp8_decode.py (pytest -m gpu), or directly: python tests/kernels/cuda_fp8_decode_checks.py
[smoke ENTRY | masked] (masked: the smokes and the masked MoE forms' checks only).

Ternary data ({-1, 0, 1} operands, power-of-two scales): every product and partial sum is exact in fp32,
so every form and split count must give the float64 reference's bits. Random data: within
fp8_prefill_checks.outside_fp8_mma_bound. Each entry point is smoke-tested in a child process first (a
pipeline stall traps there, not in the test process)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuda_fp8_checks import _smoke_all, diagnose, random_weight  # noqa: E402
from fp8_prefill_checks import e8m0, outside_fp8_mma_bound, pow2, ref_gemm, ternary  # noqa: E402

from deepinfer.kernels.cuda_fp8_decode import (FORMS, MOE_FORMS, fp8_decode_gemm, fp8_decode_linear,  # noqa: E402
                                               fp8_masked_moe_gemm)
from deepinfer.kernels.reference import e8m0_to_float  # noqa: E402
from deepinfer.kernels.triton_fp8_prefill import fp8_prefill_linear_ref  # noqa: E402

# tails in every dimension: tokens off every tile (and past 128: two token tiles), weight rows off the
# 128 / 256-row CTA and the 32-row scale block, K with a 32-slice tail (160) and off a stage (1312)
GRID_M = (1, 5, 16, 17, 40, 64, 100, 128, 130)
GRID_N = (32, 200, 576, 1792 + 32)
GRID_K = (32, 160, 1312, 5120)


def transposed_scales(sa: torch.Tensor) -> torch.Tensor:
    """sa [M, K/32] -> [K/32, m_ld] zero-padded to a multiple of 4 tokens (act_quant_fp8(scales_ld=...)'s
    layout; the kernel's TMA zero-fills past it)."""
    m, ks = sa.shape
    t = torch.zeros(ks, -(-m // 4) * 4, dtype=torch.float32, device=sa.device)
    t[:, :m] = sa.T
    return t


def ternary_operands(m, n, k, gen, device, per_row=False):
    a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
    sa = pow2((m, k // 32), -3, 3, gen, device)
    w = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
    sb = e8m0((n if per_row else -(-n // 32), k // 32), gen, device)
    return a, sa, w, sb


def run(a, sa, w, sb, entry=None, splits=None):
    return fp8_decode_gemm(a, transposed_scales(sa), w, sb, entry=entry, splits=splits)


def masked_operands(G, C, n, k, gen, device, counts=None):
    """The masked MoE's operands on ternary data: slab a [G, C, K] e4m3 + token scales [G C, K/32], stack w
    [G, N, K] e4m3 with one E8M0 scale a row (rows_e [G, N, 1]), masked_m [G] int32 (the first expert full,
    the last empty where G > 1, the rest random in 0..C)."""
    a = ternary((G, C, k), gen, device).to(torch.float8_e4m3fn)
    sa = pow2((G * C, k // 32), -3, 3, gen, device)
    w = ternary((G, n, k), gen, device).to(torch.float8_e4m3fn)
    rows_e = e8m0((G, n, 1), gen, device)
    if counts is None:
        counts = torch.randint(0, C + 1, (G,), generator=gen)
        counts[0] = C
        if G > 1:
            counts[-1] = 0
    return a, sa, w, rows_e, torch.as_tensor(counts, dtype=torch.int32).to(device)


def masked_ref(a, sa, w, rows_e, g, m):
    """Expert g's first m rows in float64 -> bf16 (its row scale as the same E8M0 in every 32-block)."""
    C, k = a.shape[1], a.shape[2]
    return ref_gemm(a[g, :m].float(), sa[g * C:g * C + m], w[g], rows_e[g].expand(-1, k // 32).contiguous())


def run_masked(a, sa, w, rows_e, masked_m, entry=None, expected_m=None):
    w_rows = e8m0_to_float(rows_e).float().contiguous()
    return fp8_masked_moe_gemm(a, transposed_scales(sa), w, w_rows, masked_m, expected_m or a.shape[1], entry)


def masked_equal(y, a, sa, w, rows_e, masked_m) -> list[str]:
    """The experts whose stored rows differ from masked_ref (empty: all equal)."""
    bad = []
    for g, m in enumerate(masked_m.tolist()):
        r = masked_ref(a, sa, w, rows_e, g, m)
        if not torch.equal(y[g, :m], r):
            bad.append(diagnose(y[g, :m].T, r.T, f"expert {g} of {m} rows"))
    return bad


def smoke_masked(entry: str, device="cuda") -> int:
    gen = torch.Generator().manual_seed(9)
    ok = True
    gen_bad = torch.Generator().manual_seed(1)
    a, sa, w, rows_e, mm = masked_operands(4, 5, 256, 128, gen_bad, device)
    try:                                # C = 5: refused (an unaligned scale column crashed the kernel, 2026-12-05)
        run_masked(a, sa, w, rows_e, mm, entry)
        raise AssertionError("C = 5 was not refused")
    except ValueError:
        pass
    for G, C, n, k in ((3, 16, 256, 128), (4, 8, 200, 160), (5, 40, 1792, 5120), (2, 132, 576, 1312), (1, 4, 32, 32)):
        a, sa, w, rows_e, mm = masked_operands(G, C, n, k, gen, device)
        y = run_masked(a, sa, w, rows_e, mm, entry)
        torch.cuda.synchronize()
        for msg in masked_equal(y, a, sa, w, rows_e, mm):
            ok = False
            print(f"{entry} {G}x{C}x{n}x{k}: {msg}", flush=True)
    print(f"smoke {entry}: {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def check_masked_exact(device="cuda"):
    """Every masked MoE form bit-exact on ternary data: experts full, empty and partly filled, token counts
    off every tile (C past 128: two tiles of the largest), weight rows off the CTA's, K tails of a slice and
    a stage; the weight rows and tokens past an expert's read its neighbour's (never stored)."""
    gen = torch.Generator().manual_seed(4)
    count = 0
    for G in (1, 3, 7):
        for C in (4, 20, 64, 132):          # C a multiple of 4 (MASKED_SLAB_RULE)
            for n, k in ((32, 32), (200, 160), (576, 1312), (1792 + 32, 5120)):
                a, sa, w, rows_e, mm = masked_operands(G, C, n, k, gen, device)
                for entry in MOE_FORMS:
                    y = run_masked(a, sa, w, rows_e, mm, entry)
                    bad = masked_equal(y, a, sa, w, rows_e, mm)
                    assert not bad, (entry, G, C, n, k, bad[:2])
                    count += 1
    print(f"masked exact grid ({count} calls): ok")


def check_masked_random(device="cuda"):
    """The masked form on random bf16 activations (act_quant per 32) and row-scaled random e4m3 stacks at the
    release's expert shapes: within the FP8 MMA bound of the release GEMM's reference, expert by expert."""
    from deepinfer.kernels.triton_quant import act_quant_fp8
    gen = torch.Generator().manual_seed(5)
    G = 6
    for n, k in ((4608, 5120), (5120, 2304)):
        w = (torch.randn(G, n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
        rows_e = torch.randint(110, 118, (G, n, 1), generator=gen, dtype=torch.uint8).to(device)
        for C in (8, 36, 128):
            x = torch.randn(G, C, k, generator=gen).bfloat16().to(device)
            q, s = act_quant_fp8(x.view(G * C, k))
            mm = torch.randint(1, C + 1, (G,), generator=gen, dtype=torch.int32).to(device)
            y = run_masked(q.view(G, C, k), s, w, rows_e, mm, expected_m=max(1, C // 2))
            for g, m in enumerate(mm.tolist()):
                sb = rows_e[g].expand(-1, k // 32).contiguous()
                r = fp8_prefill_linear_ref(x[g, :m], w[g], sb).float()
                bad = outside_fp8_mma_bound(y[g, :m].float(), r, x[g, :m], w[g], sb)
                assert not bad.any(), (n, k, C, g, m, int(bad.sum()))
    print("masked random (expert shapes, C 8 / 33 / 128): ok")


def check_masked_graph(device="cuda"):
    """A CUDA graph of the masked form replays to the eager values with new tokens and new counts (no host
    read: the counts are read on the device)."""
    gen = torch.Generator().manual_seed(6)
    a, sa, w, rows_e, mm = masked_operands(5, 24, 576, 1312, gen, device)
    w_rows = e8m0_to_float(rows_e).float().contiguous()
    sa_t = transposed_scales(sa)
    fp8_masked_moe_gemm(a, sa_t, w, w_rows, mm, 8)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fp8_masked_moe_gemm(a, sa_t, w, w_rows, mm, 8)
    a2, sa2, _, _, mm2 = masked_operands(5, 24, 576, 1312, gen, device)
    a.copy_(a2)
    sa_t.copy_(transposed_scales(sa2))
    mm.copy_(mm2)
    g.replay()
    torch.cuda.synchronize()
    assert not masked_equal(out, a, sa2, w, rows_e, mm), "graph replay"
    print("masked graph capture: ok")


def smoke(entry: str, device="cuda") -> int:
    if entry in MOE_FORMS:
        return smoke_masked(entry, device)
    gen = torch.Generator().manual_seed(9)
    ok = True
    for m, n, k in ((16, 256, 128), (5, 200, 160), (64, 1792, 5120), (128, 576, 1312), (1, 32, 32)):
        a, sa, w, sb = ternary_operands(m, n, k, gen, device)
        for splits in (1, 3):
            y = run(a, sa, w, sb, entry, splits)
            torch.cuda.synchronize()
            r = ref_gemm(a.float(), sa, w, sb)
            if not torch.equal(y, r):
                ok = False
                print(diagnose(y.T, r.T, f"{entry} {m}x{n}x{k} splits {splits} (rows = weight rows)"), flush=True)
    print(f"smoke {entry}: {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def check_exact_grid(device="cuda"):
    """Every entry point and split counts 1 / 2 / 5 (the plan's where None) bit-exact on ternary data,
    32x32-block and per-(row, 32) weight scales."""
    gen = torch.Generator().manual_seed(0)
    count = 0
    for per_row in (False, True):
        for n in GRID_N:
            for k in GRID_K:
                w = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
                sb = e8m0((n if per_row else -(-n // 32), k // 32), gen, device)
                for m in GRID_M:
                    a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
                    sa = pow2((m, k // 32), -3, 3, gen, device)
                    r = ref_gemm(a.float(), sa, w, sb)
                    for entry in FORMS:
                        for splits in (None, 2, 5):
                            y = run(a, sa, w, sb, entry, splits)
                            assert torch.equal(y, r), (entry, splits, per_row, m, n, k, diagnose(y.T, r.T))
                            count += 1
    print(f"exact grid ({count} calls): ok")


def check_random(device="cuda"):
    """fp8_decode_linear on random bf16 activations and quant_fp8 / quant_fp8_rows weights within the FP8
    MMA bound of the release GEMM's reference (fp8_prefill_linear_ref), at the release's dense shapes."""
    gen = torch.Generator().manual_seed(1)
    for kind in ("block", "rowk"):
        for n, k in ((1792, 5120), (5120, 8192), (4608, 5120), (5120, 2304), (4096, 1280), (200, 160)):
            q, s = random_weight(kind, n, k, gen, device)
            for m in (1, 16, 64, 128):
                x = torch.randn(m, k, generator=gen).bfloat16().to(device)
                y = fp8_decode_linear(x, q, s).float()
                r = fp8_prefill_linear_ref(x, q, s).float()
                bad = outside_fp8_mma_bound(y, r, x, q, s)
                assert not bad.any(), (kind, m, n, k, (y - r).abs().max().item(), int(bad.sum()))
    print("random (release shapes, M 1 / 16 / 64 / 128): ok")


def check_graph_capture(device="cuda"):
    """A CUDA graph of fp8_decode_linear replays to the eager values on new inputs (one launch, and split-K
    with its workspace and reduce inside the graph)."""
    from deepinfer.checkpoint.generator import quant_fp8
    gen = torch.Generator().manual_seed(3)
    for m, n, k in ((64, 32768 // 4, 1280), (17, 1792, 5120)):
        q, s = quant_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
        q, s = q.to(device), s.view(torch.uint8).to(device)
        x = torch.randn(m, k, generator=gen).bfloat16().to(device)
        fp8_decode_linear(x, q, s)
        torch.cuda.synchronize()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            fp8_decode_linear(x, q, s)
        torch.cuda.current_stream().wait_stream(st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fp8_decode_linear(x, q, s)
        x.copy_(torch.randn(m, k, generator=gen).bfloat16())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_decode_linear(x, q, s)), (m, n, k)
    print("graph capture: ok")


def main(argv) -> int:
    if argv[:1] == ["smoke"]:
        return smoke(argv[1])
    from deepinfer.kernels import cuda_driver
    from deepinfer.kernels.cuda_fp8_decode import SRC
    cuda_driver.compile_cubin(SRC)          # once, here: the children load the cached cubin (no compile race)
    masked_only = argv[:1] == ["masked"]
    verdicts = _smoke_all(([] if masked_only else list(FORMS)) + list(MOE_FORMS), script=os.path.abspath(__file__))
    bad = {e: v for e, v in verdicts.items() if v != "ok"}
    assert not bad, bad
    if not masked_only:
        check_exact_grid()
        check_random()
        check_graph_capture()
    check_masked_exact()
    check_masked_random()
    check_masked_graph()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
