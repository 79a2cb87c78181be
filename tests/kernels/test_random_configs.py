"""Random valid small configs (tests/kernels/random_configs.py): every one loads in the CUDA formats and
the fast path matches the torch references within the bf16 fixture's rule statistics, on whole
prefill, chunked prefill and decode. Plus the `wo_a` case of issue 15 (fewer than 32 rows per output
group) on a CPU, and two tiny configs through Triton's interpreter (CI)."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import random_configs as rc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("DEEPINFER_SHARED", REPO / ".." / "shared")).resolve()
GPU_SEEDS = list(range(100, 124))           # 24 configs


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_random_config_fast_path_on_cuda(seed, tmp_path, caplog):
    """24 configs, half with bf16 weights (judged by the bf16 fixture's rule), half in release dtypes
    (the release fixture's rule), every logits row of whole and chunked prefill and their decode steps.
    Declined shapes are logged once per (op, rule)."""
    caplog.set_level(logging.WARNING)
    defaults = rc.prefill_defaults()
    try:
        fails = rc.check_config(seed, tmp_path, "cuda", shared=SHARED)
    finally:
        rc.set_prefill_defaults(defaults)
        torch.cuda.empty_cache()
    from deepinfer.kernels import select
    print("declined fast paths so far:", sorted(select.declined()))
    assert not fails, fails


def _wo_a_case(tmp_path) -> Path:
    """4 groups of 16 rows (issue 15: `unflatten: Provided sizes [4, -1]` on CUDA)."""
    tc = rc.draw_config(3, tiny=True)
    tc.update(num_attention_heads=4, o_groups=4, o_lora_rank=16)
    return rc.write_checkpoint(tc, 3, tmp_path / "wo_a16")


def _logits(model, prompt):
    return rc.run_schedule(model, prompt, [len(prompt) - 20, 20], [5000, 7000])


def test_wo_a_small_groups_load_as_fp8_blocks_on_cpu(tmp_path):
    """The FP8 wo_a blocks with per-row scales give the dense bf16 form's logits bit for bit."""
    from deepinfer.model.loader import load_model
    ckpt = _wo_a_case(tmp_path)
    prompt = list(range(2000, 2090))
    fp8 = load_model(ckpt, progress=False, weight_format="fp8", wo_a_fp8=True)
    wo_a = fp8.layers[0].attn.wo_a
    assert wo_a.fp8_blocks is not None and wo_a.fp8_blocks[0].shape[:2] == (4, 16)
    assert wo_a.fp8_blocks[1].shape[:2] == (4, 16)            # one scale per row: a 32-row tile spans 2 groups
    dense = load_model(ckpt, progress=False, weight_format="fp8", wo_a_fp8=False)
    assert dense.layers[0].attn.wo_a.fp8_blocks is None
    assert torch.equal(_logits(fp8, prompt), _logits(dense, prompt))


@pytest.mark.gpu
def test_wo_a_small_groups_run_on_cuda(tmp_path):
    from deepinfer.model.loader import load_model
    ckpt = _wo_a_case(tmp_path)
    model = load_model(ckpt, device="cuda", progress=False)
    assert model.layers[0].attn.wo_a.fp8_blocks is not None
    rule = rc.fixture_rule("release", SHARED)
    s = rc.compare(model, list(range(2000, 2150)), [150], [5000, 7000], rule["top1_guard"])
    assert not s.judge(rule), s.line()


@pytest.mark.skipif(os.environ.get("DEEPINFER_SKIP_INTERPRET") == "1", reason="DEEPINFER_SKIP_INTERPRET=1")
def test_random_config_under_interpreter():
    """One tiny config (hc 1, rope_head_dim 24, 2 groups of 16 wo_a rows) through the fast paths on a
    CPU (Triton's interpreter): dispatch, shape rules and declines. About a minute."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("random_configs.py")), "1"], env=env,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_wo_a_unusual_shape_stays_dense_with_one_log_line(tmp_path, caplog):
    """Bad input of issue 15: a valid dtype, a shape the grouped FP8 GEMM cannot take (wo_a K = 16, not a
    multiple of 32: 1 head of 32 dims over 2 groups). The loader keeps wo_a dense, says so once for all
    layers, and the model runs (the same logits as with wo_a_fp8 off)."""
    from deepinfer.model import loader
    tc = rc.draw_config(3, tiny=True)
    tc.update(num_attention_heads=1, head_dim=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16)
    ckpt = rc.write_checkpoint(tc, 3, tmp_path / "wo_a_k16")
    loader._declined.clear()
    caplog.set_level(logging.WARNING, logger="deepinfer.model.loader")
    model = loader.load_model(ckpt, progress=False, weight_format="fp8", wo_a_fp8=True)
    assert all(layer.attn.wo_a.fp8_blocks is None for layer in model.layers)
    lines = [r.getMessage() for r in caplog.records if "wo_a FP8 blocks" in r.getMessage()]
    assert len(lines) == 1 and "K = 16" in lines[0], lines
    dense = loader.load_model(ckpt, progress=False, weight_format="fp8", wo_a_fp8=False)
    prompt = list(range(2000, 2080))
    assert torch.equal(_logits(model, prompt), _logits(dense, prompt))
