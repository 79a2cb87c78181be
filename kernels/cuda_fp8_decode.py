"""The exact FP8 x FP8 GEMM at decode sizes on SM90 (kernels/cuda/fp8_decode_sm90.cu): the weight rows on
the wgmma's M side (128 or 256 a CTA), the tokens on its N side (tiles of 16 / 32 / 64 / 128), K split
across CTAs until the SMs are covered. The values of cuda_fp8_gemm.fp8_gemm_cuda (one FP8 MMA per 32-wide
K slice, promoted with the two power-of-two scales into fp32), read straight from the release's bytes:
e4m3 weights and their E8M0 scales per 32x32 block or per (row, 32).

    fp8_decode_linear(x, w, w_scale)            x [..., K] bf16 -> act_quant + the GEMM -> [..., N] bf16
    fp8_decode_gemm(a, sa_t, w, sb, ...)        a [M, K] e4m3, sa_t [K/32, m_ld] f32 (act_quant_fp8's
                                                transposed scales) -> [M, N] bf16
    plan(m, n, k, sms, rb=None) -> (entry, splits)   the form and K splits for a call (the wave model)
    measured_rows(n, k, device_name)            the table's rows of a weight shape (worker/loading.py picks
                                                the dense linears whose FP8 copies pay by them)
    table_row / table_choice(m, n, k, device_name, against)   the measured best form and split count
                                                (fp8_decode_table.json, written by the bench), and
                                                whether it beat the bf16-held / other FP8 paths (select's rule)
    form_for(m, n, k, device_name, sms)         a call's form: the table's row where measured at m's token
                                                tile, else plan's
    decline_reason(m, n, k, w, sb, device)      None where it takes the call, else the rule it breaks
    FORMS                                       entry -> (token tile, 64-row blocks a consumer, stages, CTAs a SM)
    fp8_masked_moe_gemm(a, sa_t, w, w_rows, masked_m, expected_m)   the MoE's masked layout (DeepGEMM's): a
                                                [G, C, K] e4m3 slab, a row-scaled e4m3 stack w [G, N, K] -> [G, C, N]
                                                bf16, rows past masked_m[g] unset; no host read (graph capturable)
    masked_decline_reason(w, w_rows, device)    None where the masked form takes the stack, else the rule
    masked_form(expected_m, n, k, device_name)  the masked call's form: this GPU model's measured best where
                                                moe_masked_table.json covers (N, K, expected_m), else masked_plan's

Split-K's sum order follows M (the token tile) and the split count: deterministic per shape, not
batch-invariant (select never sends batch-invariant mode here). DEEPINFER_CUDA_DECODE_RB=1 / 2 forces
the row blocks (the bench's comparison)."""

from __future__ import annotations

import functools
import os

import torch

from . import cuda_driver
from .measured_table import rows_by_shape
from .reference import e8m0_to_float

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "fp8_decode_sm90.cu")
BK = 128
CONSUMERS = 2
# entry -> (token tile BT, row blocks RB, stages, CTAs a SM); must match FP8_DECODE_ENTRY in the .cu
FORMS = {"fp8_decode_sm90_t16_rb2": (16, 2, 5, 1),
         "fp8_decode_sm90_t32_rb2": (32, 2, 5, 1),
         "fp8_decode_sm90_t64_rb2": (64, 2, 5, 1),
         "fp8_decode_sm90_t16_rb1": (16, 1, 8, 1),
         "fp8_decode_sm90_t32_rb1": (32, 1, 8, 1),
         "fp8_decode_sm90_t64_rb1": (64, 1, 8, 1),
         "fp8_decode_sm90_t128_rb1": (128, 1, 6, 1),
         # two CTAs a SM (4 stages, 104 registers a consumer thread): twice the loads in flight
         "fp8_decode_sm90_t16_rb1_x2": (16, 1, 4, 2),
         "fp8_decode_sm90_t32_rb1_x2": (32, 1, 4, 2),
         "fp8_decode_sm90_t64_rb1_x2": (64, 1, 4, 2)}
