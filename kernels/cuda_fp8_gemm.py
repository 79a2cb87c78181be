"""The exact FP8 x FP8 GEMM with per-32 promotion as a warp-specialized CUDA kernel for SM90
(kernels/cuda/fp8_gemm_sm90.cu: TMA producer warpgroup, two wgmma consumer warpgroups, the promotion of
slice s on the CUDA cores while the tensor cores run slice s+1). Same contract and values as
triton_gemm.fp8_gemm on 32x32-block, per-(row, 32) or per-row weight scales.

    fp8_gemm_cuda(a, sa, b, sb, out=None)          a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3,
                                                   sb [ceil(N/32), K/32] / [N, K/32] / [N, 1] f32 or
                                                   E8M0 -> [M, N] bf16
    fp8_grouped_contiguous_cuda(a, sa, b, sb, counts)   MoE prefill: rows sorted by expert, b [E, N, K]
    fp8_linear_cuda(x, w, w_scale)                 act_quant_fp8 + fp8_gemm_cuda (select.fp8_linear's form)
    supports(m, n, k, sb) / decline_reason(...)    the shape rules select checks before taking it
    scale_kind(n, k, sb)                           "block" / "rowk" / "row" / None: sb's layout
    splitk_count(m, n, k, name, sms)               K splits for decode sizes (1: none)

Entry points (FORMS; FORM_KIND gives each one's weight-scale layout and split-K):
  32x32 blocks: fp8_gemm_sm90_bn128 (two consumer warpgroups, BM 128: M > 64), fp8_gemm_sm90_bm64 (one
    consumer, BM 64: M <= 64), fp8_gemm_sm90_debug (one consumer waiting on every wgmma before its
    promotion: no overlap), fp8_gemm_sm90_bn192 (128 x 192 tiles, one temporary per consumer: the other
    consumer's wgmmas fill the tensor cores during a promotion; the bench decides, not the default),
    fp8_gemm_sm90_bn128_splitk / fp8_gemm_sm90_bm64_splitk (M <= 128 where the tiles leave SMs idle: K
    split over gridDim.y into an fp32 workspace, fp8_splitk_reduce sums it in split order),
    fp8_gemm_sm90_bn128_mc2 / fp8_gemm_sm90_bn192_mc2 (2-CTA clusters: two adjacent M tiles share one B
    tile, each CTA loading half and multicasting it: half the B traffic from L2; entry= / FORCE only)
  per-row [N, 1] (the MoE's row-scaled expert stacks): fp8_gemm_sm90_bn128_row, fp8_gemm_sm90_bm64_row
  per-(row, 32) [N, K/32] (wo_a's groups): fp8_gemm_sm90_bn128_rowk, fp8_gemm_sm90_bm64_rowk
  scale tiles (SCALE_TILES, `_ts`): the producer TMA-loads each stage's activation scales ([BM, 4] of sa) and
    block scales ([4, BN/32] of kernel_scales' transposed sbT) beside A and B, the consumers read them from
    shared memory, and the K loop runs in turns of two stages (slice i's wgmma under slice i-1's promotion
    across the stage boundary): ~350 instructions a stage a warp against ~700 (perf/sass_issue_model.py).
    K a multiple of 128; 32x32 blocks (bn128_ts, bn128_ts1: turns of one stage, bn192_ts, bm64_ts,
    bn128_ts_splitk, bm192_ts: three consumers with one temporary each) and per-row scales (bn128_row_ts,
    bm64_row_ts, bm192_row_ts). The automatic choice takes them (TS_TWIN; DEEPINFER_CUDA_FP8_TS=0: the plain forms).
DEEPINFER_CUDA_FP8_DEBUG=1 runs every 32x32-block call on the debugging form, DEEPINFER_CUDA_FP8_FORM=<entry>
every call whose scales have that entry's layout on that entry: a wrong result the debugging form fixes
is in the overlap, one bm64 fixes is in the two-consumer split, one they all keep is in the pipeline
(TMA, barriers, descriptors) or the promotion. DEEPINFER_CUDA_FP8_SPLITK=0 turns split-K off. Split-K's
count follows M (the tiles), so its fp32 sum order does too: deterministic per shape, not batch-invariant
(select never sends batch-invariant mode here).
"""

