"""The CUDA FP8 x FP8 GEMM (kernels/cuda/fp8_gemm_sm90.cu, kernels/cuda_fp8_gemm.py).

CPU (CI): every form compiles for sm_90a with no spills and no serialized wgmma (ptxas -v), its SASS has
the FP8 GMMA of its width with one group left in flight during the promotion where it has two
temporaries (cuobjdump, where installed), the grouped tile table, the scale layouts, the split-K counts
and the decline rules. GPU (-m gpu, an SM90): cuda_fp8_checks.main (bit-exact on ternary data,
within the FP8 MMA bound on random data, graph capture, grouped contiguous, select's pick and declines)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.kernels import cuda_driver
from deepinfer.kernels.cuda_fp8_gemm import (CLUSTER, FORM_KIND, FORMS, REDUCE, SCALE_TILES, SRC, TS_TWIN,
                                             decline_reason, entry_takes, form, scale_kind, smem_bytes,
                                             splitk_count, wide_tile_pays)
from deepinfer.kernels.grouped_rows import grouped_tiles  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import sass_issue_model  # noqa: E402

needs_nvcc = pytest.mark.skipif(cuda_driver.find_nvcc() is None, reason="no nvcc")


def fresh_compile(tmp_path_factory, src: str):
    """A fresh compile of src (not the user's cache): yields (cubin path, ptxas log)."""
    saved = cuda_driver.CACHE_DIR
    cuda_driver.CACHE_DIR = str(tmp_path_factory.mktemp("cubin"))
    try:
        yield cuda_driver.compile_cubin(src, "sm_90a")
    finally:
        cuda_driver.CACHE_DIR = saved


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    yield from fresh_compile(tmp_path_factory, SRC)


def _functions(log: str) -> dict[str, str]:
    """ptxas -v's per-entry-function properties: name -> its lines."""
    out, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


@needs_nvcc
def test_compiles_without_spills_or_serialized_wgmma(compiled):
    cubin, log = compiled
    assert os.path.getsize(cubin) > 0
    funcs = _functions(log)
    assert set(FORMS) | {REDUCE} <= set(funcs), (sorted(funcs), log[-2000:])
    for name in (*FORMS, REDUCE):
        assert "0 bytes spill stores, 0 bytes spill loads" in funcs[name], (name, funcs[name])
    # C7514: ptxas serializes every wgmma of a kernel it cannot prove safe (the whole point lost)
    assert "C7514" not in log and "serialized" not in log, log
    assert "C7508" not in log, log              # setmaxnreg ignored: the consumers could not hold 3 x 64 floats
    assert all(smem_bytes(name) <= 227 * 1024 for name in FORMS)


def _cuobjdump() -> str | None:
    """cuobjdump next to nvcc, on PATH or in Triton's wheel (sass_issue_model.find_cuobjdump)."""
    return sass_issue_model.find_cuobjdump()


def sass_by_function(cubin: str) -> dict[str, str]:
    """cuobjdump -sass of a cubin: entry name -> its SASS (the test skips where cuobjdump / nvdisasm is missing)."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump next to nvcc or on PATH")
    r = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True)
    if r.returncode != 0 and "nvdisasm" in r.stderr:
        pytest.skip("cuobjdump without nvdisasm")
    assert r.returncode == 0, r.stderr
    return {chunk.split()[0]: chunk for chunk in r.stdout.split("Function : ")[1:]}


@needs_nvcc
def test_sass_has_fp8_gmma_overlapped(compiled):
    sass = sass_by_function(compiled[0])
    tool = _cuobjdump()
    pipe = _ts_pipes()
    for name in FORMS:
        code = sass[name]
        # FP8 wgmma (QGMMA: the e4m3 form of HGMMA) of the form's width, 4 slices per stage (the scale-tile
        # forms with turns of two stages: a two-stage turn's 8 and a one-stage tail turn's 4)
        turns = pipe.get(name, 1)
        slices = 4 * turns + (4 if turns == 2 else 0)
        assert code.count(f"QGMMA.64x{FORMS[name][1]}x32.F32.E4M3.E4M3") == slices, name
        assert "UTMALDG.2D" in code and "USETMAXREG" in code, name
        # the two-temporary forms keep one slice in flight during a promotion (all but each turn's last
        # wait); the one-temporary forms (debug, bn192, bm64 split-K, per-(row, 32)) wait on each
        overlapped = name in ("fp8_gemm_sm90_bn128", "fp8_gemm_sm90_bm64", "fp8_gemm_sm90_bn128_splitk",
                              "fp8_gemm_sm90_bn128_row", "fp8_gemm_sm90_bm64_row", "fp8_gemm_sm90_bn128_mc2") \
            or (name in SCALE_TILES and FORMS[name][1] == 128 and FORMS[name][0] <= 128)
        turn_count = 2 if turns == 2 else 1
        assert code.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == ((slices - turn_count) if overlapped else 0), name
        # the cluster forms: B multicast (UTMALDG's .MULTICAST form), the peer's empty barrier released
        # remotely, no multicast elsewhere
        assert ("MULTICAST" in code) == (CLUSTER[name] == 2), name
    # the cluster forms carry their (2, 1, 1) cluster in the cubin (what cuLaunchKernel launches by)
    r = subprocess.run([tool, "-elf", compiled[0]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = {}
    for chunk in re.split(r"^\.nv\.info\.", r.stdout, flags=re.M)[1:]:
        info[chunk.split()[0]] = chunk.split("\n.")[0]
    for name in FORMS:
        has = re.search(r"EIATTR_CTA_PER_CLUSTER\s+Format:\s+EIFMT_SVAL\s+Value:\s+0x2 0x1 0x1", info[name]) is not None
        assert has == (CLUSTER[name] == 2) and ("EIATTR_CTA_PER_CLUSTER" in info[name]) == has, name


def test_grouped_rows_build_one_map_per_tile_height(monkeypatch):
    """A layer's two projections share one GroupedRows: the map is built once per (bm, rows)."""
    from deepinfer.kernels import grouped_rows
    built = []
    real = grouped_rows.grouped_tiles
    monkeypatch.setattr(grouped_rows, "grouped_tiles", lambda *a: built.append(a[1:]) or real(*a))
    counts = torch.tensor([5, 0, 70, 1])
    with torch.inference_mode():
        rows = grouped_rows.GroupedRows(counts)
        first = rows.tiles(128, 76)
        assert rows.tiles(128, 76) is first and built == [(128, 76)]
        assert rows.tiles(64, 76)[1] == -(-76 // 64) + 4 and built == [(128, 76), (64, 76)]
    assert torch.equal(first[0], real(counts, 128, 76)[0])
    assert grouped_rows.counts_of(rows) is counts and grouped_rows.counts_of(counts) is counts


def test_grouped_tiles_split_at_experts():
    counts = torch.tensor([3, 0, 140, 9, 0, 128])
    with torch.inference_mode():          # as the engine calls it (a reuse keyed on tensor versions broke here)
        tiles, t = grouped_tiles(counts, 64, int(counts.sum()))
    want, start = [], 0
    for e, c in enumerate(counts.tolist()):
        for r in range(start, start + c, 64):
            want.append([r, start + c, e])
        start += c
    assert t == -(-int(counts.sum()) // 64) + len(counts) and t >= len(want)
    got = tiles.tolist()
    assert got[:len(want)] == want and all(row[2] == -1 for row in got[len(want):])


def test_decline_rules():
    if cuda_driver.find_nvcc() is None:
        assert decline_reason(64, 128, 256, torch.zeros(4, 8)) == "nvcc to compile it (CUDA_HOME or PATH)"
        return
    assert decline_reason(64, 128, 256, torch.zeros(4, 8)) is None
    assert decline_reason(64, 100, 256, torch.zeros(4, 8)) is None              # ceil(100 / 32) blocks
    assert decline_reason(64, 128, 240, torch.zeros(4, 7)) == "K a multiple of 32"
    assert decline_reason(64, 128, 256, torch.zeros(128, 8)) is None            # per-(row, 32) scales
    assert decline_reason(64, 128, 256, torch.zeros(128, 1)) is None            # one scale per row
    assert "32x32" in decline_reason(64, 128, 256, torch.zeros(64, 8))           # none of the layouts
    assert "f32 or E8M0" in decline_reason(64, 128, 256, torch.zeros(4, 8, dtype=torch.float16))
    if not torch.cuda.is_available():
        return
    if torch.cuda.get_device_capability() != (9, 0):
        assert decline_reason(64, 128, 256, torch.zeros(4, 8), torch.device("cuda")) is not None


@pytest.mark.gpu
def test_cuda_fp8_gemm_on_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    sys.path.insert(0, str(Path(__file__).parent))
    import cuda_fp8_checks
    assert cuda_fp8_checks.main() == 0


def test_select_cuda_mode_on_cpu():
    """DEEPINFER_PREFILL_GEMM=cuda is a valid mode; CPU tensors still take the reference (same bits)."""
    code = ("import torch\n"
            "from deepinfer.kernels import select\n"
            "from deepinfer.checkpoint.generator import quant_fp8\n"
            "assert select.PREFILL_GEMM == 'cuda'\n"
            "x = torch.randn(40, 256).bfloat16()\n"
            "q, s = quant_fp8(torch.randn(96, 256) * 0.06)\n"
            "assert not select._cuda_fp8_ok(x, q, s)\n"
            "assert select._fp8_variant_for(x, q, s) is None\n"
            "assert torch.equal(select.fp8_linear(x, q, s), select._ref_fp8_linear(x, select.dequant_fp8(q, s)))\n")
    env = dict(os.environ, DEEPINFER_PREFILL_GEMM="cuda")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def _ts_entries():
    """FP8_GEMM_TS_ENTRY(NAME, BN, STAGES, NCONS, PIPE, SBMODE, SPLITK) of the .cu."""
    return re.findall(r"^FP8_GEMM_TS_ENTRY\((\w+), (\d+), (\d+), (\d+), (\d), (SB_\w+), (true|false)\)",
                      Path(SRC).read_text(), re.M)


def _ts_pipes() -> dict[str, int]:
    return {name: int(pipe) for name, _, _, _, pipe, _, _ in _ts_entries()}


def test_forms_match_the_entry_points():
    """cuda_fp8_gemm.FORMS (the launch: BM, BN, stages, threads) and FORM_KIND (scale layout, split-K)
    against FP8_GEMM_ENTRY and FP8_GEMM_TS_ENTRY in the .cu; SCALE_TILES is the second macro's entries."""
    src = Path(SRC).read_text()
    entries = re.findall(r"^FP8_GEMM_ENTRY\((\w+), (\d+), (\d+), (\d+), (true|false), (SB_\w+), (true|false), (\d)\)",
                         src, re.M)
    ts = _ts_entries()
    got = {name: (64 * int(ncons), int(bn), int(stages), 128 * (int(ncons) + 1))
           for name, bn, stages, ncons, *_ in entries + ts}
    assert got == FORMS
    layout = {"SB_BLOCK": "block", "SB_ROW": "row", "SB_ROWK": "rowk"}
    assert {name: (layout[sb], sk == "true") for name, *_, sb, sk, _ in entries} | \
        {name: (layout[sb], sk == "true") for name, *_, sb, sk in ts} == FORM_KIND
    assert {name: int(cl) for name, *_, cl in entries} == {n: c for n, c in CLUSTER.items() if n not in SCALE_TILES}
    assert {name for name, *_ in ts} == SCALE_TILES
    # each twin keeps its plain form's tile, scale layout and split-K
    for plain, twin in TS_TWIN.items():
        assert twin in SCALE_TILES and plain not in SCALE_TILES
        assert FORMS[plain][:2] == FORMS[twin][:2] and FORM_KIND[plain] == FORM_KIND[twin], (plain, twin)


def test_scale_tile_twins_are_picked_only_where_k_allows(monkeypatch):
    """form(): a pick's scale-tile twin where asked (DEEPINFER_CUDA_FP8_TS, on by default) and K % 128 == 0, else the
    plain pick; a forced scale-tile entry gives way to the automatic choice where K does not allow it."""
    from deepinfer.kernels import cuda_fp8_gemm
    for m, n in ((8192, 4608), (48, 4608), (100, 1792), (2048, 32768)):
        for splitk in (False, True):
            plain = form(m, "block", splitk, n, 132, 5120, scale_tiles=False)
            assert form(m, "block", splitk, n, 132, 5120, scale_tiles=True) == TS_TWIN.get(plain, plain)
            assert form(m, "block", splitk, n, 132, 5248 - 96, scale_tiles=True) == plain   # K % 128 == 32
    assert form(8192, "row", k=2304, scale_tiles=True) == "fp8_gemm_sm90_bn128_row_ts"
    assert form(8192, "rowk", k=2304, scale_tiles=True) == "fp8_gemm_sm90_bn128_rowk"        # no twin
    for on in (True, False):            # unasked, the pick follows DEEPINFER_CUDA_FP8_TS
        monkeypatch.setattr(cuda_fp8_gemm, "TS_ON", on)
        assert form(8192, "block", False, 4608, 132, 5120) == form(8192, "block", False, 4608, 132, 5120, scale_tiles=on)
    monkeypatch.setattr(cuda_fp8_gemm, "FORCE", "fp8_gemm_sm90_bn128_ts1")
    assert form(8192, "block", k=5120) == "fp8_gemm_sm90_bn128_ts1"
    assert form(8192, "block", k=160) == "fp8_gemm_sm90_bn128"
    assert entry_takes("fp8_gemm_sm90_bn128_ts", 1280) and not entry_takes("fp8_gemm_sm90_bn128_ts", 1312)
    assert entry_takes("fp8_gemm_sm90_bn128", 1312)


@needs_nvcc
def test_scale_tile_forms_issue_half_the_instructions(compiled):
    """The static issue model (perf/sass_issue_model.py) of each scale-tile form's K loop against its plain
    twin: an SM90 sub-partition issues one instruction a cycle, so a stage's instructions a warp over its
    tensor cycles bound the fraction of the FP8 peak. The block-scale forms' global scale loads (~450 of
    ~700 instructions a stage) must stay gone: at most 0.65x the plain form's and an issue ceiling >= 0.7;
    the row-scale forms fewer than their twins' and >= 0.8."""
    if _cuobjdump() is None:
        pytest.skip("no cuobjdump")
    for plain, twin in TS_TWIN.items():
        p, t = sass_issue_model.loop_mix(compiled[0], plain), sass_issue_model.loop_mix(compiled[0], twin)
        assert p["found"] and t["found"], (plain, twin)
        assert t["ffma_per_stage"] == p["ffma_per_stage"] == FORMS[plain][1] * 2, (plain, t["ops"])  # promotion alone
        if FORM_KIND[plain][0] == "block":
            assert t["per_stage"] <= 0.65 * p["per_stage"] and t["ceiling"] >= 0.7, (twin, t["per_stage"], p["per_stage"])
        else:
            assert t["per_stage"] < p["per_stage"] and t["ceiling"] >= 0.8, (twin, t["per_stage"], p["per_stage"])
        assert "LDG" not in t["ops"], (twin, t["ops"])              # every scale from shared memory


def test_scale_kind():
    assert scale_kind(128, 256, torch.zeros(4, 8)) == "block"
    assert scale_kind(100, 256, torch.zeros(4, 8)) == "block"
    assert scale_kind(1, 256, torch.zeros(1, 8)) == "block"                      # N = 1: the same scales
    assert scale_kind(128, 256, torch.zeros(128, 8)) == "rowk"
    assert scale_kind(128, 256, torch.zeros(128, 1)) == "row"
    assert scale_kind(32, 32, torch.zeros(32, 1)) == "row"                       # K = 32: the same scales
    assert scale_kind(128, 256, torch.zeros(64, 8)) is None
    assert scale_kind(128, 256, torch.zeros(4, 8, 1)) is None
    assert scale_kind(128, 240, torch.zeros(4, 7)) is None


def test_splitk_count_covers_the_sms_without_empty_splits():
    for m, n, k, name in ((1, 5120, 8192, "fp8_gemm_sm90_bm64_splitk"), (64, 1792, 5120, "fp8_gemm_sm90_bm64_splitk"),
                          (128, 4096, 1280, "fp8_gemm_sm90_bn128_splitk"), (32, 576, 512, "fp8_gemm_sm90_bm64_splitk"),
                          (100, 32768, 1280, "fp8_gemm_sm90_bn128_splitk"), (17, 128, 160, "fp8_gemm_sm90_bm64_splitk")):
        bm, bn = FORMS[name][:2]
        tiles = -(-m // bm) * -(-n // bn)
        nkb = -(-k // 128)
        s = splitk_count(m, n, k, name, 132)
        assert 1 <= s <= 16 and (s == 1 or tiles * s <= 132), (m, n, k, s)
        per = -(-nkb // s)                                       # the kernel's run of stages per split
        assert (s - 1) * per < nkb, (m, n, k, s)                 # the last split has a stage
        assert s == 1 or per >= 2, (m, n, k, s)
    assert splitk_count(1, 5120, 8192, "fp8_gemm_sm90_bm64_splitk", 132) == 3   # 40 tiles: 3 x 40 <= 132
    assert splitk_count(1, 1792, 5120, "fp8_gemm_sm90_bm64_splitk", 132) == 8   # 14 tiles: 9 wanted, 5 stages each: 8


def _raster(pid: int, tiles_m: int, tiles_n: int, group_m: int = 8) -> tuple[int, int]:
    """gemm_body's launch order -> (M tile, N tile) (GROUP_M M tiles share each N tile)."""
    per_group = group_m * tiles_n
    first_m = pid // per_group * group_m
    rows = min(tiles_m - first_m, group_m)
    return first_m + pid % per_group % rows, pid % per_group // rows


def test_cluster_pairs_share_b_tiles():
    """The 2-CTA forms' premise: with the M tiles padded to even (fp8_gemm_cuda), launch pair (2c, 2c + 1)
    is two adjacent M tiles of one N tile, and the pairs cover every tile once."""
    src = Path(SRC).read_text()
    assert "const int pm = first_m + (pid % per_group) % group_rows, pn = (pid % per_group) / group_rows;" in src
    assert "GROUP_M = 8;" in src
    for m, n in ((1, 128), (200, 576), (8192, 1792), (8192 + 64, 5120), (300, 32768), (2048 + 128, 4608)):
        tiles_m, tiles_n = -(-m // 128), -(-n // 128)
        tiles_m += tiles_m % 2
        seen = set()
        for c in range(tiles_m * tiles_n // 2):
            (m0, n0), (m1, n1) = _raster(2 * c, tiles_m, tiles_n), _raster(2 * c + 1, tiles_m, tiles_n)
            assert n0 == n1 and m1 == m0 + 1 and m0 % 2 == 0, (m, n, c)
            seen |= {(m0, n0), (m1, n1)}
        assert seen == {(i, j) for i in range(tiles_m) for j in range(tiles_n)}


def test_launch_ex_structs_match_cuda_h():
    """cuLaunchKernelEx's structs as cuda.h lays them out on x86-64 (the cluster launch's fallback)."""
    import ctypes
    from deepinfer.kernels.cuda_driver import _LaunchAttribute, _LaunchConfig
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.sharedMemBytes.offset, _LaunchConfig.hStream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)


# (linear, M, N, BN 192 faster) measured on the H200, 2026-12-02 (perf/bench_fp8_prefill.py --cuda, 132 SMs)
MEASURED_WIDE = [("wqkv_a", 8192, 1792, False), ("wq_b", 8192, 32768, True), ("wo_b", 8192, 5120, False),
                 ("shared_w13", 8192, 4608, False), ("shared_w13", 2048, 4608, True), ("wo_b", 2048, 5120, False),
                 ("wqkv_a", 2048, 1792, False), ("index_wq_b", 2048, 4096, False), ("wo_b", 512, 5120, True),
                 ("shared_w13", 512, 4608, True), ("shared_w2", 512, 5120, True), ("wq_b", 512, 32768, False),
                 ("index_wq_b", 512, 4096, False), ("wqkv_a", 512, 1792, False), ("wo_b", 1024, 5120, False),
                 ("index_wq_b", 1024, 4096, False), ("wqkv_a", 1024, 1792, False), ("wo_b", 256, 5120, False)]


@pytest.mark.parametrize("name,m,n,wide", MEASURED_WIDE)
def test_wave_rule_picks_the_measured_faster_tile(name, m, n, wide):
    """form() takes BN 192 where it needs fewer waves of CTAs by more than its 1.5x longer tile."""
    assert wide_tile_pays(m, n, 132) == wide
    assert form(m, "block", False, n, 132) == ("fp8_gemm_sm90_bn192" if wide else "fp8_gemm_sm90_bn128")


def test_wave_rule_never_widens_small_or_split_or_other_layouts():
    assert form(64, "block", False, 5120, 132) == "fp8_gemm_sm90_bm64"          # one consumer warpgroup
    assert form(512, "block", True, 5120, 132) == "fp8_gemm_sm90_bn128_splitk"
    assert form(512, "row", False, 5120, 132) == "fp8_gemm_sm90_bn128_row"
    assert form(512, "block") == "fp8_gemm_sm90_bn128"                          # no shape given
    # one wave either way: the shorter tile
    assert not any(wide_tile_pays(m, n, 132) for m in (128, 256) for n in (128, 1024, 4096))


def test_precompile_only_where_the_kernel_can_run():
    """Model load starts nvcc only for a CUDA device that can run the kernel (SM90, nvcc); elsewhere
    nothing starts. On an SM90 GPU the thread leaves both cubins in the cache (a second compile is a hit)."""
    from deepinfer.kernels import select
    assert select.precompile_cuda_kernels("cpu") is None
    sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if not sm90 or cuda_driver.find_nvcc() is None:
        assert select.precompile_cuda_kernels("cuda") is None
        return
    thread = select.precompile_cuda_kernels("cuda")
    assert thread is not None
    thread.join()
    from deepinfer.kernels import cuda_fp8_decode
    for src in (SRC, cuda_fp8_decode.SRC):          # the decode GEMM's too (its table is on by default)
        cubin, _ = cuda_driver.compile_cubin(src)
        assert os.path.exists(cubin)


def test_tensor_maps_memoized_on_what_the_encode_reads(monkeypatch):
    """A TMA descriptor is built once per (address, dims, stride, box, swizzle): the same tensor again
    is a hit, another box or a view at another address is a new encode, and the memo stays bounded."""
    encoded = []
    monkeypatch.setattr(cuda_driver, "_encode_map_2d", lambda t, *a: encoded.append((t.data_ptr(), *a)) or object())
    monkeypatch.setattr(cuda_driver, "_MAPS", type(cuda_driver._MAPS)())
    monkeypatch.setattr(cuda_driver, "MAP_CACHE", 3)
    w = torch.zeros(64, 256, dtype=torch.uint8)
    first = cuda_driver.tensor_map_2d(w, 128, 64)
    assert cuda_driver.tensor_map_2d(w, 128, 64) is first and len(encoded) == 1
    assert cuda_driver.tensor_map_2d(w, 128, 32) is not first and len(encoded) == 2          # another box
    assert cuda_driver.tensor_map_2d(w[32:], 128, 64) is not first and len(encoded) == 3      # another address
    assert cuda_driver.tensor_map_2d(w, 128, 64, rows=128) is not first and len(encoded) == 4  # other dims
    assert len(cuda_driver._MAPS) == 3                                                          # bounded
    cuda_driver.tensor_map_2d(w, 128, 64)                                                       # evicted: again
    assert len(encoded) == 5