# the pipelined forms (_p: slice i's wgmmas in flight while slice i-1 is promoted, a wait 0 at each stage's
# end; _p2: turns of two stages, a wait 0 every 8 slices): same tiles, two temporaries a row block
PIPELINED = {"_p": ("t16_rb2", "t32_rb2", "t64_rb2", "t16_rb1", "t32_rb1", "t64_rb1", "t128_rb1", "t16_rb1_x2",
                    "t32_rb1_x2"),
             "_p2": ("t16_rb2", "t32_rb2", "t16_rb1", "t32_rb1", "t64_rb1", "t128_rb1", "t16_rb1_x2", "t32_rb1_x2")}
FORMS.update({f"fp8_decode_sm90_{base}{sfx}": FORMS[f"fp8_decode_sm90_{base}"]
              for sfx, bases in PIPELINED.items() for base in bases})
# the masked MoE forms (FP8_MOE_ENTRY): entry -> (token tile, row blocks, stages, CTAs a SM)
MOE_FORMS = {"fp8_moe_sm90_t16_rb1_x2": (16, 1, 4, 2),
             "fp8_moe_sm90_t32_rb1_x2": (32, 1, 4, 2),
             "fp8_moe_sm90_t16_rb2": (16, 2, 5, 1),
             "fp8_moe_sm90_t32_rb2": (32, 2, 5, 1),
             "fp8_moe_sm90_t64_rb1_x2": (64, 1, 4, 2),
             "fp8_moe_sm90_t64_rb2_p": (64, 2, 5, 1),
             "fp8_moe_sm90_t128_rb1_p": (128, 1, 6, 1)}