from __future__ import annotations

import functools
import os

import torch

from . import cuda_driver
from .grouped_rows import GroupedRows
from .reference import e8m0_to_float

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "fp8_gemm_sm90.cu")
BK = 128
# entry point -> (BM, BN, stages, threads); must match FP8_GEMM_ENTRY in the .cu
FORMS = {"fp8_gemm_sm90_bn128": (128, 128, 5, 384),
         "fp8_gemm_sm90_bm64": (64, 128, 6, 256),
         "fp8_gemm_sm90_debug": (64, 128, 4, 256),
         "fp8_gemm_sm90_bn192": (128, 192, 5, 384),
         "fp8_gemm_sm90_bn128_splitk": (128, 128, 5, 384),
         "fp8_gemm_sm90_bm64_splitk": (64, 128, 6, 256),
         "fp8_gemm_sm90_bn128_mc2": (128, 128, 5, 384),
         "fp8_gemm_sm90_bn192_mc2": (128, 192, 5, 384),
         "fp8_gemm_sm90_bn128_row": (128, 128, 5, 384),
         "fp8_gemm_sm90_bm64_row": (64, 128, 6, 256),
         "fp8_gemm_sm90_bn128_rowk": (128, 128, 5, 384),
         "fp8_gemm_sm90_bm64_rowk": (64, 128, 6, 256),
         # the scale-tile forms (FP8_GEMM_TS_ENTRY): each stage's scales TMA-loaded beside its tiles
         "fp8_gemm_sm90_bn128_ts": (128, 128, 5, 384),
         "fp8_gemm_sm90_bn128_ts1": (128, 128, 5, 384),
         "fp8_gemm_sm90_bn192_ts": (128, 192, 4, 384),
         "fp8_gemm_sm90_bm64_ts": (64, 128, 6, 256),
         "fp8_gemm_sm90_bn128_ts_splitk": (128, 128, 5, 384),
         "fp8_gemm_sm90_bn128_row_ts": (128, 128, 5, 384),
         "fp8_gemm_sm90_bm64_row_ts": (64, 128, 6, 256),
         "fp8_gemm_sm90_bm192_ts": (192, 128, 4, 512),        # three consumers, one temporary each
         "fp8_gemm_sm90_bm192_row_ts": (192, 128, 4, 512)}
# entry point -> (weight-scale layout, split-K); must match FP8_GEMM_ENTRY's SBMODE and SPLITK
FORM_KIND = {name: ("row" if "_row" in name and "_rowk" not in name else "rowk" if name.endswith("_rowk") else "block",
                    name.endswith("_splitk")) for name in FORMS}
# the scale-tile forms: K a multiple of 128 (TMA's 16-byte rows of sa [M, K/32]); their plain twins
SCALE_TILES = {name for name in FORMS if "_ts" in name}
TS_TWIN = {"fp8_gemm_sm90_bn128": "fp8_gemm_sm90_bn128_ts", "fp8_gemm_sm90_bn192": "fp8_gemm_sm90_bn192_ts",
           "fp8_gemm_sm90_bm64": "fp8_gemm_sm90_bm64_ts", "fp8_gemm_sm90_bn128_splitk": "fp8_gemm_sm90_bn128_ts_splitk",
           "fp8_gemm_sm90_bn128_row": "fp8_gemm_sm90_bn128_row_ts", "fp8_gemm_sm90_bm64_row": "fp8_gemm_sm90_bm64_row_ts"}
