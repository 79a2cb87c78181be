"""The FP8 x FP8 variant choice in kernels/select.py (no GPU, no Triton launch): the measured table's
semantics, its validation, and the variant names select knows against the kernels module's."""

import json

import pytest

from deepinfer.kernels import select


def _table(tmp_path, rows):
    p = tmp_path / "table.json"
    p.write_text(json.dumps({"measured": "H200, test", "rows": rows}))
    select.fp8_table.cache_clear()
    return str(p)


def test_variant_names_match_the_kernels():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton_fp8_variants import VARIANTS
    from test_fp8_prefill import VARIANT_NAMES
    assert set(select.FP8_VARIANTS) == set(VARIANTS) == set(VARIANT_NAMES)


def test_table_pick_takes_the_largest_measured_m_below(tmp_path):
    path = _table(tmp_path, [dict(n=5120, k=8192, m=8192, variant="lag_blocks"),
                             dict(n=5120, k=8192, m=64, variant="blocks_bm64"),
                             dict(n=5120, k=8192, m=128, variant=None),
                             dict(n=1792, k=5120, m=32, variant=None)])
    pick = lambda m, n, k: select.fp8_table_pick(m, n, k, path)  # noqa: E731
    assert pick(16, 5120, 8192) is None                 # below every measured M
    assert pick(64, 5120, 8192) == "blocks_bm64"
    assert pick(100, 5120, 8192) == "blocks_bm64"
    assert pick(128, 5120, 8192) is None                # W8A16 won at 128
    assert pick(4096, 5120, 8192) is None
    assert pick(8192, 5120, 8192) == "lag_blocks"
    assert pick(20000, 5120, 8192) == "lag_blocks"
    assert pick(8192, 1792, 5120) is None                # W8A16 won there
    assert pick(8192, 4096, 1280) is None                # shape not in the table


def test_missing_table_means_w8a16(tmp_path):
    select.fp8_table.cache_clear()
    assert select.fp8_table(str(tmp_path / "none.json")) == {}
    assert select.fp8_table_pick(8192, 5120, 8192, str(tmp_path / "none.json")) is None


def test_unknown_variant_in_table_is_an_error(tmp_path):
    path = _table(tmp_path, [dict(n=1, k=32, m=1, variant="warp_magic")])
    with pytest.raises(ValueError, match="warp_magic"):
        select.fp8_table(path)


def test_cpu_tensors_never_take_a_variant(tmp_path):
    import torch
    path = _table(tmp_path, [dict(n=64, k=128, m=1, variant="lag_blocks")])
    saved = select.PREFILL_GEMM, select.FP8_TABLE_PATH
    select.PREFILL_GEMM, select.FP8_TABLE_PATH = "auto", path
    try:
        x = torch.randn(8, 128).bfloat16()
        w = torch.zeros(64, 128).to(torch.float8_e4m3fn)
        s = torch.full((2, 4), 127, dtype=torch.uint8)
        assert select._fp8_variant_for(x, w, s) is None  # the reference path (no interpreter here)
    finally:
        select.PREFILL_GEMM, select.FP8_TABLE_PATH = saved


def test_table_split_k_rides_with_its_row(tmp_path):
    path = _table(tmp_path, [dict(n=5120, k=8192, m=64, variant="blocks_bm64", split_k=8),
                             dict(n=5120, k=8192, m=128, variant="lag_blocks"),
                             dict(n=5120, k=8192, m=8192, variant=None)])
    assert select.fp8_table_entry(64, 5120, 8192, path) == ("blocks_bm64", 8)
    assert select.fp8_table_entry(100, 5120, 8192, path) == ("blocks_bm64", 8)
    assert select.fp8_table_entry(128, 5120, 8192, path) == ("lag_blocks", None)   # the rule's count
    assert select.fp8_table_entry(9000, 5120, 8192, path) == (None, None)
    assert select.fp8_table_entry(32, 5120, 8192, path) == (None, None)


@pytest.mark.parametrize("split", [0, 65, 2.5, "8"])
def test_table_split_k_out_of_range_is_an_error(tmp_path, split):
    path = _table(tmp_path, [dict(n=64, k=128, m=32, variant="blocks", split_k=split)])
    with pytest.raises(ValueError, match="split_k"):
        select.fp8_table(path)

