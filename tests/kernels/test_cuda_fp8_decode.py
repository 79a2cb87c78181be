"""The CUDA FP8 x FP8 decode GEMM (kernels/cuda/fp8_decode_sm90.cu, kernels/cuda_fp8_decode.py).

CPU (CI): every form compiles for sm_90a with no spills and no serialized wgmma, its SASS has RB FP8 GMMAs
of its token width per K = 32 slice; the plan's token tiles and split counts (every split non-empty,
covering K); the decline rules. GPU (-m gpu, an SM90): cuda_fp8_decode_checks.main (every entry point
smoked in a child, bit-exact on ternary data with forced split counts, random data within the FP8 MMA
bound at the release shapes, graph capture)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from deepinfer.kernels import cuda_driver
from deepinfer.kernels.cuda_fp8_decode import (FORMS, MOE_FORMS, REDUCE, SRC, decline_reason, kernel_scales,
                                               masked_decline_reason, masked_plan, plan, scales_ready, smem_bytes,
                                               split_cost, token_tile)
from deepinfer.kernels.reference import e8m0_to_float

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cuda_fp8_gemm import _functions, fresh_compile, needs_nvcc, sass_by_function  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    yield from fresh_compile(tmp_path_factory, SRC)


@needs_nvcc
def test_compiles_without_spills_or_serialized_wgmma(compiled):
    cubin, log = compiled
    funcs = _functions(log)
    assert set(FORMS) | set(MOE_FORMS) | {REDUCE} <= set(funcs), sorted(funcs)
    for name in (*FORMS, *MOE_FORMS, REDUCE):
        assert "0 bytes spill stores, 0 bytes spill loads" in funcs[name], (name, funcs[name])
    assert "C7514" not in log and "C7515" not in log and "serialized" not in log, log
    assert "C7508" not in log, log
    # per CTA, and two CTAs of the x2 forms in one SM's 228 KB (1 KB of it reserved a CTA)
    forms = {**FORMS, **MOE_FORMS}
    assert all(forms[name][3] * (smem_bytes(name) + 1024) <= 228 * 1024 for name in forms)


@needs_nvcc
def test_sass_has_the_token_wide_fp8_gmma(compiled):
    sass = sass_by_function(compiled[0])
    for name, (bt, rb, _, _) in FORMS.items():
        code = sass[name]
        # RB row blocks x 4 slices a stage (the _p2 forms: a turn of two stages and the one-stage tail turn),
        # weights (A) and tokens (B) both from shared memory
        per_stage = 3 if name.endswith("_p2") else 1
        assert code.count(f"QGMMA.64x{bt}x32.F32.E4M3.E4M3") == 2 * 4 * rb * per_stage, name   # two bodies: block / row scales
        assert "UTMALDG.2D" in code and "USETMAXREG" in code, name
    for name, (bt, rb, _, _) in MOE_FORMS.items():
        code = sass[name]
        # one body (row scales in the epilogue): RB row blocks x 4 slices a stage
        assert code.count(f"QGMMA.64x{bt}x32.F32.E4M3.E4M3") == 4 * rb, name
        assert "UTMALDG.2D" in code and "USETMAXREG" in code, name


@pytest.mark.parametrize("expected_m,bt", [(1, 16), (2, 16), (8, 32), (16, 32), (17, 64), (30, 64), (40, 128),
                                           (500, 128)])
def test_masked_plan_tiles_hold_the_busier_experts(expected_m, bt):
    """The token tile covers expected_m + 4 sqrt(expected_m) (a second tile re-streams the expert's weights)."""
    name = masked_plan(expected_m)
    assert MOE_FORMS[name][0] == bt, name


def test_masked_decline_rules():
    w = torch.zeros(3, 64, 256, dtype=torch.float8_e4m3fn)
    rows = torch.ones(3, 64, 1)
    if cuda_driver.find_nvcc() is not None:
        assert masked_decline_reason(w, rows) is None
    assert masked_decline_reason(w, None) is not None                       # block-scaled stacks: W8A16
    assert masked_decline_reason(w, rows.double()) is not None
    assert masked_decline_reason(w[0], rows) is not None                    # not a stack
    assert masked_decline_reason(w[:, :, :200], rows) is not None           # not contiguous
    assert masked_decline_reason(w.bfloat16(), rows) is not None
    assert masked_decline_reason(torch.zeros(3, 64, 40, dtype=torch.float8_e4m3fn), rows) is not None   # K % 32
    assert masked_decline_reason(w, rows, device=torch.device("cpu")) is not None


@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 33, 64, 65, 128, 129, 300])
@pytest.mark.parametrize("n,k", [(1792, 5120), (32768, 1280), (5120, 8192), (4608, 5120), (5120, 2304),
                                 (4096, 1280), (200, 160), (32, 32), (7000, 96)])