REDUCE = "fp8_splitk_reduce"
TOKEN_TILES = (16, 32, 64, 128)
# plan's forms at 33-64 / 65-128 tokens, from the H100 and H200 tables (2026-12-04 / 05): at 128 t128_rb1_p won
# all 12 (linear, GPU) rows; at 64 the pipelined one-row-block form or one within 2% of the winner where the
# 128-row tiles fit one wave, two row blocks a consumer where they do not (wq_b: 256 tiles, the rb2_p form
# 0.98-1.0x the best, the rb1 forms 0.81x); the wave model's split counts match the measured best on 5 of 6
PLAN_WIDE = {64: ("fp8_decode_sm90_t64_rb1_p2", "fp8_decode_sm90_t64_rb2_p"), 128: ("fp8_decode_sm90_t128_rb1_p",) * 2}
SPLIT_MAX = 16
FORCE_RB = int(os.environ.get("DEEPINFER_CUDA_DECODE_RB", "0") or 0)
E8M0 = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
# per GPU model and (N, K, measured M): the kernel's best form and split count and its time beside the bf16-held
# path's and select.fp8_linear's other FP8 paths' (perf/bench_fp8_decode.py --forms --write-table adds or
# replaces the table of the GPU it runs on); "" = no table
TABLE_PATH = os.environ.get("DEEPINFER_FP8_DECODE_TABLE", os.path.join(os.path.dirname(__file__), "fp8_decode_table.json"))
WIN_MARGIN = 1.03        # a path is replaced only where the kernel is at least this much faster
# programmatic dependent launch of act_quant -> GEMM -> split-K reduce: the GEMM streams its first stages'
# weights while act_quant ends, the reduce launches as the GEMM's CTAs reach their epilogue
# (DEEPINFER_FP8_DECODE_PDL=0: plain stream order; the bench times both)
PDL = os.environ.get("DEEPINFER_FP8_DECODE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _table(device_name: str) -> dict:
    """{(N, K): [row, ...] by ascending measured M} of the table measured on this GPU model ({} where none
    was); a form since renamed is not taken."""
    return rows_by_shape(TABLE_PATH, lambda r: r if r["entry"] in FORMS else None, device=device_name)[1]


def reload_table() -> None:
    """Read TABLE_PATH and MOE_TABLE_PATH again at the next call (tests and benchmarks swap tables)."""
    _table.cache_clear()
    _moe_table.cache_clear()


def measured_rows(n: int, k: int, device_name: str) -> list[dict]:
    """The table's rows of an [n, k] weight on this GPU model, by ascending M ([] where none were measured)."""
    return list(_table(device_name).get((n, k), ()))


def table_row(m: int, n: int, k: int, device_name: str) -> dict | None:
    """The table's row for [m, k] x [n, k]^T on this GPU model: the smallest measured M at or above m (None
    where none covers m or no table was measured on this GPU model)."""
    return next((r for r in _table(device_name).get((n, k), ()) if m <= r["m"]), None)


def table_choice(m: int, n: int, k: int, device_name: str, against: str = "bf16_held") -> tuple[str, int] | None:
    """(entry, splits) where the table's row (table_row) says the kernel beat `against` ("bf16_held": the
    bf16-held weight on select.dense_linear; "fp8_select": select.fp8_linear's other FP8 paths) by
    WIN_MARGIN; else None."""
    r = table_row(m, n, k, device_name)
    if r is None or r[f"{against}_us"] < WIN_MARGIN * r["decode_us"]:
        return None
    return r["entry"], r["splits"]


def form_for(m: int, n: int, k: int, device_name: str, sms: int) -> tuple[str, int]:
    """(entry, splits) of a call with no forced form: the table's row covering m (table_row) where it was
    measured at m's token tile, else plan's. A row of a wider tile (M = 64 covering 17..32 tokens where no
    M = 32 was measured) runs half-empty tiles: on an H100 (2026-12-06) plan's 32-token form beat the M = 64
    row's at 32 tokens on all six release shapes (w13 15.3 against 18.8 us; within 0-6% of the M = 32 rows
    measured since)."""
    row = table_row(m, n, k, device_name)
    if row is not None and token_tile(row["m"]) == token_tile(m):
        return row["entry"], row["splits"]
    return plan(m, n, k, sms)


def token_tile(m: int) -> int:
    """The smallest token tile holding m tokens (128 above: one tile of 128 per blockIdx.z)."""
    return next((t for t in TOKEN_TILES if m <= t), TOKEN_TILES[-1])


def entry_name(bt: int, rb: int) -> str:
    return f"fp8_decode_sm90_t{bt}_rb{rb}"


def plan(m: int, n: int, k: int, sms: int, rb: int | None = None) -> tuple[str, int]:
    """(entry, K splits) where no measured table covers the call: the token tile for m; up to 32 tokens the
    two-CTAs-a-SM form (one row block a consumer: H200, 2026-12-04, 1.0-1.5x the one-CTA forms at 1 / 16
    tokens, the kernel being latency-bound), pipelined in turns of two stages (its plain twin won none of
    the 24 rows at 1-32 tokens of the H100 / H200 tables, 2026-12-05 / 06), at 64 and 128 the pipelined
    forms of PLAN_WIDE (one row block a consumer, two where one-row-block tiles overflow a wave); rb forces
    the one-CTA form of that many row blocks.
    The split count of split_cost's least cost (counted in one-CTA waves: the measured best counts of those
    forms), each split at least two 128-K stages, none empty."""
    bt = token_tile(m)
    rb = rb or FORCE_RB
    name = entry_name(bt, 1) + "_x2_p2" if not rb and bt <= 32 else None
    if name not in FORMS and not rb and bt in PLAN_WIDE:
        name = PLAN_WIDE[bt][-(-n // 128) * -(-m // bt) > sms]
    if name not in FORMS:
        rb = rb or (2 if bt <= 64 else 1)
        name = entry_name(bt, rb) if entry_name(bt, rb) in FORMS else entry_name(bt, 1)
    tiles = -(-n // (64 * CONSUMERS * FORMS[name][1])) * -(-m // bt)
    return name, min(split_counts(k), key=lambda s: split_cost(s, tiles, m, k, sms))


def split_counts(k: int) -> list[int]:
    """The K split counts a call of K may take: each split at least two 128-K stages (up to SPLIT_MAX), none
    empty (a count whose last split would be empty is the count of its stage runs instead)."""
    nkb = -(-k // BK)
    return sorted({-(-nkb // -(-nkb // s)) for s in range(1, max(1, min(nkb // 2, SPLIT_MAX)) + 1)})


def split_cost(s: int, tiles: int, m: int, k: int, sms: int) -> float:
    """Time of s K splits in units of one whole-K CTA (one CTA per SM): waves of tiles x s CTAs, each 1 / s
    long, plus the fp32 partials each split writes and the sum reads back (4 bytes per output and split
    against K bytes of weight per output; from L2, counted at half weight)."""
    waves = -(-tiles * s // sms)
    return waves / s + (2.0 * m * s / k if s > 1 else 0.0)


def smem_bytes(name: str) -> int:
    """1024 bytes of alignment slack + the stages' weight and token tiles, their token and weight scales (4
    slices x BT, 4 slices x the CTA's rows f32) and 2 mbarriers a stage."""
    bt, rb, stages, _ = FORMS[name] if name in FORMS else MOE_FORMS[name]
    rows = 64 * CONSUMERS * rb
    return 1024 + stages * ((rows + bt) * BK + 16 * bt + 16 * rows + 16)


TAIL = 8       # kernel_scales' zero columns past the last row


def kernel_scales(sb: torch.Tensor) -> torch.Tensor:
    """The kernels' weight scales for sb [rows, K/32] or a stack [E, rows, K/32] (E8M0 bytes or f32; a stack's
    experts fold into the columns, each starting on a multiple of 4: e * round_up(rows, 4)): sbT [K/32, ld]
    f32 (their values transposed, zero padded to ld = rows + TAIL rounded up to 4: TMA's 16-byte row
    stride), computed once and kept on sb (recomputed where sb changed in place).
    Shared by this decode GEMM and cuda_fp8_gemm's scale-tile forms. Never computed inside a CUDA graph
    capture (select.fp8_decode_takes declines there; the eager warm-up fills it)."""
    cached = getattr(sb, "_decode_scales_t", None)
    if cached is not None and cached[0] == sb._version:
        return cached[1]
    if sb.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("cuda_fp8_decode.kernel_scales: not prepared before CUDA graph capture")
    ks = sb.shape[-1]
    vals = (sb if sb.dtype == torch.float32 else e8m0_to_float(sb)).float()
    if vals.dim() == 3:         # a stack: each expert's rows start on a 4-column boundary (TMA's 16-byte coordinates)
        e, r = vals.shape[:2]
        vals = torch.cat([vals, vals.new_zeros(e, -r % 4, ks)], dim=1)
    vals = vals.reshape(-1, ks)
    rows = vals.shape[0]
    # TAIL zero columns past the rows: a scale-tile box (cuda_fp8_gemm: 8 columns at BN 192) is never wider than
    # the map, which TMA's descriptors require, even for a weight of one or two 32-row blocks
    out = torch.zeros(ks, -(-(rows + TAIL) // 4) * 4, dtype=torch.float32, device=sb.device)
    out[:, :rows] = vals.T
    sb._decode_scales_t = (sb._version, out)
    return out


def scales_ready(sb: torch.Tensor) -> bool:
    """Whether kernel_scales(sb) is cached (a capture may use it)."""
    cached = getattr(sb, "_decode_scales_t", None)
    return cached is not None and cached[0] == sb._version


def scale_rows(n: int, k: int, sb: torch.Tensor) -> int | None:
    """Weight rows per scale row of sb for an [n, k] weight: 32 ([ceil(N/32), K/32]: 32x32 blocks), 1
    ([N, K/32]: per (row, 32)), else None."""
    if sb.dim() != 2 or k <= 0 or k % 32 or sb.shape[1] != k // 32:
        return None
    if sb.shape[0] == -(-n // 32) and (n == 1 or sb.shape[0] != n):
        return 32
    return 1 if sb.shape[0] == n else None


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decline_reason(m: int, n: int, k: int, w: torch.Tensor, sb: torch.Tensor, device=None) -> str | None:
    """None where the decode kernel takes an [m, k] x [n, k]^T call, else the rule it breaks: an SM90 GPU
    and nvcc, an e4m3 weight [N, K] with K a multiple of 32 (TMA's 16-byte rows), its E8M0 scale bytes per
    32x32 block or per (row, 32), 16-byte aligned."""
    if device is not None and (device.type != "cuda" or not _sm90(device.index if device.index is not None
                                                                  else torch.cuda.current_device())):
        return "an SM90 GPU (sm_90a wgmma and TMA)"
    if cuda_driver.find_nvcc() is None:
        return "nvcc to compile it (CUDA_HOME or PATH)"
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.stride(1) != 1 or w.stride(0) != k:
        return "a contiguous e4m3 weight [N, K]"
    if k <= 0 or k % 32:
        return "K a multiple of 32"
    if w.data_ptr() % 16:
        return "a 16-byte aligned weight (TMA)"
    if sb.dtype not in E8M0 or scale_rows(n, k, sb) is None or not sb.is_contiguous():
        return "E8M0 weight scales per 32x32 block [ceil(N/32), K/32] or per (row, 32) [N, K/32]"
    return None


def fp8_decode_gemm(a: torch.Tensor, sa_t: torch.Tensor, w: torch.Tensor, sb: torch.Tensor,
                    entry: str | None = None, splits: int | None = None) -> torch.Tensor:
    """a [M, K] e4m3, sa_t [K/32, m_ld] f32 (m_ld >= M a multiple of 4; TMA zero-fills past it), w [N, K]
    e4m3, sb E8M0 [ceil(N/32), K/32] / [N, K/32] -> [M, N] bf16. entry / splits override plan's."""
    m, k = a.shape
    n = w.shape[0]
    assert w.shape[1] == k and a.dtype == torch.float8_e4m3fn and a.is_cuda and a.device == w.device, (a.shape, w.shape)
    reason = decline_reason(m, n, k, w, sb)
    if reason is not None:
        raise ValueError(f"fp8_decode_gemm needs {reason}: a {tuple(a.shape)}, w {tuple(w.shape)}, sb {tuple(sb.shape)}")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    dev = a.device.index
    name, s = form_for(m, n, k, torch.cuda.get_device_name(dev), _num_sms(dev)) if entry is None else (entry, None)
    splits = splits or s or plan(m, n, k, _num_sms(dev))[1]
    bt, rb, _, _ = FORMS[name]
    m_ld = sa_t.shape[1]
    assert sa_t.shape[0] == k // 32 and m_ld >= m and m_ld % 4 == 0 and sa_t.dtype == torch.float32 \
        and sa_t.is_contiguous() and sa_t.data_ptr() % 16 == 0, (sa_t.shape, m, bt)
    a = a.contiguous()
    assert a.data_ptr() % 16 == 0, "TMA needs a 16-byte aligned activation"
    smem = smem_bytes(name)
    kern = cuda_driver.kernel(SRC, name, smem, dev)
    rows, per = 64 * CONSUMERS * rb, scale_rows(n, k, sb)
    tw = cuda_driver.tensor_map_2d(w, BK, rows)
    tx = cuda_driver.tensor_map_2d(a, BK, bt)
    tsa = cuda_driver.tensor_map_2d(sa_t, bt, 4, swizzle=0)      # [4 slices, BT tokens] a stage
    tsb = cuda_driver.tensor_map_2d(kernel_scales(sb), rows // per, 4, swizzle=0)   # [4 slices, the CTA's rows / per]
    grid = (-(-n // (64 * CONSUMERS * rb)), splits, -(-m // bt))
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=a.device) if splits > 1 else None
    kern.launch(grid, 128 * (CONSUMERS + 1), smem, [tw, tx, tsa, tsb, out, ws, m, n, k, per], pdl=PDL)
    if ws is None:
        return out
    from .cuda_fp8_gemm import splitk_reduce
    return splitk_reduce(SRC, ws, out, pdl=PDL)


def fp8_decode_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, entry: str | None = None,
                      splits: int | None = None) -> torch.Tensor:
    """x [..., K] bf16, w [N, K] e4m3, w_scale E8M0 -> [..., N] bf16: act_quant per 32 (pow2 scales,
    written transposed for the kernel) + fp8_decode_gemm (the release GEMM's values)."""
    from .triton_quant import act_quant_fp8
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    a, sa_t = act_quant_fp8(x2, scales_ld=-(-m // 4) * 4, pdl=PDL)
    return fp8_decode_gemm(a, sa_t, w, w_scale, entry, splits).view(*x.shape[:-1], w.shape[0])


def masked_plan(expected_m: int) -> str:
    """The masked form for about expected_m tokens an expert: a token tile that holds the busier experts
    too (a second tile streams the expert's weights again): expected_m + 4 sqrt(expected_m) rounded up to
    16 / 32 / 64 / 128; two CTAs a SM where the tile allows (the dense forms' measured rule at <= 32 tokens)."""
    busy = expected_m + 4.0 * max(expected_m, 0) ** 0.5
    bt = next((t for t in TOKEN_TILES if busy <= t), TOKEN_TILES[-1])
    return {16: "fp8_moe_sm90_t16_rb1_x2", 32: "fp8_moe_sm90_t32_rb1_x2", 64: "fp8_moe_sm90_t64_rb2_p",
            128: "fp8_moe_sm90_t128_rb1_p"}[bt]


# per GPU model, stack shape (N, K) and expected tokens an expert (m): the masked form measured fastest
# (perf/bench_moe_decode.py --forms all --write-table adds or replaces the table of the GPU it runs on); the
# forms were tuned on H100s, where masked_plan's rule is within 1.3% of the best (2026-12-07)
MOE_TABLE_PATH = os.environ.get("DEEPINFER_MOE_MASKED_TABLE",
                                os.path.join(os.path.dirname(__file__), "moe_masked_table.json"))


@functools.lru_cache(maxsize=None)
def _moe_table(device_name: str) -> dict:
    """{(N, K): [row, ...] by ascending expected m} of the masked table measured on this GPU model."""
    return rows_by_shape(MOE_TABLE_PATH, lambda r: r if r["entry"] in MOE_FORMS else None, device=device_name)[1]


def masked_form(expected_m: int, n: int, k: int, device_name: str) -> str:
    """The masked form for about expected_m tokens an expert of an [n, k] stack: the table's row at the smallest
    measured m at or above expected_m where that m is at most twice expected_m (rows are measured at powers of
    two: the row of the same load), else masked_plan's rule (another GPU model, shape or load)."""
    r = next((r for r in _moe_table(device_name).get((n, k), ()) if expected_m <= r["m"]), None)
    return r["entry"] if r is not None and 0 < expected_m and r["m"] <= 2 * expected_m else masked_plan(expected_m)


MASKED_SLAB_RULE = "slab rows per expert (C, the step's tokens) a multiple of 4"


def masked_decline_reason(w: torch.Tensor, w_rows: torch.Tensor | None, device=None) -> str | None:
    """None where fp8_masked_moe_gemm takes the stack w [G, N, K] e4m3 with its row scales w_rows [G, N, 1]
    f32 (ExpertStacks.r13 / r2: the row-scaled stacks), else the rule it breaks."""
    if device is not None and (device.type != "cuda" or not _sm90(device.index if device.index is not None
                                                                  else torch.cuda.current_device())):
        return "an SM90 GPU (sm_90a wgmma and TMA)"
    if cuda_driver.find_nvcc() is None:
        return "nvcc to compile it (CUDA_HOME or PATH)"
    if w.dim() != 3 or w.dtype != torch.float8_e4m3fn or not w.is_contiguous() or w.data_ptr() % 16:
        return "a contiguous 16-byte aligned e4m3 stack [G, N, K]"
    g, n, k = w.shape
    if k <= 0 or k % 32:
        return "K a multiple of 32"
    if w_rows is None or w_rows.dtype != torch.float32 or w_rows.numel() != g * n or not w_rows.is_contiguous():
        return "one f32 scale a row (ExpertStacks.to_row_scales)"
    return None


def fp8_masked_moe_gemm(a: torch.Tensor, sa_t: torch.Tensor, w: torch.Tensor, w_rows: torch.Tensor,
                        masked_m: torch.Tensor, expected_m: int, entry: str | None = None) -> torch.Tensor:
    """a [G, C, K] e4m3 (expert g's tokens in rows 0..masked_m[g]-1), sa_t [K/32, >= G C] f32 (the slab's
    scales transposed: column g C + t), w [G, N, K] e4m3 with one pow2 scale a row w_rows [G, N, 1] f32,
    masked_m [G] int32 on the device -> [G, C, N] bf16 (rows past masked_m[g] unset): the release GEMM's values
    (per 32-wide K slice one FP8 MMA times the token's scale, summed in fp32, times the row's scale). No host
    read (CUDA-graph capturable). expected_m: a host-side guess of the tokens an expert (the token tile; a busier
    expert takes more tiles). entry overrides masked_form's."""
    G, C, k = a.shape
    n = w.shape[1]
    assert w.shape[0] == G and w.shape[2] == k and a.dtype == torch.float8_e4m3fn and a.device == w.device, \
        (a.shape, w.shape)
    reason = masked_decline_reason(w, w_rows)
    if reason is not None:
        raise ValueError(f"fp8_masked_moe_gemm needs {reason}: w {tuple(w.shape)}")
    if C % 4:
        # H100, 2026-12-05: C = 5 with a busy expert 1 or 2 died with CUDA_ERROR_ILLEGAL_INSTRUCTION in every form
        # (C 4 / 8 / 16 / 40 passed): an expert's scale columns start at g C, 16-byte aligned only for C % 4 == 0
        raise ValueError(f"fp8_masked_moe_gemm needs {MASKED_SLAB_RULE}: C = {C}")
    assert masked_m.dtype == torch.int32 and masked_m.numel() == G and masked_m.is_contiguous()
    assert sa_t.shape[0] == k // 32 and sa_t.shape[1] >= G * C and sa_t.shape[1] % 4 == 0 \
        and sa_t.dtype == torch.float32 and sa_t.is_contiguous() and sa_t.data_ptr() % 16 == 0, (sa_t.shape, G, C)
    out = torch.empty(G, C, n, dtype=torch.bfloat16, device=a.device)
    if G == 0 or C == 0 or n == 0:
        return out
    name = entry or masked_form(expected_m, n, k, torch.cuda.get_device_name(a.device))
    bt, rb, _, _ = MOE_FORMS[name]
    a = a.contiguous()
    assert a.data_ptr() % 16 == 0, "TMA needs a 16-byte aligned activation slab"
    smem = smem_bytes(name)
    kern = cuda_driver.kernel(SRC, name, smem, a.device.index)
    tw = cuda_driver.tensor_map_2d(w.view(G * n, k), BK, 64 * CONSUMERS * rb)
    tx = cuda_driver.tensor_map_2d(a.view(G * C, k), BK, bt)
    tsa = cuda_driver.tensor_map_2d(sa_t, bt, 4, swizzle=0)
    grid = (-(-n // (64 * CONSUMERS * rb)), G, -(-C // bt))
    kern.launch(grid, 128 * (CONSUMERS + 1), smem, [tw, tx, tsa, out, masked_m, w_rows, C, n, k], pdl=PDL)
    return out
