"""DeepGEMM (SM90 build bundled in vllm 0.33.0) behind our weight formats.

Import order (DESIGN.md): `deep_gemm`, then `vllm.third_party.deep_gemm`; None when neither loads.

Scale mapping. DeepGEMM's SM90 FP8 kernels take one activation scale per (row, 128 K) and one
weight scale per 128x128 tile (fp32), and promote the accumulator once per 128 K. Ours are per
(row, 32 K) and per 32x32 tile, all powers of two. The mapping re-expresses each tensor at the
larger block with S128 = max of the covered pow2 scales: q' = e4m3(q * s32 / S128).
  * exact for every element whose shifted value stays an e4m3 normal or exact subnormal; the
    only loss is in elements below ~2^-6 * S128 (|x| < amax_128 / 28672) inside a 32-block whose
    own scale is smaller than the 128-block's; reblock_* report how many elements moved;
  * MXFP4 expert weights are the exception: e2m1 has a 1-bit mantissa, so q * 2^(e - E) is exact
    for any exponent gap up to 14 with E = max(e) - 6 (6 * 2^6 = 384 <= 448): the FP4 -> FP8
    128x128 conversion is exact for all real weights (checked and counted at load).
So DeepGEMM reproduces our weights exactly (FP4 experts) or nearly (FP8 linears) but not our
per-32 activation rounding: the Triton kernels in triton_gemm.py are the exact path and DeepGEMM
the comparison (and an opt-in fast path where its speed wins).

The GEMM backend (DEEPINFER_GEMM=deepgemm, kernels/select.py). Activations: act_quant (our per-32
rounding), then act_quant_fp8 at block 128 on those values, which is bit for bit
act_reblock_128(act_quant_fp8(.)) of them (pow2_ceil commutes with max: the per-128 scale IS the
max of the per-32 ones): two Triton kernels, no torch re-blocking pass. Weights, once:
  * prepare_deepgemm(model) (load_model calls it when the backend is on): every MoE's FP8 expert
    stacks are re-expressed IN PLACE (the e4m3 bytes overwritten, the E8M0 per-(row, 32) scales
    replaced by f32 per 128x128 tile, the experts' Linear views re-pointed). Exact for FP4-origin
    experts, so nothing is lost by dropping the 32-form, and no bytes are added (the experts are
    ~90% of a layer's weight bytes at EP8; a second copy would not fit a full-width model).
  * FP8 linears keep their 32x32-tile form (Linear.dense / forward_fp32, the Triton path of any
    shape and the exact reference read it; the 128 form moves a few elements) and get the 128-tile
    copy next to it, cached on the weight tensor itself (so it dies with it; no data_ptr reuse
    hazard). Cost: the non-expert FP8 linear bytes once more, +1 B per weight + 4 B per 16384
    (~130 MB per full-width layer: wq_a, wq_b, wkv, wo_b, shared expert, indexer, compressor).
  * without prepare_deepgemm, the first call converts and caches the same way (stacks included:
    then they exist twice); never during CUDA-graph capture (that call takes the Triton path).
Dims must be multiples of 128 (DeepGEMM's K block, and whole N tiles); anything else stays on the
Triton path. The masked grouped GEMM stores whole BLOCK_M-row boxes of D ([G * M, N] TMA view), so
the per-expert capacity is padded to MASKED_M_ALIGN rows. Nothing on the path reads the device
from the host: masked_m stays on the device and expected_m is a host int from the shapes.
"""

from __future__ import annotations

import logging

import torch

from .optional import first_importable
from .reference import act_quant_fp8_ref, act_quant_ref, e8m0_to_float
from .tensor_version import tensor_version

log = logging.getLogger(__name__)

# DeepGEMM's SM90 masked kernel picks BLOCK_M in {64, 128} and stores D in whole BLOCK_M-row TMA boxes
# over the [G * M, N] view: a per-group M that is not a multiple of it lets a group's last block write
# into the next group's first rows. The capacity is padded to this.
MASKED_M_ALIGN = 128

