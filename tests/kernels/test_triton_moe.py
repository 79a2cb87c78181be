"""kernels/triton_moe.py (the masked MoE's glue) against its torch references, and the rewired MoE.

    CPU, Triton's interpreter    this file run as a script in a subprocess (TRITON_INTERPRET and
                                 DEEPINFER_KERNELS are read at import): every kernel vs its
                                 reference, then an FP8 MoE layer's forward on the fast ops vs refs
    CUDA (-m gpu)                the same kernel checks on the GPU
    CPU                          the masked MoE forward (route / dispatch / combine) = the loop form

    python tests/kernels/test_triton_moe.py [TINY_CHECKPOINT]
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from kernel_utils import run_under_interpreter

SHAPES = [(1, 6, 8), (5, 6, 8), (64, 6, 8), (1, 6, 48), (5, 6, 48), (64, 6, 48)]   # (T, K, E)
DIM, INTER = 256, 128


def _case(T, K, E, device, seed=0):
    """x [T, d] bf16, weights [T, K] fp32, indices [T, K]: K distinct experts per token, drawn
    from the even ids only when E > 2K (so some experts get no token), shuffled in k."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(0, E, 2) if E >= 4 * K else torch.arange(E)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)])
    x = (torch.randn(T, DIM, generator=g) * torch.exp(2 * torch.randn(T, 1, generator=g))).bfloat16()
    x[0, :32] = 0                                               # an all-zero block: the 1e-4 amax floor
    w = torch.rand(T, K, generator=g) + 0.05
    return x.to(device), w.to(device), idx.to(device)


def _bf16_ulp_close(a, b, max_frac):
    """a == b except on at most max_frac of the entries, which may move by one FP8 step (a bf16 ulp
    of the SwiGLU output, seen through act_quant)."""
    diff = a != b
    if not diff.any():
        return
    assert diff.float().mean().item() <= max_frac, diff.float().mean().item()
    rel = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30))[diff]
    assert rel.max().item() <= 0.25, rel.max().item()


def _fp8_rows(q, sa_t, rows):
    """The values of an FP8 slab's rows: e4m3 [E, T, n] bytes x their transposed scales [n / 32, >= E T]."""
    n = q.shape[-1]
    return q.view(-1, n)[rows].float() * sa_t[:, rows].T.repeat_interleave(32, dim=1)