# DEEPINFER_CUDA_FP8_TS (default 1): the automatic choice takes a form's scale-tile twin where K allows (0: the
# plain forms). The twins give their plain forms' bits at 1.5-1.8x their speed (block scales; 1.1-1.3x row
# scales: the MoE's stacks), 16 of 16 release shapes (H100, 2026-12-05, late night); where this kernel runs by
# default (the MoE's mid-size steps) that is pure gain. Dense prefill linears stay on cuBLAS bf16 (0.64-0.92x).
TS_ON = os.environ.get("DEEPINFER_CUDA_FP8_TS", "1") == "1"
# entry point -> CTAs per cluster (FP8_GEMM_ENTRY's CLUSTER): 2 shares each B tile between the CTAs of two
# adjacent M tiles (TMA multicast, half each); the launch pads the M tiles to even and boxes B by BN / 2
CLUSTER = {name: 2 if name.endswith("_mc2") else 1 for name in FORMS}
REDUCE = "fp8_splitk_reduce"
DEBUG = os.environ.get("DEEPINFER_CUDA_FP8_DEBUG", "0") == "1"
FORCE = os.environ.get("DEEPINFER_CUDA_FP8_FORM") or None
if FORCE is not None and FORCE not in FORMS:
    raise ValueError(f"DEEPINFER_CUDA_FP8_FORM must be one of {sorted(FORMS)}, got {FORCE!r}")
SPLITK = os.environ.get("DEEPINFER_CUDA_FP8_SPLITK", "1") != "0"
SPLITK_MAX_M = 128      # decode sizes: above this the M tiles fill the SMs
SPLITK_MAX = 16


