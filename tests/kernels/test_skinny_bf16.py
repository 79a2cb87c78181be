"""The bf16-held dense linears' decode path: select.py's measured table (kernels/skinny_bf16_table.json) and
the Triton skinny kernel it routes to (triton_gemm.bf16_skinny_linear; its exact sums on the CPU are in
interpret_checks.check_bf16_skinny)."""

import json

import pytest
import torch

from deepinfer.kernels import select


def _table(tmp_path, monkeypatch, rows):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"measured": "test", "win_margin": 1.03, "rows": rows}))
    monkeypatch.setattr(select, "SKINNY_TABLE_PATH", str(path))
    select.reload_skinny_table()


@pytest.fixture(autouse=True)
def _fresh_table():
    select.reload_skinny_table()
    yield
    select.reload_skinny_table()


def test_table_buckets(tmp_path, monkeypatch):
    """A call takes the row of the smallest measured M at or above its own; none above the largest; a shape
    not in the table and a measured loss (cfg null) stay on cuBLAS."""
    a, b = {"BN": 64, "BK": 128, "NUM_STAGES": 3}, {"BN": 128, "BK": 64, "NUM_STAGES": 4}
    _table(tmp_path, monkeypatch, [dict(n=512, k=256, m=64, cfg=b), dict(n=512, k=256, m=16, cfg=a),
                                   dict(n=512, k=256, m=128, cfg=None)])
    assert select.skinny_cfg(1, 512, 256) == a and select.skinny_cfg(16, 512, 256) == a
    assert select.skinny_cfg(17, 512, 256) == b and select.skinny_cfg(64, 512, 256) == b
    assert select.skinny_cfg(65, 512, 256) is None and select.skinny_cfg(129, 512, 256) is None
    assert select.skinny_cfg(8, 256, 512) is None
    monkeypatch.setattr(select, "SKINNY_TABLE_PATH", "")
    select.reload_skinny_table()
    assert select.skinny_cfg(1, 512, 256) is None


def test_committed_table_is_valid():
    """The committed tables, one a GPU model: measured decode sizes only, tiles the kernel accepts, K a multiple
    of its tile."""
    with open(select.SKINNY_TABLE_PATH) as f:
        tables = json.load(f)["tables"]
    assert tables and len({t["device"] for t in tables}) == len(tables)
    for t in tables:
        assert t["rows"] and t["win_margin"] >= 1.0 and t["device"]
        for r in t["rows"]:
            assert r["m"] <= 128 and r["k"] % 32 == 0
            if r["cfg"] is not None:
                assert set(r["cfg"]) <= {"BN", "BK", "NUM_STAGES", "SPLIT_K", "BM", "num_warps"} and r["k"] % r["cfg"]["BK"] == 0
                assert r["cfg"]["BN"] in (64, 128) and r["cfg"]["BK"] in (32, 64, 128, 256)


def test_table_applies_on_its_gpu_model_only(tmp_path, monkeypatch):
    """Tiles measured on one GPU model (shared memory, SM count) are taken on that model only: each model of a
    several-table file gets its own rows, another model none (cuBLAS); a table without a device field is taken
    nowhere."""
    _table(tmp_path, monkeypatch, [dict(n=512, k=256, m=64, cfg={"BN": 64})])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H200")
    assert not select._skinny_device_table(0)
    a, b = {"BN": 64, "BK": 128, "NUM_STAGES": 3}, {"BN": 128, "BK": 64, "NUM_STAGES": 4}
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"tables": [
        {"device": "NVIDIA H200", "rows": [dict(n=512, k=256, m=64, cfg=a)]},
        {"device": "NVIDIA H100 80GB HBM3", "rows": [dict(n=512, k=256, m=64, cfg=b), dict(n=64, k=64, m=16, cfg=a)]}]}))
    monkeypatch.setattr(select, "SKINNY_TABLE_PATH", str(path))
    for name, want, shapes in (("NVIDIA H200", a, 1), ("NVIDIA H100 80GB HBM3", b, 2), ("NVIDIA L40S", None, 0)):
        select.reload_skinny_table()
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None, name=name: name)
        table = select._skinny_device_table(0)
        assert len(table) == shapes, name
        assert select.skinny_cfg(64, 512, 256, table) == want, name


def test_cpu_and_fp32_paths_fall_back():
    """Off CUDA the dense linear is torch's (the fixtures' bits), and so is linear_fp32."""
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    assert torch.equal(select.dense_linear(x, w), torch.nn.functional.linear(x, w))
    assert select._skinny(x, w) is None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 40, 64])
def test_skinny_on_gpu_matches_fp64(m, tmp_path, monkeypatch):
    """Every committed (N, K) small enough to test here, through select (the Triton kernel taken where the
    table says), bf16 and the head's fp32 output, against the float64 product; and inside a CUDA graph."""
    from deepinfer.kernels import triton_gemm
    calls = []
    real = triton_gemm.bf16_skinny_linear
    monkeypatch.setattr(triton_gemm, "bf16_skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator(device="cuda").manual_seed(m)
    table = select._skinny_device_table(torch.cuda.current_device())
    if not table:
        pytest.skip(f"no skinny table rows measured on {torch.cuda.get_device_name()}")
    for (n, k), rows in table.items():
        if n * k > 200_000_000 or select.skinny_cfg(m, n, k, table) is None:
            continue
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        exact = x.double() @ w.double().T
        tol = 2.0 ** -7 * exact.abs().max().item()
        before = len(calls)
        y = select.dense_linear(x, w)
        y32 = select.linear_fp32(x, w)
        assert len(calls) == before + 2, (n, k)
        assert y.dtype == torch.bfloat16 and (y.double() - exact).abs().max().item() <= tol, (n, k)
        # fp32 sums: within 2^-18 of each output's sum of |products| (bf16 rounding would be ~2^-9 of the value)
        mag = x.double().abs() @ w.double().abs().T
        assert y32.dtype == torch.float32 and ((y32.double() - exact).abs() <= 2.0 ** -18 * mag).all(), (n, k)
        out = torch.empty_like(y)
        graph = torch.cuda.CUDAGraph()
        select.dense_linear(x, w)
        with torch.cuda.graph(graph):
            out.copy_(select.dense_linear(x, w))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y), (n, k)