# What the backend did in this process (host counters, no device reads): weights re-blocked, elements
# that moved, DeepGEMM calls made (tests check that the path was taken).
STATS = dict(linears=0, linear_elements=0, linear_changed=0, stacks=0, expert_elements=0, expert_changed=0,
             gemm_calls=0, masked_calls=0)
_CACHE_ATTR = "_deepgemm_tile128"
_logged: set = set()


def load():
    """The DeepGEMM module, or None."""
    return first_importable("deep_gemm", "vllm.third_party.deep_gemm")


def _pow2_scale_max(s: torch.Tensor, fr: int, fc: int) -> torch.Tensor:
    """[R, C] pow2 scales -> [R/fr, C/fc] block maxima."""
    r, c = s.shape
    return s.view(r // fr, fr, c // fc, fc).amax(dim=(1, 3))


def reblock_weight_128(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """w [N, K] e4m3 with s [N/32, K/32] (32x32 tiles) or [N, K/32] (per row) pow2 f32 ->
    (w' e4m3 [N, K], S [N/128, K/128] f32, number of elements whose value changed)."""
    n, k = w.shape
    fr = 128 // (n // s.shape[0])
    big = _pow2_scale_max(s, fr, 4)                                      # [N/128, K/128]
    rows = n // s.shape[0]
    s_full = s.repeat_interleave(rows, 0).repeat_interleave(32, 1)
    big_full = big.repeat_interleave(128, 0).repeat_interleave(128, 1)
    exact = w.float() * s_full
    w2 = (exact / big_full).to(torch.float8_e4m3fn)
    changed = int((w2.float() * big_full != exact).sum())
    return w2, big.contiguous(), changed


def fp4_weight_to_fp8_128(w8: torch.Tensor, s_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """FP4-origin weight (e4m3 [N, K] holding e2m1 values, per-(row, 32) pow2 scales) -> DeepGEMM
    128x128 layout with E = max(e) - 6 per tile, so each value moves up to 6 binades up or 8 down."""
    n, k = w8.shape
    big = _pow2_scale_max(s_row, 128, 4) / 64.0                          # 2^(emax - 6)
    s_full = s_row.repeat_interleave(32, 1)
    big_full = big.repeat_interleave(128, 0).repeat_interleave(128, 1)
    exact = w8.float() * s_full
    w2 = (exact / big_full).to(torch.float8_e4m3fn)
    changed = int((w2.float() * big_full != exact).sum())
    return w2, big.contiguous(), changed


def act_reblock_128(q: torch.Tensor, s32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our per-32 activation (e4m3 [M, K], pow2 f32 [M, K/32]) -> per-128 (e4m3, f32 [M, K/128])."""
    m, k = q.shape
    s128 = s32.view(m, k // 128, 4).amax(-1)
    ratio = (s32 / s128.repeat_interleave(4, 1)).repeat_interleave(32, 1)
    return (q.float() * ratio).to(torch.float8_e4m3fn), s128.contiguous()


def fp8_gemm_nt(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """D = A @ B^T with 1x128 / 128x128 scales through DeepGEMM (bf16 out)."""
    dg = load()
    d = out if out is not None else torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    dg.fp8_gemm_nt((a, sa), (b, sb), d)
    return d


def grouped_masked(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, masked_m: torch.Tensor,
                   expected_m: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Masked grouped GEMM: a [G, Mmax, K], sa [G, Mmax, K/128], b [G, N, K], sb [G, N/128, K/128]."""
    dg = load()
    g, mmax, _ = a.shape
    d = out if out is not None else torch.empty(g, mmax, b.shape[1], dtype=torch.bfloat16, device=a.device)
    dg.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, masked_m, expected_m)
    return d


def prepare_sfa(sa: torch.Tensor) -> torch.Tensor:
    """Pre-transform activation scales into DeepGEMM's TMA-aligned MN-major layout, so a timed
    call does not include the transform (falls back to the plain tensor)."""
    dg = load()
    try:
        return dg.get_mn_major_tma_aligned_tensor(sa)
    except Exception:  # noqa: BLE001
        return sa


# ---- the GEMM backend (kernels/select.py dispatches here) --------------------------------------

def shapes_ok(n: int, k: int) -> bool:
    """DeepGEMM takes N and K in whole 128 blocks (our scales would otherwise straddle its tiles)."""
    return n > 0 and k > 0 and n % 128 == 0 and k % 128 == 0


def is_tile128(w: torch.Tensor, s: torch.Tensor) -> bool:
    """The DeepGEMM weight form: f32 scales, one per 128x128 tile ([..., N/128, K/128]). Never
    ambiguous with ours ([..., N/32, K/32] per tile or [..., N, K/32] per row)."""
    n, k = w.shape[-2:]
    return s.dtype == torch.float32 and shapes_ok(n, k) and tuple(s.shape[-2:]) == (n // 128, k // 128)


def dequant_tile128(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[..., N, K] e4m3 + f32 [..., N/128, K/128] -> the exact float32 values."""
    return w.view(torch.float8_e4m3fn).float() * s.repeat_interleave(128, -2).repeat_interleave(128, -1)


def fp4_origin(w: torch.Tensor) -> bool:
    """Every |value| <= 6 (e4m3 magnitude bits <= 0x4C): the FP4-expert conversion cannot overflow.
    A host read: load time only."""
    return bool(((w.view(torch.uint8) & 0x7F) <= 0x4C).all())


def to_tile128(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Our FP8 weight ([N, K] or a stack [G, N, K] e4m3; E8M0 bytes or f32 pow2 scales per 32x32 tile
    or per (row, 32)) -> (e4m3 same shape, f32 [..., N/128, K/128], elements whose value changed).
    FP4-origin weights with per-row scales take fp4_weight_to_fp8_128 (exact), the rest
    reblock_weight_128. New tensors; host reads (counts): not for CUDA-graph capture."""
    sf = s if s.dtype == torch.float32 else e8m0_to_float(s)
    if w.dim() == 3:
        g, n, k = w.shape
        w128 = torch.empty_like(w)
        s128 = torch.empty(g, n // 128, k // 128, dtype=torch.float32, device=w.device)
        changed = 0
        for i in range(g):
            wi, si, ci = to_tile128(w[i], sf[i])
            w128[i].view(torch.uint8).copy_(wi.view(torch.uint8))
            s128[i].copy_(si)
            changed += ci
        return w128, s128, changed
    w = w.view(torch.float8_e4m3fn)
    if sf.shape[0] == w.shape[0] and fp4_origin(w):
        return fp4_weight_to_fp8_128(w, sf)
    return reblock_weight_128(w, sf)


def _log_once(key: str, level: int, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def cached_tile128(w: torch.Tensor, s: torch.Tensor, lazy: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The 128-tile form of (w, s), converted on first use and kept on w (keyed by the scale tensor
    and both version counters, so an in-place write rebuilds it). None while a CUDA graph is being
    captured and nothing is cached yet (the conversion reads counts on the host)."""
    ent = getattr(w, _CACHE_ATTR, None)
    key = (tensor_version(w), tensor_version(s))
    if ent is not None and ent[0] is s and ent[1] == key:
        return ent[2], ent[3]
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        _log_once("capture", logging.WARNING, "DeepGEMM backend: a weight met first inside CUDA-graph "
                  "capture stays on the Triton path (prepare_deepgemm(model) converts them at load)")
        return None
    if lazy:
        _log_once("lazy", logging.INFO, "DeepGEMM backend: FP8 weights re-blocked to 128x128 tiles on first "
                  "use and kept next to the originals (prepare_deepgemm(model) at load does the stacks in place)")
    w128, s128, changed = to_tile128(w, s)
    kind = "linear" if w.dim() == 2 else "expert"
    STATS["linears" if w.dim() == 2 else "stacks"] += 1
    STATS[f"{kind}_elements"] += w.numel()
    STATS[f"{kind}_changed"] += changed
    if changed:
        log.debug("DeepGEMM backend: %d of %d weight elements changed re-blocking a %s weight %s",
                 changed, w.numel(), kind, tuple(w.shape))
    setattr(w, _CACHE_ATTR, (s, key, w128, s128, changed))
    return w128, s128


def act_quant_128(x2: torch.Tensor, prerounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], f32 pow2 [M, K/128]): our per-32 FP8 rounding (skipped when x2 holds
    act_quant values already) expressed on per-(row, 128) scales, bit for bit act_reblock_128 of
    the per-32 form. Triton on CUDA, the torch reference elsewhere (tests)."""
    if x2.is_cuda:
        from .triton_quant import act_quant, act_quant_fp8
        return act_quant_fp8(x2 if prerounded else act_quant(x2), 128)
    return act_quant_fp8_ref(x2 if prerounded else act_quant_ref(x2), 128)


def linear(x: torch.Tensor, w128: torch.Tensor, s128: torch.Tensor) -> torch.Tensor:
    """select.fp8_linear through DeepGEMM: x [..., K] -> [..., N] bf16 with the 128-tile weight."""
    k, n = x.shape[-1], w128.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16, device=x.device)
    q, sa = act_quant_128(x2)
    STATS["gemm_calls"] += 1
    return fp8_gemm_nt(q, sa, w128, s128).view(*x.shape[:-1], n)


def grouped_linear_masked(x: torch.Tensor, w128: torch.Tensor, s128: torch.Tensor, masked_m: torch.Tensor,
                          expected_m: int) -> torch.Tensor:
    """select.grouped_fp8_linear_masked through DeepGEMM's masked grouped GEMM: x [G, C, K] bf16
    (act_quant values), w128 [G, N, K], s128 [G, N/128, K/128] -> [G, C, N] bf16 (a view of a
    [G, C padded to MASKED_M_ALIGN, N] buffer); rows >= masked_m[g] unspecified. expected_m: a host
    int from the shapes (DeepGEMM's tile choice), never from masked_m."""
    g, c, k = x.shape
    n = w128.shape[1]
    q, sa = act_quant_128(x.reshape(g * c, k), prerounded=True)
    cp = -(-c // MASKED_M_ALIGN) * MASKED_M_ALIGN
    if cp == c:
        qa, sfa = q.view(g, c, k), sa.view(g, c, k // 128)
    else:   # rows c..cp are never computed into rows < c (a GEMM row reads only its own A row)
        qa = torch.empty(g, cp, k, dtype=torch.float8_e4m3fn, device=x.device)
        qa.view(torch.uint8)[:, :c].copy_(q.view(torch.uint8).view(g, c, k))
        sfa = torch.zeros(g, cp, k // 128, dtype=torch.float32, device=x.device)
        sfa[:, :c].copy_(sa.view(g, c, k // 128))
    if masked_m.dtype != torch.int32 or not masked_m.is_contiguous():
        masked_m = masked_m.to(torch.int32).contiguous()
    out = torch.empty(g, cp, n, dtype=torch.bfloat16, device=x.device)
    STATS["masked_calls"] += 1
    grouped_masked(qa, sfa, w128, s128, masked_m, max(1, int(expected_m)), out=out)
    return out[:, :c]


def prepare_deepgemm(model, force: bool = False) -> dict:
    """Convert a loaded model's FP8 weights once for the DeepGEMM backend (the module docstring):
    expert stacks in place, FP8 linears' 128-tile copies cached next to them. A no-op unless
    DEEPINFER_GEMM=deepgemm can run on the model's device (select.deepgemm_active), or force (tests:
    the conversion on any device; there the torch reference runs the converted experts). Logs one
    summary line, with the number of weight elements the re-blocking changed; returns the counts."""
    from . import select
    rep = dict(active=False, stacks=0, expert_elements=0, expert_changed=0, linears=0, linear_elements=0,
               linear_changed=0, extra_bytes=0, skipped=0)
    if not force and select.GEMM != "deepgemm":
        return rep
    moes = [m for m in model.modules() if hasattr(m, "experts") and _is_stacks(getattr(m, "stacks", None))]
    lins = [m for m in model.modules() if isinstance(getattr(m, "fp8", None), tuple)]
    if not moes and not lins:
        return rep
    probe = moes[0].stacks.w13 if moes else lins[0].fp8[0]
    if not force and not select.deepgemm_active(probe):
        if select.GEMM == "deepgemm":
            _log_once("inactive", logging.WARNING, "DEEPINFER_GEMM=deepgemm: DeepGEMM cannot run on %s (needs "
                      "SM90, the fast paths on, batch-invariant mode off, deep_gemm importable): Triton path",
                      probe.device)
        return rep
    rep["active"] = True
    for moe in moes:
        _convert_stacks(moe, rep)
    for lin in lins:
        w, s = lin.fp8
        if is_tile128(w, s) or getattr(lin, "fused", False):   # a view: converted with its stack
            continue
        if not (shapes_ok(*w.shape) and select._fast_gemm_ok(w, s)):
            rep["skipped"] += 1
            continue
        w128, s128 = cached_tile128(w, s, lazy=False)
        rep["linears"] += 1
        rep["linear_elements"] += w.numel()
        rep["linear_changed"] += getattr(w, _CACHE_ATTR)[4]
        rep["extra_bytes"] += w128.numel() + 4 * s128.numel()
    log.info("DeepGEMM backend: %d expert stacks re-expressed in place on 128x128 tiles (%d of %d weight "
             "elements changed); %d FP8 linears re-blocked next to their 32x32 originals (%d of %d elements "
             "changed, +%.1f MB); %d left on the Triton path (dims not multiples of 128)",
             rep["stacks"], rep["expert_changed"], rep["expert_elements"], rep["linears"], rep["linear_changed"],
             rep["linear_elements"], rep["extra_bytes"] / 2**20, rep["skipped"])
    return rep


def _is_stacks(st) -> bool:
    """FP8 expert stacks (FP4 ones, moe.ExpertStacks.fp4, stay on the W4A16 kernels)."""
    return st is not None and all(hasattr(st, a) for a in ("w13", "s13", "w2", "s2")) and not getattr(st, "fp4", False)


def _convert_stacks(moe, rep: dict) -> None:
    """moe.stacks (model/moe.py ExpertStacks) -> 128x128 tiles in place, expert Linear views re-pointed
    the way MoE.init_fp8_stacks lays them out (w1 rows, then w3 rows of w13)."""
    st = moe.stacks
    e_count, two_inter, dim = st.w13.shape
    inter = st.w2.shape[2]
    if is_tile128(st.w13, st.s13) and is_tile128(st.w2, st.s2):
        return
    if two_inter != 2 * inter or not (shapes_ok(two_inter, dim) and shapes_ok(dim, inter)):
        rep["skipped"] += 1
        return
    for wname, sname in (("w13", "s13"), ("w2", "s2")):
        w, s = getattr(st, wname), getattr(st, sname)
        if hasattr(w, _CACHE_ATTR):                   # a lazy copy made before: superseded
            delattr(w, _CACHE_ATTR)
        _, n, k = w.shape
        s_new = torch.empty(e_count, n // 128, k // 128, dtype=torch.float32, device=w.device)
        for e in range(e_count):
            we, se, changed = to_tile128(w[e], s[e])
            w[e].view(torch.uint8).copy_(we.view(torch.uint8))
            s_new[e].copy_(se)
            rep["expert_changed"] += changed
            rep["expert_elements"] += we.numel()
            STATS["expert_changed"] += changed
        setattr(st, sname, s_new)
    if hasattr(st, "r13"):                            # row scales (ExpertStacks.to_row_scales) no longer apply
        st.r13 = st.r2 = None
    for e, ex in enumerate(moe.experts):
        old = ex.w1.fp8[0] if ex.w1.fp8 is not None else None
        ex.w1.fp8 = (st.w13[e, :inter], st.s13[e, :inter // 128])
        ex.w3.fp8 = (st.w13[e, inter:], st.s13[e, inter // 128:])
        ex.w2.fp8 = (st.w2[e], st.s2[e])
        assert old is None or old.data_ptr() == ex.w1.fp8[0].data_ptr(), "expert views do not match the stacks"
    rep["stacks"] += 1
    STATS["stacks"] += 1
    STATS["expert_elements"] += st.w13.numel() + st.w2.numel()