def scale_kind(n: int, k: int, sb: torch.Tensor) -> str | None:
    """The layout of weight scales sb for an [n, k] weight: "block" ([ceil(N/32), K/32], one per 32x32
    block), "rowk" ([N, K/32], one per row and 32 columns), "row" ([N, 1], one per row), else None. N = 1
    reads as "block" (the same scales)."""
    if sb.dim() != 2 or k <= 0 or k % 32:
        return None
    if sb.shape == (-(-n // 32), k // 32) and (n == 1 or sb.shape[0] != n):
        return "block"
    if sb.shape == (n, 1):
        return "row"
    if sb.shape == (n, k // 32):
        return "rowk"
    return None


def splitk_count(m: int, n: int, k: int, name: str, sms: int) -> int:
    """K splits for a split-K entry: enough CTAs to cover the SMs once (tiles x splits <= sms), each split
    at least 2 stages of K = 128, at most SPLITK_MAX; the count with no empty split."""
    bm, bn, _, _ = FORMS[name]
    tiles = -(-m // bm) * -(-n // bn)
    nkb = -(-k // BK)
    s = max(1, min(sms // max(tiles, 1), nkb // 2, SPLITK_MAX))
    return -(-nkb // -(-nkb // s))


def form(m: int | None = None, kind: str = "block", splitk: bool = False, n: int | None = None,
         sms: int | None = None, k: int | None = None, scale_tiles: bool | None = None) -> str:
    """The entry point for m rows with `kind` weight scales: one consumer warpgroup (BM 64) up to 64 rows
    (decode), two above; the split-K form where `splitk` (32x32 blocks); for blocks above 64 rows, BN 192
    where it takes fewer waves of CTAs (wide_tile_pays, given n and the SM count); FORCE's
    (DEEPINFER_CUDA_FP8_FORM) where its layout is `kind`, or the debugging form (DEEPINFER_CUDA_FP8_DEBUG=1)
    for blocks. scale_tiles (default TS_ON): the pick's scale-tile twin where it has one and k % 128 == 0."""
    if FORCE is not None and FORM_KIND[FORCE][0] == kind and (FORCE not in SCALE_TILES or (k or 1) % BK == 0):
        return FORCE
    name = _plain_form(m, kind, splitk, n, sms)
    twin = TS_TWIN.get(name)
    if twin is not None and (TS_ON if scale_tiles is None else scale_tiles) and k is not None and k % BK == 0:
        return twin
    return name


def entry_takes(entry: str, k: int) -> bool:
    """Whether forced entry point `entry` takes K = k (the scale-tile forms: multiples of 128)."""
    return entry not in SCALE_TILES or k % BK == 0


def _plain_form(m, kind, splitk, n, sms) -> str:
    small = m is not None and m <= 64
    if kind == "block":
        if DEBUG:
            return "fp8_gemm_sm90_debug"
        if splitk:
            return "fp8_gemm_sm90_bm64_splitk" if small else "fp8_gemm_sm90_bn128_splitk"
        if not small and m is not None and n is not None and sms and wide_tile_pays(m, n, sms):
            return "fp8_gemm_sm90_bn192"
        return "fp8_gemm_sm90_bm64" if small else "fp8_gemm_sm90_bn128"
    return f"fp8_gemm_sm90_{'bm64' if small else 'bn128'}_{kind}"


def wide_tile_pays(m: int, n: int, sms: int) -> bool:
    """The grid is one CTA per 128-row output tile, so a GEMM takes ceil(tiles / SMs) waves, each as long
    as one tile: BN 192 (a 1.5x longer tile) is faster where it needs fewer waves by more than that,
    cost ceil(t192 / sms) * 1.5 < ceil(t128 / sms). This predicted the faster of the two forms at 29 of
    the 30 (linear, M) points measured on the H200 (2026-12-02, perf/bench_fp8_prefill.py --cuda, M 256
    to 8192; the miss a 0.7% tie; e.g. wo_b at M 512: 160 tiles = 2 waves against 108 = 1, 308 vs 240
    TFLOP/s)."""
    tiles_m = -(-m // 128)
    waves128 = -(-(tiles_m * -(-n // 128)) // sms)
    waves192 = -(-(tiles_m * -(-n // 192)) // sms)
    return 3 * waves192 < 2 * waves128


def smem_bytes(name: str) -> int:
    """1024 bytes of alignment slack + the stages' A and B tiles (+ the scale-tile forms' scale tiles:
    ts_stage_scale_bytes in the .cu) + 2 mbarriers per stage."""
    bm, bn, stages, _ = FORMS[name]
    return 1024 + stages * ((bm + bn) * BK + stage_scale_bytes(name)) + 16 * stages


def sb_tile_cols(bn: int) -> int:
    """Columns of a stage's block-scale tile (the .cu's sb_tile_cols): BN/32 rounded up to 4 (16-byte rows)."""
    return -(-(bn // 32) // 4) * 4


def stage_scale_bytes(name: str) -> int:
    """A scale-tile form's scale bytes a stage: [BM, 4] activation scales, and for 32x32 blocks a [4, SBW]
    weight-scale tile padded to 128 bytes (0 for the other forms)."""
    if name not in SCALE_TILES:
        return 0
    bm, bn, _, _ = FORMS[name]
    sb = -(-(4 * sb_tile_cols(bn) * 4) // 128) * 128 if FORM_KIND[name][0] == "block" else 0
    return bm * 16 + sb


def _sm90(device) -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def decline_reason(m: int, n: int, k: int, sb: torch.Tensor, device=None) -> str | None:
    """None where the CUDA kernel takes an [m, k] x [n, k]^T call with weight scales sb, else the rule it
    breaks: an SM90 GPU and nvcc, K a multiple of 32 (which keeps TMA's rows 16-byte aligned), weight
    scales per 32x32 block, per (row, 32) or per row (scale_kind), f32 or E8M0."""
    if device is not None and not _sm90(device):
        return "an SM90 GPU (sm_90a wgmma and TMA)"
    if cuda_driver.find_nvcc() is None:
        return "nvcc to compile it (CUDA_HOME or PATH)"
    if k <= 0 or k % 32:
        return "K a multiple of 32"
    if scale_kind(n, k, sb) is None:
        return "weight scales per 32x32 block [ceil(N/32), K/32], per (row, 32) [N, K/32] or per row [N, 1]"
    if sb.dtype not in (torch.float32, torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        return "f32 or E8M0 weight scales"
    return None


def supports(m: int, n: int, k: int, sb: torch.Tensor, device=None) -> bool:
    return decline_reason(m, n, k, sb, device) is None


def _f32_scale(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> f32 powers of two (exact); f32 as is."""
    return (s if s.dtype == torch.float32 else e8m0_to_float(s)).contiguous()


def _kernel_scales(sb: torch.Tensor, kind: str, n: int, bn: int) -> tuple[torch.Tensor, int]:
    """(the scales as the kernel reads them, sb_ld) from sb [..., rows, cols]: blocks as f32; row scales
    flat [E * N]; per-(row, 32) scales transposed to [..., K/32, sb_ld] with sb_ld = N rounded up to BN,
    zero-padded (a float2 load per column pair, never out of bounds)."""
    s = _f32_scale(sb)
    if kind == "block":
        return s, 0
    if kind == "row":
        return s.reshape(-1).contiguous(), 0
    ld = -(-n // bn) * bn
    t = torch.zeros(*s.shape[:-2], s.shape[-1], ld, dtype=torch.float32, device=s.device)
    t[..., :n] = s.transpose(-1, -2)
    return t, ld


def _check_operands(a, sa, b, k):
    assert a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn, (a.dtype, b.dtype)
    assert a.is_cuda and a.device == b.device, (a.device, b.device)
    assert k % 32 == 0 and sa.shape == (a.shape[0], k // 32) and sa.dtype == torch.float32, (sa.shape, sa.dtype, k)
    for t in (a, b):                         # TMA: 16-byte aligned base and row stride
        assert t.data_ptr() % 16 == 0, "TMA needs 16-byte aligned operands"


def _splitk_wanted(m: int, n: int, k: int, device_index: int) -> bool:
    """Split-K for decode sizes where the output tiles alone leave at least half the SMs idle."""
    if not SPLITK or m > SPLITK_MAX_M:
        return False
    bm = 64 if m <= 64 else 128
    return 2 * -(-m // bm) * -(-n // 128) <= _num_sms(device_index) and -(-k // BK) >= 4


def fp8_gemm_cuda(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                  out: torch.Tensor | None = None, *, entry: str | None = None) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [ceil(N/32), K/32] / [N, K/32] / [N, 1] f32 or
    E8M0 -> [M, N] bf16: per output, the sum over K/32 slices of (fp32 slice sum of the e4m3 products) *
    sa * sb. entry: one of FORMS with sb's layout (the benchmark times them side by side), else form(M)."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k, (a.shape, b.shape)
    reason = decline_reason(m, n, k, sb)
    if reason is not None:
        raise ValueError(f"fp8_gemm_cuda needs {reason}: a {tuple(a.shape)}, b {tuple(b.shape)}, sb {tuple(sb.shape)}")
    kind = scale_kind(n, k, sb)
    if entry is not None and FORM_KIND[entry][0] != kind:
        raise ValueError(f"entry {entry} takes {FORM_KIND[entry][0]} weight scales, sb {tuple(sb.shape)} is {kind}")
    if entry is not None and not entry_takes(entry, k):
        raise ValueError(f"entry {entry} needs K a multiple of {BK}, got {k}")
    a, b = a.contiguous(), b.contiguous()
    sa = sa.contiguous()
    _check_operands(a, sa, b, k)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16 and out.is_contiguous(), (out.shape, out.dtype)
    assert out.data_ptr() % 4 == 0, "out must be 4-byte aligned (bf16 pair stores)"
    if m == 0 or n == 0:
        return out
    dev = a.device.index
    name = entry or form(m, kind, kind == "block" and _splitk_wanted(m, n, k, dev), n, _num_sms(dev), k,
                         None if _tiles_ready(sb, kind) else False)
    if name in SCALE_TILES:
        return _gemm_scale_tiles(name, a, sa, b, sb, out, kind)
    bm, bn, _, threads = FORMS[name]
    smem = smem_bytes(name)
    kern = cuda_driver.kernel(SRC, name, smem, dev)
    ta = cuda_driver.tensor_map_2d(a, BK, bm)
    cluster = CLUSTER[name]
    tb = cuda_driver.tensor_map_2d(b, BK, bn // cluster)
    tiles_m = -(-m // bm)
    tiles_m += -tiles_m % cluster            # whole clusters: a padding tile reads zeros, stores nothing
    grid = tiles_m * -(-n // bn)
    scales, sb_ld = _kernel_scales(sb, kind, n, bn)
    return _launch(kern, name, grid, threads, smem, [ta, tb, sa, scales, out, None, None, m, n, k, tiles_m, sb_ld],
                   6, out, k, cluster)


def _launch(kern, name: str, grid: int, threads: int, smem: int, args: list, ws_slot: int, out: torch.Tensor,
            k: int, cluster: int = 1) -> torch.Tensor:
    """Launch entry `name` with its arguments (args[ws_slot]: the workspace, None); a split-K form gets an
    fp32 workspace [splits, M, N] there and a second grid dimension, its partials summed into out by
    fp8_splitk_reduce."""
    if not FORM_KIND[name][1]:
        kern.launch(grid, threads, smem, args, cluster=cluster)
        return out
    m, n = out.shape
    splits = splitk_count(m, n, k, name, _num_sms(out.device.index))
    args = list(args)
    args[ws_slot] = torch.empty(splits, m, n, dtype=torch.float32, device=out.device)
    kern.launch((grid, splits), threads, smem, args)
    return splitk_reduce(SRC, args[ws_slot], out)


def _tiles_ready(sb: torch.Tensor, kind: str) -> bool:
    """Whether a scale-tile form may run now: outside a graph capture, or with sb's transposed scales made
    (kernel_scales is never computed inside a capture)."""
    from .cuda_fp8_decode import scales_ready
    return kind != "block" or not torch.cuda.is_current_stream_capturing() or scales_ready(sb)


def _scale_maps(name: str, sa: torch.Tensor, sb: torch.Tensor, kind: str):
    """(tmap_sa, tmap_sb, sb_row) of a scale-tile form: sa [M, K/32] boxed [BM rows, 4 slices]; for 32x32
    blocks kernel_scales' sbT [K/32, ld] boxed [4 slices, sb_tile_cols(BN)] (a grouped stack's scales
    [E, ceil(N/32), K/32] fold into its columns); for row scales [.., N, 1] the flat [E * N] row scales
    (the unused sb map: the sa map again)."""
    from .cuda_fp8_decode import kernel_scales
    bm, bn, _, _ = FORMS[name]
    assert sa.data_ptr() % 16 == 0 and sa.shape[1] % 4 == 0, "TMA: 16-byte aligned scale rows"
    tsa = cuda_driver.tensor_map_2d(sa, 4, bm, swizzle=0)
    if kind == "block":
        return tsa, cuda_driver.tensor_map_2d(kernel_scales(sb), sb_tile_cols(bn), 4, swizzle=0), None
    return tsa, tsa, _f32_scale(sb).reshape(-1).contiguous()


def _gemm_scale_tiles(name: str, a, sa, b, sb, out, kind, tiles=None, tiles_m=None) -> torch.Tensor:
    """Launch a scale-tile form (dense, or grouped with the host's tile map `tiles`); split-K forms sum their
    fp32 partials with fp8_splitk_reduce."""
    m, k = a.shape
    n = out.shape[1]
    bm, bn, _, threads = FORMS[name]
    smem = smem_bytes(name)
    kern = cuda_driver.kernel(SRC, name, smem, a.device.index)
    ta = cuda_driver.tensor_map_2d(a, BK, bm)
    tb = cuda_driver.tensor_map_2d(b, BK, bn)
    tsa, tsb, sb_row = _scale_maps(name, sa, sb, kind)
    if tiles_m is None:
        tiles_m = -(-m // bm)
    grid = tiles_m * -(-n // bn)
    return _launch(kern, name, grid, threads, smem, [ta, tb, tsa, tsb, sb_row, out, tiles, None, m, n, k, tiles_m],
                   7, out, k)


def splitk_reduce(src: str, ws: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """out (bf16, M x N) = the fp32 partials ws [splits, M, N] summed in split order, by src's copy of
    fp8_splitk_reduce (sm90_common.cuh: every CUDA source that splits K carries one). pdl: launched
    programmatically behind the GEMM (it waits for the GEMM's end before reading ws)."""
    dev = out.device.index
    total = out.numel()
    red = cuda_driver.kernel(src, REDUCE, 0, dev)
    per_thread = 4 if total % 4 == 0 else 1                 # the kernel's vector form (same sums)
    red.launch(min(-(-total // (256 * per_thread)), 8 * _num_sms(dev)), 256, 0, [ws, out, ws.shape[0], total], pdl=pdl)
    return out


def fp8_grouped_contiguous_cuda(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                                counts: "torch.Tensor | GroupedRows") -> torch.Tensor:
    """a [P, K] e4m3 with rows sorted by expert (counts[e] rows of expert e, in order), sa [P, K/32] f32,
    b [E, N, K] e4m3, sb [E, ceil(N/32), K/32] / [E, N, K/32] / [E, N, 1] f32 or E8M0 -> [P, N] bf16 (each
    row against its expert). counts as GroupedRows: its tile map is built once for every GEMM given it."""
    rows = counts if isinstance(counts, GroupedRows) else GroupedRows(counts)
    counts = rows.counts
    p, k = a.shape
    E, n, _ = b.shape
    assert b.shape[2] == k and counts.shape == (E,), (a.shape, b.shape, counts.shape)
    reason = decline_reason(p, n, k, sb[0] if sb.dim() == 3 else sb)
    if reason is not None or sb.dim() != 3 or sb.shape[0] != E:
        raise ValueError(f"fp8_grouped_contiguous_cuda needs {reason or 'sb [E, rows, cols]'}")
    kind = scale_kind(n, k, sb[0])
    a, b2 = a.contiguous(), b.contiguous().view(E * n, k)
    sa = sa.contiguous()
    _check_operands(a, sa, b2, k)
    out = torch.empty(p, n, dtype=torch.bfloat16, device=a.device)
    if p == 0 or n == 0:
        return out
    # a forced split-K or cluster form: its plain twin (grouped tiles have neither: each tile its expert)
    name = form(None, kind, k=k, scale_tiles=None if _tiles_ready(sb, kind) else False)
    name = name.replace("_ts1", "_ts").replace("_ts_splitk", "_ts").replace("_splitk", "").replace("_mc2", "")
    bm, bn, _, threads = FORMS[name]
    smem = smem_bytes(name)
    tiles, t = rows.tiles(bm, p)
    if name in SCALE_TILES:
        return _gemm_scale_tiles(name, a, sa, b2, sb, out, kind, tiles, t)
    kern = cuda_driver.kernel(SRC, name, smem, a.device.index)
    ta = cuda_driver.tensor_map_2d(a, BK, bm)
    tb = cuda_driver.tensor_map_2d(b2, BK, bn)
    scales, sb_ld = _kernel_scales(sb, kind, n, bn)
    kern.launch(t * -(-n // bn), threads, smem, [ta, tb, sa, scales, out, tiles, None, p, n, k, t, sb_ld])
    return out


def fp8_linear_cuda(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] e4m3, w_scale [ceil(N/32), K/32] / [N, K/32] / [N, 1] -> [..., N] bf16:
    act_quant per 32 (pow2 scales) + fp8_gemm_cuda (triton_fp8_prefill.fp8_prefill_linear's values)."""
    from .triton_quant import act_quant_fp8
    a, sa = act_quant_fp8(x.reshape(-1, x.shape[-1]))
    return fp8_gemm_cuda(a, sa, w, w_scale).view(*x.shape[:-1], w.shape[0])
