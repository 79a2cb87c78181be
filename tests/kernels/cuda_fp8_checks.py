"""The CUDA FP8 x FP8 GEMM (kernels/cuda_fp8_gemm.py) against plain torch on an SM90 GPU. Run by
test_cuda_fp8_gemm.py (pytest -m gpu), or directly: python tests/kernels/cuda_fp8_checks.py
[quick | auto | forms] (auto and forms: the two halves of the full run, each under 3 minutes).

Ternary data ({-1, 0, 1} operands, power-of-two scales): every product and partial sum is exact in fp32,
so the kernel must give the float64 reference's bits whatever its summation order. Random data: within
fp8_prefill_checks.outside_fp8_mma_bound (one bf16 ulp + what the FP8 wgmma's adder drops in a slice).
Every entry point (FORMS: the BN 192 form, split-K, the per-row scale layouts) is smoke-tested in a child
process first, then forced over its own grid. DEEPINFER_CUDA_FP8_DEBUG=1 runs the automatic checks on the
one-consumer, no-overlap form."""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_prefill_checks import e8m0, outside_fp8_mma_bound, pow2, ref_gemm, ternary  # noqa: E402

from deepinfer.kernels.cuda_fp8_gemm import (FORM_KIND, FORMS, entry_takes, fp8_gemm_cuda,  # noqa: E402
                                             fp8_grouped_contiguous_cuda, fp8_linear_cuda)
from deepinfer.kernels.triton_fp8_prefill import fp8_prefill_linear_ref  # noqa: E402

GRID_M = (1, 17, 64, 128, 300, 2048)
GRID_N = (128, 576, 1792, 4096 + 32)
GRID_K = (128, 160, 1280, 5120)
# the release's dense FP8 linears (perf/bench_fp8_prefill.py DENSE) at M 8192
RELEASE = ((1792, 5120), (32768, 1280), (5120, 8192), (4608, 5120), (5120, 2304), (4096, 1280))