def check_kernels(device) -> None:
    from deepinfer.kernels import triton_moe as tm
    from deepinfer.kernels import reference as ref
    for T, K, E in SHAPES:
        x, w, idx = _case(T, K, E, device, seed=T * E)
        counts, slot = tm.moe_route(idx, E)
        rc, rs = ref.moe_route_ref(idx, E)
        assert counts.dtype == torch.int32 and slot.dtype == torch.int64
        assert torch.equal(counts, rc) and torch.equal(slot, rs), (T, K, E)
        assert (counts == 0).any() or E == 8 and T > 1
        # the contiguous slab's rows: the pair's place in the stable sort by expert = start[e] + rank
        cc, cs = tm.moe_route(idx, E, contiguous=True)
        e_of = idx.flatten()
        start = torch.cumsum(rc, 0, dtype=torch.int64) - rc
        assert torch.equal(cc, rc) and torch.equal(cs, start[e_of] + rs - e_of * T), (T, K, E)
        assert torch.equal(cs, ref.moe_route_ref(idx, E, contiguous=True)[1])
        assert torch.equal(torch.sort(cs).values, torch.arange(T * K, device=cs.device))
        valid = slot                                            # rows written; the rest are unset
        xp = tm.moe_dispatch(x, slot, K, E).view(E * T, DIM)[valid]
        for tile in ((2048, 4), (32, 1)):                      # other launch tiles: the same rows
            assert torch.equal(tm.moe_dispatch(x, slot, K, E, tile=tile).view(E * T, DIM)[valid], xp), tile
        assert torch.equal(xp, ref.moe_dispatch_ref(x, slot, K, E).view(E * T, DIM)[valid]), (T, K, E)
        # the FP8 form (the CUDA masked GEMM's input): bytes x transposed scales = the same values
        xq, sa = tm.moe_dispatch(x, slot, K, E, fp8=True)
        assert xq.dtype == torch.float8_e4m3fn and sa.shape == (DIM // 32, tm.slab_scales_ld(E, T))
        assert torch.equal(_fp8_rows(xq, sa, valid), xp.float()), (T, K, E)
        rq, rsa = ref.moe_dispatch_fp8_ref(x, slot, K, E)                # the reference: the same bytes
        assert torch.equal(xq.view(E * T, DIM)[valid].view(torch.uint8), rq.view(E * T, DIM)[valid].view(torch.uint8))
        assert torch.equal(sa[:, valid], rsa[:, valid])
        for limit in (0.0, 7.0):
            g = torch.Generator().manual_seed(T + E)
            gu = (torch.randn(E, T, 2 * INTER, generator=g) * 4).bfloat16().to(device)
            hp = tm.moe_swiglu_quant(gu, slot, w, limit, INTER).view(E * T, INTER)[valid]
            rh = ref.moe_swiglu_quant_ref(gu, slot, w, limit, INTER).view(E * T, INTER)[valid]
            _bf16_ulp_close(hp, rh, 2e-3)
            hq, sh = tm.moe_swiglu_quant(gu, slot, w, limit, INTER, fp8=True)
            assert torch.equal(_fp8_rows(hq, sh, valid), hp.float()), (T, K, E, limit)
            rq, rsh = ref.moe_swiglu_quant_fp8_ref(gu, slot, w, limit, INTER)
            assert torch.equal(_fp8_rows(rq, rsh, valid), rh.float()), (T, K, E, limit)
            # DeepGEMM's masked output: [E, C padded, N][:, :T], read in place
            padded = torch.zeros(E, T + 3, 2 * INTER, dtype=gu.dtype, device=device)
            padded[:, :T] = gu
            hv = tm.moe_swiglu_quant(padded[:, :T], slot, w, limit, INTER).view(E * T, INTER)[valid]
            assert torch.equal(hv, hp), (T, K, E)
            # the shared expert's dense form: every row, weight 1 (MoE._shared)
            h = tm.swiglu_quant(gu[0], limit, INTER)
            _bf16_ulp_close(h, ref.swiglu_quant_ref(gu[0], limit, INTER), 2e-3)
            ones = torch.ones(T, device=device)
            rows = torch.arange(T, device=device)
            assert torch.equal(h, tm.moe_swiglu_quant(gu[:1], rows, ones, limit, INTER)[0]), (T, limit)
        # widths whose program tile is narrower than a power-of-two row (576 = 9 x 64, like the release's
        # 2,304 = 9 x 256): several pairs a program, no masked tail
        for inter in (96, 576):
            gw = torch.Generator().manual_seed(inter + T)
            gu = (torch.randn(E, T, 2 * inter, generator=gw) * 4).bfloat16().to(device)
            hp = tm.moe_swiglu_quant(gu, slot, w, 7.0, inter).view(E * T, inter)[valid]
            _bf16_ulp_close(hp, ref.moe_swiglu_quant_ref(gu, slot, w, 7.0, inter).view(E * T, inter)[valid], 2e-3)
            _bf16_ulp_close(tm.swiglu_quant(gu[0], 0.0, inter), ref.swiglu_quant_ref(gu[0], 0.0, inter), 2e-3)
        out = (torch.randn(E, T, DIM, generator=g) * 3).bfloat16().to(device)
        shared = torch.randn(T, DIM, generator=g).bfloat16().to(device)
        y = tm.moe_combine(out, slot, idx, shared)
        assert torch.equal(y, ref.moe_combine_ref(out, slot, idx, shared))
        padded = torch.zeros(E, T + 5, DIM, dtype=out.dtype, device=device)
        padded[:, :T] = out
        assert torch.equal(tm.moe_combine(padded[:, :T], slot, idx, shared), y), (T, K, E)
        # other launch tiles (moe_combine's prefill tile, narrower and masked ones): the same bits
        for tile in ((2048, 4), (64, 2), (32, 1)):
            assert torch.equal(tm.moe_combine(out, slot, idx, shared, tile=tile), y), (T, K, E, tile)
    check_dropped_picks(device)
    big = torch.randint(0, 48, (700, 6), generator=torch.Generator().manual_seed(3)).to(device)   # > 4096 pairs
    assert all(torch.equal(a, b) for a, b in zip(tm.moe_route(big, 48), ref.moe_route_ref(big, 48)))
    assert all(torch.equal(a, b) for a, b in zip(tm.moe_route(big, 48, True), ref.moe_route_ref(big, 48, True)))


def check_dropped_picks(device) -> None:
    """Picks outside [0, E) (an expert-parallel rank's picks of other ranks' experts, and pad rows' -1) are
    dropped: slot -1, counted nowhere, the live picks ranked as if the dropped ones were absent, and no
    kernel writes a row for them. Every token's first pick is the last expert, so the slab's last row
    (where a slot of -1 would land) belongs to the last token."""
    from deepinfer.kernels import triton_moe as tm
    from deepinfer.kernels import reference as ref
    T, K, E = 7, 4, 6
    x, w, _ = _case(T, K, 2 * E, device, seed=5)
    g = torch.Generator().manual_seed(11)
    others = torch.tensor([e for e in range(2 * E) if e != E - 1])          # K distinct experts a token
    idx = torch.stack([torch.cat([torch.tensor([E - 1]), others[torch.randperm(len(others), generator=g)[:K - 1]]])
                       for _ in range(T)])
    idx[2, 1] = -1                                              # a pad row's pick
    idx = idx.to(device)                                        # ids >= E: other ranks' experts
    live = ((idx >= 0) & (idx < E)).flatten()
    assert 0 < int(live.sum()) < T * K
    counts, slot = tm.moe_route(idx, E)
    rc, rs = ref.moe_route_ref(idx, E)
    assert torch.equal(counts, rc) and torch.equal(slot, rs)
    assert torch.equal(slot[~live], torch.full_like(slot[~live], -1))
    flat = idx.flatten().tolist()
    want = [e * T + sum(1 for q in range(p) if flat[q] == e) if 0 <= e < E else -1 for p, e in enumerate(flat)]
    assert slot.tolist() == want
    assert torch.equal(counts.long(), torch.bincount(idx.flatten()[live], minlength=E))
    cc, cs = tm.moe_route(idx, E, contiguous=True)
    assert torch.equal(cs, ref.moe_route_ref(idx, E, contiguous=True)[1]) and torch.equal(cc, rc)
    assert torch.equal(torch.sort(cs[live]).values, torch.arange(int(live.sum()), device=cs.device))
    assert torch.equal(cs[~live], torch.full_like(cs[~live], -1))
    rows = slot[live]
    last = E * T - 1
    assert last in rows.tolist()
    xq_ref = ref.act_quant_ref(x)
    for fn in (tm.moe_dispatch, ref.moe_dispatch_ref):
        xp = fn(x, slot, K, E).view(E * T, DIM)
        assert torch.equal(xp[rows], xq_ref[torch.arange(T * K, device=x.device)[live] // K])
        assert torch.equal(xp[last], xq_ref[T - 1])
    for fn in (lambda *a: tm.moe_dispatch(*a, fp8=True), ref.moe_dispatch_fp8_ref):
        xq, sa = fn(x, slot, K, E)
        assert torch.equal(_fp8_rows(xq, sa, rows), xq_ref[torch.arange(T * K, device=x.device)[live] // K].float())
    gu = (torch.randn(E, T, 2 * INTER, generator=g) * 4).bfloat16().to(device)
    hp = tm.moe_swiglu_quant(gu, slot, w, 7.0, INTER).view(E * T, INTER)
    rh = ref.moe_swiglu_quant_ref(gu, slot, w, 7.0, INTER).view(E * T, INTER)
    _bf16_ulp_close(hp[rows], rh[rows], 2e-3)
    alone = ref.moe_swiglu_quant_ref(gu, rows, w.flatten()[live], 7.0, INTER).view(E * T, INTER)   # live pairs only
    assert torch.equal(rh[rows], alone[rows])
    hq, sh = tm.moe_swiglu_quant(gu, slot, w, 7.0, INTER, fp8=True)
    assert torch.equal(_fp8_rows(hq, sh, rows), hp[rows].float())
    rq, rsh = ref.moe_swiglu_quant_fp8_ref(gu, slot, w, 7.0, INTER)
    assert torch.equal(_fp8_rows(rq, rsh, rows), rh[rows].float())


def check_moe_forward(ckpt: str) -> None:
    """An FP8 MoE layer (masked form) on the fast ops vs the same layer on the references: bit-equal
    with the GEMMs left on the references (the glue kernels only), and close with every op fast
    (loose: the interpreter's GEMMs truncate float->bf16 casts where a GPU rounds)."""
    import deepinfer.model.ops as ops
    from deepinfer.kernels import select
    from deepinfer.model.loader import load_model
    model = load_model(ckpt, progress=False, weight_format="fp8", moe_masked=True)
    calls = []
    for name in ("moe_route", "moe_dispatch", "moe_swiglu_quant", "moe_combine", "swiglu_quant"):
        fn = getattr(select, name)
        setattr(ops, name, lambda *a, _fn=fn, _n=name: (calls.append((_n, select.use_fast(a[0]))), _fn(*a))[1])

    def on_refs(fn):
        def run(*a, **k):
            kernels, select.KERNELS = select.KERNELS, "ref"
            try:
                return fn(*a, **k)
            finally:
                select.KERNELS = kernels
        return run
    gemms = {n: getattr(ops, n) for n in ("grouped_fp8_linear_masked", "fp8_linear")}
    torch.manual_seed(0)
    for layer in (model.layers[0], model.layers[-1], model.mtp[0]):
        moe = layer.ffn
        for T in (1, 9):
            x = torch.randn(T, model.args.dim).bfloat16()
            select.KERNELS = "ref"
            slow = moe(x)
            select.KERNELS = "fast"
            fast = moe(x)
            for n, fn in gemms.items():
                setattr(ops, n, on_refs(fn))
            glue = moe(x)
            for n, fn in gemms.items():
                setattr(ops, n, fn)
            assert torch.equal(glue, slow)
            err = ((fast.float() - slow.float()).abs().max() / slow.float().std()).item()
            assert err < 0.5, err
    assert {n for n, f in calls if f} == {"moe_route", "moe_dispatch", "moe_swiglu_quant", "moe_combine"}, calls


def test_kernels_and_moe_under_interpreter(tiny_checkpoint):
    run_under_interpreter(__file__, timeout=900, args=(str(tiny_checkpoint),), DEEPINFER_KERNELS="fast")


@pytest.mark.gpu
def test_kernels_cuda():
    check_kernels("cuda")


@pytest.fixture(scope="module")
def fp8_models(tiny_checkpoint):
    from deepinfer.model.loader import load_model
    masked = load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=True)
    loop = load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=False)
    return masked, loop


@pytest.mark.parametrize("T", [1, 5, 64])
def test_masked_forward_equals_loop(fp8_models, T):
    """The rewired masked forward (moe_route -> moe_dispatch -> GEMM -> moe_swiglu_quant -> GEMM ->
    moe_combine, references on a CPU) gives the loop form's bits."""
    masked, loop = fp8_models
    torch.manual_seed(T)
    for lm, ll in zip(masked.layers, loop.layers):
        x = torch.randn(T, masked.args.dim).bfloat16()
        assert lm.ffn._use_masked(x, T) and not ll.ffn._use_masked(x, T)
        assert torch.equal(lm.ffn(x), ll.ffn(x))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 8, 64, 128])
def test_masked_fp8_moe_matches_w8a16_on_cuda(tiny_checkpoint, monkeypatch, T):
    """The masked MoE on the CUDA FP8 x FP8 form (FP8 dispatch and SwiGLU outputs, fp8_masked_moe_gemm on the
    row-scaled stacks) against the same layer on W8A16: the same products and scales, so equal but for
    Hopper's FP8 adder inside a K = 32 slice (~14 bits), which can move an act_quant rounding of w2's input."""
    from deepinfer.kernels import cuda_fp8_decode, select
    from deepinfer.model.loader import load_model
    if torch.cuda.get_device_capability() != (9, 0) or cuda_driver_nvcc() is None:
        pytest.skip("needs an SM90 GPU and nvcc")
    model = load_model(tiny_checkpoint, "cuda", progress=False)
    moes = [lay.ffn for lay in model.layers if getattr(lay.ffn, "stacks", None) is not None and not lay.ffn.stacks.fp4]
    assert moes, "no FP8 expert stacks on the GPU"
    torch.manual_seed(T)
    for moe in moes:
        st = moe.stacks
        assert cuda_fp8_decode.masked_decline_reason(st.w13, st.r13) is None, "stacks not row-scaled"
        x = torch.randn(T, model.args.dim, device="cuda").bfloat16()
        assert moe._use_masked(x, T * 6)
        monkeypatch.setattr(select, "MOE_FP8_DECODE", "0")
        base = moe(x).float()
        monkeypatch.setattr(select, "MOE_FP8_DECODE", "1")
        # the slabs' capacity is the step's tokens: a step of T % 4 != 0 declines to W8A16 (MASKED_SLAB_RULE)
        assert select.masked_moe_fp8_takes(x, st.w13, st.r13, st.w2, st.r2) == (T % 4 == 0)
        fast = moe(x).float()
        assert torch.isfinite(fast).all()
        err = (fast - base).abs()
        assert err.max().item() <= 0.1 * base.std().item(), (T, err.max().item(), base.std().item())
        assert err.mean().item() <= 0.01 * base.abs().mean().item(), (T, err.mean().item())


def cuda_driver_nvcc():
    from deepinfer.kernels import cuda_driver
    return cuda_driver.find_nvcc()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_kernels("cpu")
    print("kernels: ok")
    if len(sys.argv) > 1:
        check_moe_forward(sys.argv[1])
        print("moe forward: ok")
