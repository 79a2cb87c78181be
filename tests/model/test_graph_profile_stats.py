"""perf/graph_profile.py's arithmetic on a replay's kernel intervals: busy time as the union of overlapping
intervals, idle time as the span's rest, exposed time per kernel name, replays split at their gaps."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))


def test_busy_idle_and_exposed_of_overlapping_kernels():
    from graph_profile import replay_stats
    # a: 0-10 alone, then b overlaps it 5-10 and runs on to 14; a gap 14-20; c 20-25
    st = replay_stats([(0.0, 10.0, "a"), (5.0, 14.0, "b"), (20.0, 25.0, "c")])
    assert st["span_us"] == pytest.approx(25) and st["busy_us"] == pytest.approx(19)
    assert st["idle_us"] == pytest.approx(6) and st["kernel_sum_us"] == pytest.approx(24)
    assert st["exposed"] == pytest.approx({"a": 5.0, "b": 4.0, "c": 5.0})
    assert sorted(st["by_name"]) == ["a", "b", "c"]


def test_nested_interval_is_never_exposed():
    from graph_profile import replay_stats
    st = replay_stats([(0.0, 10.0, "outer"), (2.0, 3.0, "inner"), (4.0, 6.0, "inner")])
    assert st["busy_us"] == pytest.approx(10) and st["idle_us"] == 0
    assert st["exposed"].get("inner", 0.0) == 0 and st["exposed"]["outer"] == pytest.approx(7)


def test_replays_split_at_the_largest_gaps():
    from graph_profile import split_replays
    one = [(0.0, 2.0, "x"), (3.0, 5.0, "y"), (5.5, 6.0, "z")]
    ks = [(s + off, e + off, n) for off in (0.0, 100.0, 200.0) for s, e, n in one]
    parts = split_replays(ks, 3)
    assert [len(p) for p in parts] == [3, 3, 3] and parts[1][0][0] == 100.0


def test_a_saved_replay_reported_by_part(tmp_path):
    """report() reads profile_graph(save=)'s JSON: each kernel's time and its exposed time summed by the step part
    its name belongs to, and a timeline PNG by stream."""
    import json

    from graph_profile import part_of, report
    assert part_of("fp8_moe_sm90_t32_rb1_x2") == "experts (masked MoE)"
    assert part_of("fp8_decode_sm90_t64_rb1_p2") == "dense FP8 decode GEMMs"
    assert part_of("rms_norm_quant_kernel") == "norms / RoPE"
    assert part_of("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "cuBLAS"
    assert part_of("void at::native::vectorized_gather_kernel<16, long>") == "torch ops"
    assert part_of("some_unknown_kernel") == "other"
    kernels = [[0, 10, "fp8_moe_sm90_t32", 7], [5, 12, "skinny_bf16_kernel", 9], [12, 20, "rms_norm_kernel", 7],
               [20, 24, "fp8_moe_sm90_t16", 7]]
    p = tmp_path / "replay.json"
    p.write_text(json.dumps({"label": "batch 64", "device": "test", "summary": {"span_us": 24, "idle_us": 0},
                             "kernels": kernels}))
    parts = report(str(p), str(tmp_path / "timeline.png"))
    assert parts["experts (masked MoE)"] == [14.0, 9.0, 2]       # 0-5 and 20-24 alone
    assert parts["W8A16 kernel (head, Engram)"] == [7.0, 2.0, 1]  # 10-12 alone
    assert parts["norms / RoPE"] == [8.0, 8.0, 1]
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_a_step_read_as_its_layers_chain():
    """layer_chain pairs each layer's two expert GEMMs into one run and measures the window before it."""
    from graph_profile import layer_chain
    ks = [(0.0, 10.0, "rms_norm"), (12.0, 20.0, "fp8_moe_sm90_t32"), (21.0, 30.0, "fp8_moe_sm90_t16"),
          (30.0, 45.0, "sparse_attn_kernel"), (50.0, 60.0, "fp8_moe_sm90_t32"), (61.0, 70.0, "fp8_moe_sm90_t16"),
          (70.0, 80.0, "head")]
    assert layer_chain(ks) == [(12.0, 18.0), (20.0, 20.0)]
    assert layer_chain([(0.0, 1.0, "rms_norm")]) == []


def test_a_window_listed_kernel_by_kernel():
    """window_kernels: the kernels between the previous expert run and this layer's, from the window's start, each
    with its time alone in the replay (a side-stream kernel under another is not alone)."""
    from graph_profile import window_kernels
    ks = [[0, 10, "fp8_moe_sm90_t32", 7], [11, 20, "fp8_moe_sm90_t16", 7], [20, 30, "rms_norm", 7],
          [22, 26, "index_scores", 9], [30, 45, "sparse_attn_kernel", 7], [46, 50, "fp8_moe_sm90_t32", 7],
          [51, 60, "fp8_moe_sm90_t16", 7]]
    rows = window_kernels(ks, 1)
    assert [r[4] for r in rows] == ["rms_norm", "index_scores", "sparse_attn_kernel"]
    assert rows[0][:4] == (0, 10, 6, 7) and rows[1][:4] == (2, 4, 0, 9) and rows[2][2] == 15
    assert window_kernels(ks, 2) == []