def weight_scales(kind, n, k, gen, device="cuda", lead=()):
    """Ternary-exact weight scales of layout kind: E8M0 per 32x32 block or per (row, 32), f32 pow2 per row."""
    if kind == "row":
        return pow2((*lead, n, 1), -3, 3, gen, device)
    return e8m0((*lead, -(-n // 32) if kind == "block" else n, k // 32), gen, device)


def ternary_case(m, n, k, gen, device="cuda", kind="block"):
    a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
    sa = pow2((m, k // 32), -3, 3, gen, device)
    b = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
    return a, sa, b, weight_scales(kind, n, k, gen, device)


def random_weight(kind, n, k, gen, device="cuda"):
    """quant_fp8 (32x32 blocks) / quant_fp8_rows (per (row, 32)) / one pow2 f32 scale per row ([N, 1], the
    row-scaled expert stacks' form: the row's largest element at e4m3's top binade) of a random [n, k]
    weight."""
    from deepinfer.checkpoint.generator import quant_fp8, quant_fp8_rows
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    if kind == "row":
        s = torch.exp2(torch.ceil(torch.log2(w.abs().amax(1, keepdim=True) / 448.0)))
        return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(device), s.to(device)
    q, s = quant_fp8(w) if kind == "block" else quant_fp8_rows(w)
    return q.to(device), s.view(torch.uint8).to(device)


def diagnose(y, r, what="") -> str:
    """Where y differs from r, in the kernel's terms (a wrong result's pattern names the culprit: rows of
    one consumer warpgroup or warp, columns of one 32-block or 8-column fragment group, a constant factor
    = a scale, all zeros = nothing stored), for the report of a failed GPU run."""
    y, r = y.float(), r.float()
    bad = y != r
    rows, cols = bad.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return f"{what}: equal"
    out = [f"{what}: {rows.numel()} of {bad.numel()} differ; y all zero: {bool((y == 0).all())}; "
           f"max |y - r| {(y - r).abs().max().item():.3g}, max |r| {r.abs().max().item():.3g}"]
    for name, key, size in (("row % 128 // 64 (consumer)", rows % 128 // 64, 2), ("row % 64 // 16 (warp)", rows % 64 // 16, 4),
                            ("row % 16 // 8 (fragment half)", rows % 16 // 8, 2), ("col % 128 // 32 (scale block)", cols % 128 // 32, 4),
                            ("col % 8 (fragment column)", cols % 8, 8)):
        out.append(f"  {name}: {torch.bincount(key, minlength=size).tolist()}")
    nz = bad & (r != 0) & (y != 0)
    if nz.any():
        ratio = (y[nz] / r[nz])
        out.append(f"  y / r where both nonzero: median {ratio.median().item():.4g}, min {ratio.min().item():.4g}, "
                   f"max {ratio.max().item():.4g}")
    out.append(f"  first bad (row, col): {list(zip(rows[:6].tolist(), cols[:6].tolist()))}")
    return "\n".join(out)


def smoke(entry: str, device="cuda") -> int:
    """A few ternary shapes on one entry point, with a diagnosis of any difference (main runs each entry
    in a child process: a hang or a trap stays there)."""
    gen = torch.Generator().manual_seed(9)
    ok = True
    kind = FORM_KIND[entry][0]
    for m, n, k in ((128, 128, 128), (17, 128, 160), (300, 576, 1280), (64, 4128, 5120), (200, 4128, 5120),
                    (1, 1792, 5120), (100, 4128, 384)):     # 384: an odd stage count (a two-stage turn, then one)
        if not entry_takes(entry, k):
            continue
        a, sa, b, sb = ternary_case(m, n, k, gen, device, kind)
        y = fp8_gemm_cuda(a, sa, b, sb, entry=entry)
        torch.cuda.synchronize()
        r = ref_gemm(a.float(), sa, b, sb)
        if not torch.equal(y, r):
            ok = False
            print(diagnose(y, r, f"{entry} {m}x{n}x{k}"), flush=True)
            # the same operands with unit scales: a scale bug vs a data-path bug
            ones_a = torch.ones_like(sa)
            ones_b = torch.ones_like(sb) if sb.dtype == torch.float32 else torch.full_like(sb, 127)
            y1 = fp8_gemm_cuda(a, ones_a, b, ones_b, entry=entry)
            print(diagnose(y1, ref_gemm(a.float(), ones_a, b, ones_b), "  unit scales"), flush=True)
    print(f"smoke {entry}: {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def _smoke_in_child(entry: str, timeout: int = 90, script: str | None = None) -> tuple[str, str]:
    """(verdict, the child's output) of `script smoke entry` (default: this file's smoke) in a child process
    (a pipeline stall traps in ~10 s: FP8_GEMM_HANG_CYCLES; the timeout is the backstop)."""
    import subprocess
    try:
        r = subprocess.run([sys.executable, script or os.path.abspath(__file__), "smoke", entry], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "HANG (killed after %d s)" % timeout, ""
    return ("ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})",
            r.stdout[-6000:] + (r.stderr[-3000:] if r.returncode else ""))


def _smoke_all(entries, parallel: int = 6, script: str | None = None) -> dict[str, str]:
    """Every entry's smoke in its own child, `parallel` at a time (the cubin is compiled before), outputs
    printed in entry order."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(parallel) as pool:
        results = dict(zip(entries, pool.map(lambda e: _smoke_in_child(e, script=script), entries)))
    for entry, (_, out) in results.items():
        print(out, flush=True)
    return {entry: verdict for entry, (verdict, _) in results.items()}


def check_exact_grid(device="cuda", ms=GRID_M, ns=GRID_N, ks=GRID_K):
    """Bit-exact on ternary data over M x N x K (tails of every tile dimension; K % 128 == 32 at 160)."""
    gen = torch.Generator().manual_seed(0)
    for m in ms:
        for n in ns:
            for k in ks:
                a, sa, b, sb = ternary_case(m, n, k, gen, device)
                y = fp8_gemm_cuda(a, sa, b, sb)
                r = ref_gemm(a.float(), sa, b, sb)
                assert torch.equal(y, r), (m, n, k, (y.float() - r.float()).abs().max().item(),
                                           int((y != r).sum()))
    print(f"exact grid ({len(ms) * len(ns) * len(ks)} shapes): ok")


def check_random_grid(device="cuda", ms=(17, 300, 2048), ns=GRID_N, ks=GRID_K):
    """Random activations and weights (quant_fp8, E8M0 block scales) within the FP8 MMA bound."""
    from deepinfer.checkpoint.generator import quant_fp8
    gen = torch.Generator().manual_seed(1)
    for m in ms:
        for n in ns:
            for k in ks:
                x = torch.randn(m, k, generator=gen).bfloat16().to(device)
                q, s = quant_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
                q, s = q.to(device), s.view(torch.uint8).to(device)
                y = fp8_linear_cuda(x, q, s).float()
                r = fp8_prefill_linear_ref(x, q, s).float()
                bad = outside_fp8_mma_bound(y, r, x, q, s)
                assert not bad.any(), (m, n, k, (y - r).abs().max().item(), int(bad.sum()))
    print(f"random grid ({len(ms) * len(ns) * len(ks)} shapes): ok")


def check_release_shapes(device="cuda", m=8192):
    """The six release linears at M 8192: exact on ternary data and within the bound on random data, the
    references on 384 of the rows (the first and last tiles and a random set: a float64 [8192, 32768]
    product would take most of the run)."""
    from deepinfer.checkpoint.generator import quant_fp8
    gen = torch.Generator().manual_seed(2)
    rows = torch.cat([torch.arange(128), torch.arange(m - 128, m), torch.randperm(m, generator=gen)[:128]]).to(device)
    for n, k in RELEASE:
        a, sa, b, sb = ternary_case(m, n, k, gen, device)
        y = fp8_gemm_cuda(a, sa, b, sb)
        r = ref_gemm(a[rows].float(), sa[rows], b, sb)
        assert torch.equal(y[rows], r), (n, k, (y[rows].float() - r.float()).abs().max().item())
        x = torch.randn(m, k, generator=gen).bfloat16().to(device)
        q, s = quant_fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
        q, s = q.to(device), s.view(torch.uint8).to(device)
        y = fp8_linear_cuda(x, q, s).float()[rows]
        r = fp8_prefill_linear_ref(x[rows], q, s).float()
        bad = outside_fp8_mma_bound(y, r, x[rows], q, s)
        assert not bad.any(), (n, k, (y - r).abs().max().item(), int(bad.sum()))
    print(f"release shapes at M {m}: ok")


def check_graph_capture(device="cuda"):
    """A CUDA graph of the GEMM replays to the eager values on new inputs (300 rows: one launch; 17 rows of
    a 1792 x 5120 linear: split-K, its workspace and the reduce launch inside the graph)."""
    gen = torch.Generator().manual_seed(3)
    for m, n, k in ((300, 576, 1280), (17, 1792, 5120)):
        a, sa, b, sb = ternary_case(m, n, k, gen, device)
        fp8_gemm_cuda(a, sa, b, sb)                               # compile, load, warm up outside capture
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fp8_gemm_cuda(a, sa, b, sb)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fp8_gemm_cuda(a, sa, b, sb)
        a2, sa2, _, _ = ternary_case(m, n, k, gen, device)
        a.copy_(a2)
        sa.copy_(sa2)
        g.replay()
        torch.cuda.synchronize()
        want = fp8_gemm_cuda(a, sa, b, sb)
        assert torch.equal(out, want) and torch.equal(out, ref_gemm(a.float(), sa, b, sb)), (m, n, k)
    print("graph capture: ok")


def check_grouped(device="cuda"):
    """The grouped contiguous form: experts with no rows, rows not multiples of the tile, N not a multiple
    of BN (an A tile reading the next expert's rows must not change this expert's outputs)."""
    gen = torch.Generator().manual_seed(4)
    for E, n, k, counts in ((4, 200, 256, [3, 0, 140, 9]), (3, 128, 160, [0, 0, 300]),
                            (6, 576, 1280, [0, 200, 1, 129, 0, 300]), (2, 4128, 512, [128, 256])):
        P = sum(counts)
        a = ternary((P, k), gen, device).to(torch.float8_e4m3fn)
        sa = pow2((P, k // 32), -2, 3, gen, device)
        b = ternary((E, n, k), gen, device).to(torch.float8_e4m3fn)
        sb = e8m0((E, -(-n // 32), k // 32), gen, device)
        y = fp8_grouped_contiguous_cuda(a, sa, b, sb, torch.tensor(counts, device=device))
        start = 0
        for e, c in enumerate(counts):
            r = ref_gemm(a[start:start + c].float(), sa[start:start + c], b[e], sb[e])
            assert torch.equal(y[start:start + c], r), (E, n, k, counts, e)
            start += c
    print("grouped contiguous: ok")


def check_forms_exact(device="cuda", ms=(1, 17, 64, 128, 300), ns=(128, 576, 4128), ks=(128, 160, 640, 1280, 5120),
                      entries=tuple(FORMS)):
    """Every entry point forced (its own weight-scale layout) bit-exact on ternary data over a grid with
    tails in every tile dimension; the split-K forms at every M (one split where K has < 4 stages). Each
    weight is drawn once per (layout, N, K) and shared by the M and the entries."""
    gen = torch.Generator().manual_seed(6)
    for kind in ("block", "row", "rowk"):
        of_kind = [e for e in entries if FORM_KIND[e][0] == kind]
        if not of_kind:
            continue
        for n in ns:
            for k in ks:
                b = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
                sb = weight_scales(kind, n, k, gen, device)
                for m in ms:
                    a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
                    sa = pow2((m, k // 32), -3, 3, gen, device)
                    r = ref_gemm(a.float(), sa, b, sb)
                    for entry in (e for e in of_kind if entry_takes(e, k)):
                        y = fp8_gemm_cuda(a, sa, b, sb, entry=entry)
                        assert torch.equal(y, r), (entry, m, n, k, diagnose(y, r))
    print(f"forms exact ({len(entries)} entries x {len(ms) * len(ns) * len(ks)} shapes): ok")


def check_forms_random(device="cuda", entries=tuple(FORMS)):
    """Every entry point forced on random data (quant_fp8 / quant_fp8_rows / row-scaled weights) within
    the FP8 MMA bound."""
    from deepinfer.kernels.triton_quant import act_quant_fp8
    gen = torch.Generator().manual_seed(7)
    for kind in ("block", "row", "rowk"):
        for m, n, k in ((17, 576, 1280), (300, 4128, 5120), (128, 1792, 512)):
            x = torch.randn(m, k, generator=gen).bfloat16().to(device)
            q, s = random_weight(kind, n, k, gen, device)
            a, sa = act_quant_fp8(x)
            r = fp8_prefill_linear_ref(x, q, s).float()
            for entry in (e for e in entries if FORM_KIND[e][0] == kind and entry_takes(e, k)):
                y = fp8_gemm_cuda(a, sa, q, s, entry=entry).float()
                bad = outside_fp8_mma_bound(y, r, x, q, s)
                assert not bad.any(), (entry, m, n, k, (y - r).abs().max().item(), int(bad.sum()))
    print(f"forms random ({len(entries)} entries): ok")


def check_scale_tiles_match_plain(device="cuda"):
    """Each scale-tile form (TS_TWIN) gives its plain twin's bits on random data: the same slice products,
    promoted in the same order with the same scale products, only read from shared memory instead of global;
    at the release linears (M 300 and 2048, and an odd stage count) and on the grouped contiguous form with
    block and per-row scales (the automatic choice with DEEPINFER_CUDA_FP8_TS on and off)."""
    from deepinfer.kernels import cuda_fp8_gemm
    from deepinfer.kernels.cuda_fp8_gemm import TS_TWIN
    from deepinfer.kernels.triton_quant import act_quant_fp8
    gen = torch.Generator().manual_seed(11)
    for n, k in RELEASE + ((4128, 384),):
        for kind in ("block", "row"):
            q, s = random_weight(kind, n, k, gen, device)
            for m in (300, 2048):
                a, sa = act_quant_fp8(torch.randn(m, k, generator=gen).bfloat16().to(device))
                for plain, twin in TS_TWIN.items():
                    if FORM_KIND[plain][0] != kind:
                        continue
                    y0 = fp8_gemm_cuda(a, sa, q, s, entry=plain)
                    y1 = fp8_gemm_cuda(a, sa, q, s, entry=twin)
                    assert torch.equal(y0, y1), (plain, twin, m, n, k, diagnose(y1, y0))
    saved = cuda_fp8_gemm.TS_ON
    try:
        for kind, (E, n, k, counts) in (("block", (6, 576, 1280, [0, 200, 1, 129, 0, 300])),
                                        ("row", (4, 4608, 5120, [700, 0, 33, 1300]))):
            P = sum(counts)
            a, sa = act_quant_fp8(torch.randn(P, k, generator=gen).bfloat16().to(device))
            ws = [random_weight(kind, n, k, gen, device) for _ in range(E)]
            b = torch.stack([w for w, _ in ws])
            sb = torch.stack([sc for _, sc in ws])
            c = torch.tensor(counts, device=device)
            outs = []
            for on in (False, True):
                cuda_fp8_gemm.TS_ON = on
                outs.append(fp8_grouped_contiguous_cuda(a, sa, b, sb, c))
            assert torch.equal(outs[0], outs[1]), (kind, diagnose(outs[1], outs[0]))
    finally:
        cuda_fp8_gemm.TS_ON = saved
    print("scale tiles match their plain twins: ok")


def check_splitk_decode(device="cuda"):
    """The automatic choice at decode sizes (split-K where the tiles leave SMs idle) on the release linears:
    exact on ternary data, within the bound on random data, the same bits on a second call (fixed order)."""
    from deepinfer.kernels import cuda_fp8_gemm
    gen = torch.Generator().manual_seed(8)
    for n, k in RELEASE:
        b = ternary((n, k), gen, device).to(torch.float8_e4m3fn)
        sb = weight_scales("block", n, k, gen, device)
        q, s = random_weight("block", n, k, gen, device)
        for m in (1, 32, 64, 100, 128):
            a = ternary((m, k), gen, device).to(torch.float8_e4m3fn)
            sa = pow2((m, k // 32), -3, 3, gen, device)
            y = fp8_gemm_cuda(a, sa, b, sb)
            assert torch.equal(y, ref_gemm(a.float(), sa, b, sb)), (m, n, k, cuda_fp8_gemm.form(m, "block", True))
            x = torch.randn(m, k, generator=gen).bfloat16().to(device)
            y1, y2 = fp8_linear_cuda(x, q, s), fp8_linear_cuda(x, q, s)
            assert torch.equal(y1, y2), (m, n, k, "split-K sums in a fixed order")
            r = fp8_prefill_linear_ref(x, q, s).float()
            bad = outside_fp8_mma_bound(y1.float(), r, x, q, s)
            assert not bad.any(), (m, n, k, (y1.float() - r).abs().max().item(), int(bad.sum()))
    print("split-K at decode sizes: ok")


def check_grouped_row_scales(device="cuda"):
    """The grouped contiguous form on per-row [E, N, 1] f32 (the MoE's row-scaled expert stacks) and per
    (row, 32) [E, N, K/32] weight scales, exact on ternary data."""
    gen = torch.Generator().manual_seed(10)
    for kind in ("row", "rowk"):
        for E, n, k, counts in ((4, 200, 256, [3, 0, 140, 9]), (6, 576, 1280, [0, 200, 1, 129, 0, 300]),
                                (2, 4128, 512, [128, 256])):
            P = sum(counts)
            a = ternary((P, k), gen, device).to(torch.float8_e4m3fn)
            sa = pow2((P, k // 32), -2, 3, gen, device)
            b = ternary((E, n, k), gen, device).to(torch.float8_e4m3fn)
            sb = weight_scales(kind, n, k, gen, device, lead=(E,))
            y = fp8_grouped_contiguous_cuda(a, sa, b, sb, torch.tensor(counts, device=device))
            start = 0
            for e, c in enumerate(counts):
                r = ref_gemm(a[start:start + c].float(), sa[start:start + c], b[e], sb[e])
                assert torch.equal(y[start:start + c], r), (kind, E, n, k, counts, e)
                start += c
    print("grouped contiguous, row scales: ok")


def check_select_decline(device="cuda"):
    """select.fp8_linear with PREFILL_GEMM=cuda: the CUDA kernel at M >= 32 on 32x32-block and per-(row, 32)
    weight scales (auto: blocks only; the MoE's grouped steps: blocks and per-row); K % 32 != 0 declines to the W8A16 path with one log line."""
    from deepinfer.checkpoint.generator import quant_fp8, quant_fp8_rows
    from deepinfer.kernels import select
    gen = torch.Generator().manual_seed(5)
    saved = select.PREFILL_GEMM
    select.PREFILL_GEMM = "cuda"
    try:
        x = torch.randn(64, 256, generator=gen).bfloat16().to(device)
        q, s = quant_fp8(torch.randn(192, 256, generator=gen) * 256 ** -0.5)
        q, s = q.to(device), s.view(torch.uint8).to(device)
        assert select._cuda_fp8_ok(x, q, s)
        y = select.fp8_linear(x, q, s)
        assert torch.equal(y, fp8_linear_cuda(x, q, s))
        qr, sr = quant_fp8_rows(torch.randn(192, 256, generator=gen) * 256 ** -0.5)
        qr, sr = qr.to(device), sr.view(torch.uint8).to(device)
        assert select._cuda_fp8_ok(x, qr, sr)                     # per-(row, 32): the rowk form
        y = select.fp8_linear(x, qr, sr)
        assert torch.equal(y, fp8_linear_cuda(x, qr, sr))
        r = fp8_prefill_linear_ref(x, qr, sr).float()
        assert not outside_fp8_mma_bound(y.float(), r, x, qr, sr).any()
        select.PREFILL_GEMM = "auto"                              # auto: 32x32 blocks only (measured)
        x_big = torch.randn(select.CUDA_AUTO_MIN_M, 256, generator=gen).bfloat16().to(device)
        assert select._cuda_fp8_ok(x_big, q, s) and not select._cuda_fp8_ok(x_big, qr, sr)
        # auto, the MoE's grouped contiguous step: per-row (the MXFP4 experts) and block scales on the
        # CUDA kernel, per-(row, 32) on W8A16; the same output as the kernel called directly
        w3 = torch.stack([q, q])
        row3 = torch.rand(2, 192, 1, generator=gen).add(0.5).to(device)
        assert select._cuda_grouped_ok(x, w3, row3) and select._cuda_grouped_ok(x, w3, torch.stack([s, s]))
        assert not select._cuda_grouped_ok(x, w3, torch.stack([sr, sr]))
        counts = torch.tensor([40, 24], dtype=torch.int32, device=device)
        from deepinfer.kernels.triton_quant import act_quant_fp8
        y = select.grouped_fp8_linear_contiguous(x, w3, row3, counts)
        assert torch.equal(y, fp8_grouped_contiguous_cuda(*act_quant_fp8(x), w3, row3, counts))
        select.PREFILL_GEMM = "cuda"
        # K % 32 != 0: declined (logged once); no FP8 linear of the model has one (act_quant needs K % 32)
        from deepinfer.kernels.cuda_fp8_gemm import decline_reason
        assert decline_reason(64, 192, 240, torch.zeros(6, 8), x.device) == "K a multiple of 32"
        x240 = torch.randn(64, 240, generator=gen).bfloat16().to(device)
        q240 = torch.zeros(192, 240, dtype=torch.float8_e4m3fn, device=device)
        assert not select._cuda_fp8_ok(x240, q240, torch.zeros(6, 8, dtype=torch.uint8, device=device))
        assert ("fp8_linear_cuda", "K a multiple of 32") in select.declined()
    finally:
        select.PREFILL_GEMM = saved
    print("select: cuda pick and declines: ok")


def main(mode: str = "all"):
    """Smoke each entry point in a child process first (a hang or trap costs a child, not the run), then
    every check on the automatic choice (or, where a fast entry failed its smoke, forced onto the first
    that passed, to test the pipeline), each section reported whatever the others do. mode: "all"; "quick"
    (smaller grids, no release shapes); "auto" (the automatic choice's sections only) or "forms" (the
    per-form sections only): two device commands of under 3 minutes each."""
    assert mode in ("all", "quick", "auto", "forms"), mode
    quick = mode == "quick"
    import traceback
    from deepinfer.kernels import cuda_driver, cuda_fp8_gemm
    t0 = time.time()
    log = cuda_driver.compile_cubin(cuda_fp8_gemm.SRC)[1]
    print("ptxas:", " | ".join(line.strip() for line in log.splitlines() if "spill" in line or "Used" in line), flush=True)
    smokes = _smoke_all(list(FORMS))                                       # every form, the debug one too
    print("smoke: " + "; ".join(f"{e} {v}" for e, v in smokes.items()), flush=True)
    failed = [f"{e} smoke" for e, v in smokes.items() if v != "ok"]
    if smokes["fp8_gemm_sm90_bn128"] != "ok" or smokes["fp8_gemm_sm90_bm64"] != "ok":
        # the rest on the first block-scale entry that passed its smoke, forced for every M: does the
        # pipeline hold?
        ok = [e for e in ("fp8_gemm_sm90_bm64", "fp8_gemm_sm90_debug") if smokes.get(e) == "ok"]
        if not ok:
            return 1
        cuda_fp8_gemm.FORCE = ok[0]
    elif smokes["fp8_gemm_sm90_bn128_splitk"] != "ok" or smokes["fp8_gemm_sm90_bm64_splitk"] != "ok":
        cuda_fp8_gemm.SPLITK = False         # the automatic sections without split-K (DEEPINFER_CUDA_FP8_SPLITK=0)
    good = [e for e in FORMS if smokes[e] == "ok"]          # the per-form sections: the forms that smoked ok
    rows_ok = all(smokes[f"fp8_gemm_sm90_bn128_{kind}"] == "ok" for kind in ("row", "rowk"))
    auto_sections = [("exact grid", lambda: check_exact_grid(ms=(1, 17, 300) if quick else GRID_M)),
                     ("graph capture", check_graph_capture), ("grouped contiguous", check_grouped),
                     ("random grid", lambda: check_random_grid(ms=(17,) if quick else (17, 300, 2048)))]
    if not quick:
        auto_sections.append(("release shapes", check_release_shapes))
    form_sections = [("forms exact", lambda: check_forms_exact(ms=(17, 300) if quick else (1, 17, 64, 128, 300),
                                                               entries=good)),
                     ("forms random", lambda: check_forms_random(entries=good)),
                     ("scale tiles = plain", check_scale_tiles_match_plain),
                     ("split-K decode", check_splitk_decode)]
    if rows_ok:                              # (select's check takes per-(row, 32) scales on the CUDA kernel)
        form_sections += [("grouped row scales", check_grouped_row_scales), ("select", check_select_decline)]
    sections = (auto_sections if mode != "forms" else []) + (form_sections if mode != "auto" else [])
    for name, fn in sections:
        try:
            fn()
        except Exception:  # noqa: BLE001 (report every section; the exit code says it failed)
            failed.append(name)
            print(f"{name}: FAILED (forced entry: {cuda_fp8_gemm.FORCE})\n{traceback.format_exc()[-3000:]}", flush=True)
    print(f"{'all ok' if not failed else 'FAILED: ' + ', '.join(failed)} (forced entry: {cuda_fp8_gemm.FORCE}, "
          f"{time.time() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    arg = sys.argv[1:]
    sys.exit(smoke(arg[1]) if arg[:1] == ["smoke"] else main(arg[0] if arg else "all"))