def test_plan_covers_k_without_empty_splits(m, n, k):
    name, splits = plan(m, n, k, 132)
    bt, rb, _, _ = FORMS[name]
    assert bt == token_tile(m) and (bt >= m or bt == 128)
    nkb = -(-k // 128)
    per = -(-nkb // splits)
    assert 1 <= splits <= max(1, nkb // 2) and (splits - 1) * per < nkb      # the last split has stages
    tiles = -(-n // (128 * rb)) * -(-m // bt)
    for s in range(1, max(1, min(nkb // 2, 16)) + 1):                         # the least modelled cost
        if -(-nkb // -(-nkb // s)) == s:                                      # of the counts with no empty split
            assert split_cost(splits, tiles, m, k, 132) <= split_cost(s, tiles, m, k, 132) + 1e-9, (s, splits)


def test_plan_fills_the_sms_where_the_rows_do_not():
    # wo_b at 64 tokens: 40 CTAs of 128 rows, split 3 ways (120 CTAs on 132 SMs), the pipelined form
    assert plan(64, 5120, 8192, 132) == ("fp8_decode_sm90_t64_rb1_p2", 3)
    # wq_b: 128-row tiles would take two waves: 128 CTAs of 256 rows cover the SMs, no split
    assert plan(64, 32768, 1280, 132) == ("fp8_decode_sm90_t64_rb2_p", 1)
    assert plan(128, 5120, 8192, 132)[0] == "fp8_decode_sm90_t128_rb1_p"
    # the shared expert's w13 / the indexer's wq_b: the measured best split counts (H100 and H200 tables)
    assert plan(64, 4608, 5120, 132)[1] == plan(64, 4096, 1280, 132)[1] == 3
    assert plan(64, 1792, 5120, 132)[1] == 6
    # up to 32 tokens two CTAs a SM; a forced row-block count takes the one-CTA forms
    assert plan(16, 5120, 8192, 132)[0] == "fp8_decode_sm90_t16_rb1_x2_p2"
    assert plan(20, 5120, 8192, 132)[0] == "fp8_decode_sm90_t32_rb1_x2_p2"
    assert plan(16, 5120, 8192, 132, rb=2)[0] == "fp8_decode_sm90_t16_rb2"


def test_decline_rules():
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    blocks = torch.zeros(2, 8, dtype=torch.uint8)
    if cuda_driver.find_nvcc() is not None:
        assert decline_reason(16, 64, 256, w, blocks) is None
        assert decline_reason(16, 64, 256, w, torch.zeros(64, 8, dtype=torch.uint8)) is None      # per (row, 32)
    assert decline_reason(16, 64, 256, w, blocks.float()) is not None                            # f32 scales
    assert decline_reason(16, 64, 256, w, torch.zeros(64, 1, dtype=torch.uint8)) is not None     # per row
    assert decline_reason(16, 64, 256, w.bfloat16(), blocks) is not None
    assert decline_reason(16, 32, 256, w[:, ::2].contiguous()[:32], blocks[:1]) is not None      # K mismatch
    wt = torch.zeros(256, 64, dtype=torch.float8_e4m3fn).T                                       # not K-major
    assert decline_reason(16, 64, 256, wt, blocks) is not None
    assert decline_reason(16, 64, 256, w, blocks, device=torch.device("cpu")) is not None


def test_select_takes_it_only_where_opted_in(monkeypatch):
    """select.fp8_decode_takes: never on a CPU tensor, never with DEEPINFER_FP8_DECODE_MAX_M 0 (the default),
    never above the limit or in batch-invariant mode."""
    from deepinfer.kernels import select
    w = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 8, dtype=torch.uint8)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert select.FP8_DECODE_MAX_M == int(os.environ.get("DEEPINFER_FP8_DECODE_MAX_M", "0"))
    monkeypatch.setattr(select, "FP8_DECODE_MAX_M", 128)
    assert not select.fp8_decode_takes(x, w, s)                       # a CPU tensor
    if torch.cuda.is_available():
        xc, wc, sc = x.cuda(), w.cuda(), s.cuda()
        ok = torch.cuda.get_device_capability() == (9, 0) and cuda_driver.find_nvcc() is not None
        assert select.fp8_decode_takes(xc, wc, sc) == ok
        assert not select.fp8_decode_takes(torch.zeros(129, 256, dtype=torch.bfloat16, device="cuda"), wc, sc)
        monkeypatch.setattr(select, "FP8_DECODE_MAX_M", 0)
        assert not select.fp8_decode_takes(xc, wc, sc)


@pytest.mark.gpu
def test_cuda_fp8_decode_on_gpu():
    if torch.cuda.get_device_capability() != (9, 0) or cuda_driver.find_nvcc() is None:
        pytest.skip("needs an SM90 GPU and nvcc")
    from cuda_fp8_decode_checks import main
    assert main([]) == 0


@pytest.mark.parametrize("rows,ks", [(1, 1), (7, 3), (56, 40), (1024, 160)])
def test_kernel_scales_are_the_e8m0_values_transposed_and_cached(rows, ks):
    """sbT [K/32, rows rounded up to 4] f32: sb's values transposed, zero past its rows; kept on sb until sb
    changes in place."""
    sb = torch.randint(100, 140, (rows, ks), dtype=torch.uint8)
    assert not scales_ready(sb)
    t = kernel_scales(sb)
    ld = -(-(rows + 8) // 4) * 4
    assert t.shape == (ks, ld) and t.dtype == torch.float32 and t.is_contiguous()
    assert torch.equal(t[:, :rows], e8m0_to_float(sb).T) and not t[:, rows:].any()
    assert scales_ready(sb) and kernel_scales(sb) is t
    sb[0, 0] = 127                                   # in place: the cache is stale, recomputed
    assert not scales_ready(sb)
    t2 = kernel_scales(sb)
    assert t2 is not t and t2[0, 0].item() == 1.0


def test_kernel_scales_of_f32_and_stacked_scales():
    """f32 scales are taken as values (not E8M0 bytes), and a grouped stack [E, rows, K/32] folds its experts into
    the columns, each on a 4-column boundary (expert e's block b at column e * round_up(rows, 4) + b: TMA's
    innermost coordinates must be 16-byte aligned; cuda_fp8_gemm's scale-tile forms' grouped layout)."""
    f = torch.exp2(torch.randint(-9, 3, (5, 12)).float())
    assert torch.equal(kernel_scales(f)[:, :5], f.T)
    st = torch.randint(100, 140, (3, 5, 12), dtype=torch.uint8)
    t = kernel_scales(st)
    assert t.shape == (12, 32) and not t[:, 5:8].any() and not t[:, 21:].any()
    for e in range(3):
        assert torch.equal(t[:, 8 * e:8 * e + 5], e8m0_to_float(st[e]).T)
    assert kernel_scales(st) is t


def test_table_takes_the_measured_winner_at_the_covering_m(tmp_path, monkeypatch):
    """table_row: the smallest measured M at or above m, on the GPU model the table names only; table_choice:
    the form and splits where the kernel beat the path it would replace by WIN_MARGIN, else None; a form no
    longer built is not taken."""
    from deepinfer.kernels import cuda_fp8_decode as cfd
    rows = [dict(n=5120, k=8192, m=16, entry="fp8_decode_sm90_t16_rb1_x2_p2", splits=3, decode_us=19.0,
                 bf16_held_us=26.5, fp8_select_us=19.2),
            dict(n=5120, k=8192, m=64, entry="fp8_decode_sm90_t64_rb1_p2", splits=3, decode_us=26.0,
                 bf16_held_us=29.8, fp8_select_us=29.4),
            dict(n=5120, k=8192, m=128, entry="fp8_decode_sm90_t128_rb1_p2", splits=3, decode_us=40.0,
                 bf16_held_us=28.0, fp8_select_us=45.0),
            dict(n=4096, k=1280, m=16, entry="fp8_decode_sm90_gone", splits=1, decode_us=1.0,
                 bf16_held_us=9.0, fp8_select_us=9.0)]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "GPU A", "rows": rows}))
    monkeypatch.setattr(cfd, "TABLE_PATH", str(path))
    cfd.reload_table()
    try:
        assert cfd.table_row(1, 5120, 8192, "GPU A")["m"] == 16
        assert cfd.table_row(17, 5120, 8192, "GPU A")["m"] == 64
        assert cfd.table_row(129, 5120, 8192, "GPU A") is None            # past the largest measured M
        assert cfd.table_row(16, 5120, 8192, "GPU B") is None             # another GPU model's table
        assert cfd.table_choice(40, 5120, 8192, "GPU A") == ("fp8_decode_sm90_t64_rb1_p2", 3)
        assert cfd.table_choice(16, 5120, 8192, "GPU A") == ("fp8_decode_sm90_t16_rb1_x2_p2", 3)
        assert cfd.table_choice(16, 5120, 8192, "GPU A", against="fp8_select") is None   # 19.2 < 1.03 x 19.0
        assert cfd.table_choice(100, 5120, 8192, "GPU A") is None          # bf16-held won at 128
        assert cfd.table_choice(100, 5120, 8192, "GPU A", against="fp8_select") == ("fp8_decode_sm90_t128_rb1_p2", 3)
        assert cfd.table_row(1, 4096, 1280, "GPU A") is None               # a renamed form reads as unmeasured
        # the form a call runs: the row's where it was measured at the call's token tile, else plan's (17..32
        # tokens on the M = 64 row would run half-empty 64-token tiles)
        assert cfd.form_for(40, 5120, 8192, "GPU A", 132) == ("fp8_decode_sm90_t64_rb1_p2", 3)
        assert cfd.form_for(9, 5120, 8192, "GPU A", 132) == ("fp8_decode_sm90_t16_rb1_x2_p2", 3)
        assert cfd.form_for(20, 5120, 8192, "GPU A", 132) == cfd.plan(20, 5120, 8192, 132)
        assert cfd.FORMS[cfd.form_for(20, 5120, 8192, "GPU A", 132)[0]][0] == 32
        assert cfd.form_for(20, 5120, 8192, "GPU B", 132) == cfd.plan(20, 5120, 8192, 132)
    finally:
        monkeypatch.undo()
        cfd.reload_table()


def test_tables_of_several_gpu_models_live_in_one_file(tmp_path, monkeypatch):
    """merge_table adds a GPU model's table beside the others (a one-table file included) and replaces only its
    own, point by point (a run of one shape or one M keeps the rows of the others); table_row reads the table of
    the GPU it is asked about."""
    from deepinfer.kernels import cuda_fp8_decode as cfd
    from deepinfer.kernels.measured_table import merge_table

    def table(device, entry, us):
        return {"device": device, "rows": [dict(n=64, k=256, m=16, entry=entry, splits=1, decode_us=us,
                                                bf16_held_us=9.0, fp8_select_us=9.0)]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table("GPU A", "fp8_decode_sm90_t16_rb2", 5.0)))       # the one-table form
    merge_table(str(path), table("GPU B", "fp8_decode_sm90_t16_rb1_x2", 4.0))
    monkeypatch.setattr(cfd, "TABLE_PATH", str(path))
    cfd.reload_table()
    try:
        assert cfd.table_choice(8, 64, 256, "GPU A") == ("fp8_decode_sm90_t16_rb2", 1)
        assert cfd.table_choice(8, 64, 256, "GPU B") == ("fp8_decode_sm90_t16_rb1_x2", 1)
        assert cfd.table_row(8, 64, 256, "GPU C") is None
        merge_table(str(path), table("GPU A", "fp8_decode_sm90_t16_rb1", 20.0))           # re-measured: replaced
        cfd.reload_table()
        assert cfd.table_choice(8, 64, 256, "GPU A") is None                              # 9.0 < 1.03 x 20.0
        assert cfd.table_choice(8, 64, 256, "GPU B") == ("fp8_decode_sm90_t16_rb1_x2", 1)
        assert len(json.loads(path.read_text())["tables"]) == 2
        other = {"device": "GPU A", "rows": [dict(n=128, k=512, m=16, entry="fp8_decode_sm90_t16_rb2", splits=2,
                                                  decode_us=3.0, bf16_held_us=9.0, fp8_select_us=9.0)]}
        merge_table(str(path), other)              # another shape measured alone: added, the first shape's row kept
        merge_table(str(path), dict(other, rows=[dict(other["rows"][0], m=64, decode_us=30.0)]))   # another M
        cfd.reload_table()
        assert cfd.table_choice(8, 128, 512, "GPU A") == ("fp8_decode_sm90_t16_rb2", 2)
        assert cfd.table_row(8, 64, 256, "GPU A")["decode_us"] == 20.0
        rows_a = next(t for t in json.loads(path.read_text())["tables"] if t["device"] == "GPU A")["rows"]
        assert sorted((r["n"], r["m"]) for r in rows_a) == [(64, 16), (128, 16), (128, 64)]
        assert cfd.table_choice(8, 128, 512, "GPU A") == ("fp8_decode_sm90_t16_rb2", 2)   # M 16's row still there
    finally:
        monkeypatch.undo()
        cfd.reload_table()


@pytest.mark.parametrize("G,C,n,k", [(1, 1, 32, 32), (3, 17, 200, 160), (4, 5, 64, 1312)])
def test_masked_reference_is_the_float64_product_on_ternary_data(G, C, n, k):
    """reference.fp8_masked_moe_gemm_ref (what a CPU runs, and the masked CUDA form's reference): each expert's
    first masked_m rows are the float64 product's bits on ternary data, the rows past them zero."""
    from cuda_fp8_decode_checks import masked_equal, masked_operands, transposed_scales

    from deepinfer.kernels.reference import fp8_masked_moe_gemm_ref
    gen = torch.Generator().manual_seed(G * C)
    a, sa, w, rows_e, mm = masked_operands(G, C, n, k, gen, "cpu")
    y = fp8_masked_moe_gemm_ref(a, transposed_scales(sa), w, e8m0_to_float(rows_e).float(), mm)
    assert y.shape == (G, C, n) and y.dtype == torch.bfloat16
    assert not masked_equal(y, a, sa, w, rows_e, mm)
    for g, m in enumerate(mm.tolist()):
        assert not y[g, m:].any()


def test_masked_form_refuses_unaligned_slabs():
    """The CUDA masked form refuses slabs whose rows per expert are not a multiple of 4 (an expert's scale
    columns start at g C; C = 5 crashed every form with an illegal instruction on the H100, 2026-12-05) before
    touching a device, and select sends such steps to W8A16."""
    from cuda_fp8_decode_checks import masked_operands, transposed_scales

    from deepinfer.kernels import cuda_driver, cuda_fp8_decode
    if cuda_driver.find_nvcc() is None:
        pytest.skip("the rule is checked after the nvcc rule")
    a, sa, w, rows_e, mm = masked_operands(4, 5, 64, 128, torch.Generator().manual_seed(0), "cpu")
    with pytest.raises(ValueError, match="multiple of 4"):
        cuda_fp8_decode.fp8_masked_moe_gemm(a, transposed_scales(sa), w, e8m0_to_float(rows_e).float().contiguous(),
                                            mm, 5)


def test_masked_form_takes_the_measured_form_of_this_gpu_model(tmp_path, monkeypatch):
    """bench_moe_decode's --write-table rows (the fastest masked form per stack shape and expected tokens an
    expert) make masked_form's choice on the GPU model measured, at the covering point no more than twice the
    load; elsewhere (another model, shape, a load past the table or far below its row, a form since renamed)
    masked_plan's rule."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))
    from bench_moe_decode import table_rows

    from deepinfer.kernels import cuda_fp8_decode as cfd
    from deepinfer.kernels.measured_table import merge_table

    def bench_row(T, expected, fastest):
        us = {f: 100.0 for f in cfd.MOE_FORMS}
        us.update(w8a16=120.0, fp8=100.0)
        us[fastest] = 90.0
        return dict(n=4608, k=5120, T=T, expected_m=expected, us=us, plan=cfd.masked_plan(expected))

    rows = table_rows([bench_row(64, 8, "fp8_moe_sm90_t64_rb1_x2"), bench_row(128, 16, "fp8_moe_sm90_t32_rb2"),
                       bench_row(130, 17, "fp8_moe_sm90_t16_rb2")], cfd.MOE_FORMS)
    assert [(r["m"], r["entry"], r["us"], r["plan_us"]) for r in rows] == [
        (8, "fp8_moe_sm90_t64_rb1_x2", 90.0, 100.0), (16, "fp8_moe_sm90_t32_rb2", 90.0, 100.0),
        (17, "fp8_moe_sm90_t16_rb2", 90.0, 100.0)]
    rows[2]["entry"] = "fp8_moe_sm90_gone"
    path = str(tmp_path / "moe.json")
    merge_table(path, {"device": "GPU A", "rows": rows})
    monkeypatch.setattr(cfd, "MOE_TABLE_PATH", path)
    cfd.reload_table()
    try:
        assert cfd.masked_form(8, 4608, 5120, "GPU A") == "fp8_moe_sm90_t64_rb1_x2"
        assert cfd.masked_form(5, 4608, 5120, "GPU A") == "fp8_moe_sm90_t64_rb1_x2"     # 8 <= 2 x 5
        assert cfd.masked_form(12, 4608, 5120, "GPU A") == "fp8_moe_sm90_t32_rb2"
        assert cfd.masked_form(3, 4608, 5120, "GPU A") == cfd.masked_plan(3)            # 8 > 2 x 3
        assert cfd.masked_form(17, 4608, 5120, "GPU A") == cfd.masked_plan(17)          # a renamed form
        assert cfd.masked_form(40, 4608, 5120, "GPU A") == cfd.masked_plan(40)          # past the table
        assert cfd.masked_form(8, 4608, 5120, "GPU B") == cfd.masked_plan(8)
        assert cfd.masked_form(8, 5120, 2304, "GPU A") == cfd.masked_plan(8)
        assert cfd.masked_form(0, 4608, 5120, "GPU A") == cfd.masked_plan(0)
    finally:
        monkeypatch.undo()
        cfd.reload_table()
