"""deepinfer.parallel.planner and deepinfer-plan: the real release config on 4 and 8 H200s (141 GB),
the shared tiny fixture config, and bad inputs. CPU only, no weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer.cli.plan import parse_size, read_model_args
from deepinfer.model.args import ModelArgs
from deepinfer.parallel.planner import (DEFAULT_RESERVE_BYTES, GiB, PARTS, InsufficientMemoryError, check_fits,
                                        model_bytes, plan_memory, release_config_dir)
from tests.conftest import FIXTURES, REPO

H200 = 141 * 10**9
TINY = FIXTURES / "v41-tiny"
need_tiny = pytest.mark.skipif(not (TINY / "config.json").is_file(), reason=f"{TINY} not found")
PER_EXPERT_FP8 = 3 * 2304 * 5120 * 33 // 32        # e4m3 + one E8M0 byte per 32 along K


@pytest.fixture(scope="module")
def release() -> ModelArgs:
    return ModelArgs.from_checkpoint(release_config_dir())


def plan(args, num_gpus, engram="sharded", **kw):
    return plan_memory(args, num_gpus=num_gpus, gpu_memory_bytes=kw.pop("gpu_memory_bytes", H200),
                       engram_placement=engram, **kw)


# ---- the shipped config ----------------------------------------------------------------------------
def test_release_config_is_the_v41_release(release):
    cfg = json.loads((release_config_dir() / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"] and cfg["vision_config"]["num_hidden_layers"] == 32
    assert cfg["quantization_config"]["expert_dtype"] == "fp4"
    assert (release.dim, release.n_layers, release.n_total_layers, release.n_routed_experts) == (5120, 40, 43, 384)
    assert release.engram_num_embeddings == (384006168, 384016682)
    assert (release.dspark_n_routed_experts, release.dtype, release.expert_dtype) == (128, "fp8", "fp4")


def test_checkpoint_bytes_match_the_release(release):
    # MODEL.md: 475.3 GiB incl. the vision tower (~1 GiB), which the text loader does not expect
    mb = model_bytes(release)
    assert mb.checkpoint_bytes / GiB == pytest.approx(475.3, rel=0.01)
    assert mb.routed_expert_bytes == PER_EXPERT_FP8
    assert mb.engram_bytes == (384006168 + 384016682) * (256 + 8)


# ---- byte totals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_gpus", [4, 8])
@pytest.mark.parametrize("engram", ["sharded", "host", "device"])
def test_byte_totals_are_consistent(release, num_gpus, engram):
    p = plan(release, num_gpus, engram)
    mb = model_bytes(release)
    assert len(p.rank_weights) == num_gpus and p.num_local_experts == 384 // num_gpus
    assert sum(w.routed_experts for w in p.rank_weights) == 40 * 384 * PER_EXPERT_FP8
    for part in ("attention", "shared_experts", "dspark", "embed_head", "other"):
        assert {getattr(w, part) for w in p.rank_weights} == {mb.replicated[part]}
    engram_gpu = sum(w.engram for w in p.rank_weights)
    assert engram_gpu == {"sharded": mb.engram_bytes, "host": 0, "device": num_gpus * mb.engram_bytes}[engram]
    assert p.host_bytes == (mb.engram_bytes if engram == "host" else 0)
    assert p.weights.total == max(w.total for w in p.rank_weights)
    assert p.weights.total == sum(getattr(p.weights, part) for part in PARTS)


def test_redundant_experts_add_slots(release):
    p = plan(release, 8, num_redundant_experts=16)
    assert p.num_local_experts == 50
    assert sum(w.routed_experts for w in p.rank_weights) == 40 * (384 + 16) * PER_EXPERT_FP8


# ---- verdicts --------------------------------------------------------------------------------------
def test_8_h200_fit_with_sharded_or_host_engram(release):
    sharded, host = plan(release, 8, "sharded"), plan(release, 8, "host")
    assert sharded.fits and host.fits
    assert host.max_cache_tokens > sharded.max_cache_tokens >= 65536
    assert sharded.num_seqs_at_max_len >= 1 and check_fits(sharded) is sharded
    assert "fits" in sharded.message()


def test_4_h200_do_not_fit_and_say_what_would(release):
    p = plan(release, 4, "sharded")
    assert not p.fits and p.free_cache_bytes < 0
    assert "needs 8 GPUs" in p.problem and "engram_placement='host' on 6 GPUs" in p.problem
    with pytest.raises(InsufficientMemoryError, match="short"):
        check_fits(p)
    assert not plan(release, 4, "host").fits


@pytest.mark.parametrize("num_gpus", [4, 8])
def test_device_engram_does_not_fit(release, num_gpus):
    p = plan(release, num_gpus, "device")
    assert not p.fits
    assert p.weights.engram > H200                     # one replicated copy alone is larger than a GPU
    if num_gpus == 8:
        assert "engram_placement='sharded'" in p.problem and "engram_placement='host'" in p.problem


def test_cache_too_small_for_max_model_len(release):
    p = plan(release, 8, "sharded", max_model_len=1 << 24)
    assert not p.fits and p.free_cache_bytes > 0
    assert "max_model_len=16777216" in p.problem and f"max_model_len={p.max_cache_tokens}" in p.problem


def test_reserve_is_taken_off(release):
    a, b = plan(release, 8), plan(release, 8, reserve_bytes=DEFAULT_RESERVE_BYTES + GiB)
    assert a.free_cache_bytes - b.free_cache_bytes == GiB


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"num_gpus": 0}, "num_gpus must be >= 1, got 0"),
    ({"num_gpus": 5}, r"384 expert slots per layer do not split evenly over num_gpus=5: use num_redundant_experts=1"),
    ({"num_gpus": 8, "num_redundant_experts": 4}, r"\(4\) = 388 .* num_gpus=8: use num_redundant_experts=8"),
    ({"num_gpus": 8, "num_redundant_experts": -1}, "num_redundant_experts must be >= 0, got -1"),
    ({"num_gpus": 8, "engram": "disk"}, "engram_placement must be one of"),
    ({"num_gpus": 8, "block_tokens": 3}, "block_tokens=3 is not a multiple of layer 2's compress ratio 2"),
    ({"num_gpus": 8, "gpu_memory_bytes": 0}, "gpu_memory_bytes must be >= 1, got 0"),
    ({"num_gpus": 8, "cache_dtype": "int4"}, "dtype must be one of"),
])
def test_bad_input_names_the_number(release, kw, match):
    with pytest.raises(ValueError, match=match):
        plan(release, kw.pop("num_gpus"), kw.pop("engram", "sharded"), **kw)


@pytest.mark.parametrize("text, n", [("141GB", 141 * 10**9), ("141GiB", 141 << 30), ("80G", 80 * 10**9),
                                     ("80Gi", 80 << 30), ("1.5TB", 15 * 10**11), ("512MiB", 512 << 20),
                                     ("1024", 1024)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_rejects_units():
    with pytest.raises(ValueError, match="'80X'"):
        parse_size("80X")


# ---- the tiny shared fixture config ----------------------------------------------------------------
@need_tiny
def test_tiny_fixture_config_plans():
    args = read_model_args(TINY / "config.json")
    per_expert = model_bytes(args).routed_expert_bytes
    for engram in ("device", "sharded", "host"):
        p = plan(args, 4, engram, gpu_memory_bytes=1 << 30, reserve_bytes=100 << 20)
        assert p.fits and p.num_local_experts == 2
        assert sum(w.routed_experts for w in p.rank_weights) == args.n_layers * 8 * per_expert
    assert p.table().endswith("fits")


# ---- the CLI ---------------------------------------------------------------------------------------
def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "deepinfer.cli.plan", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_cli_fits_exits_0():
    r = run_cli("--gpus", "8", "--gpu-memory", "141GB", "--engram", "host")
    assert r.returncode == 0, r.stderr
    assert "engram_placement='host'" in r.stdout and "routed experts (48 of 384 x 40 layers)" in r.stdout
    assert r.stdout.rstrip().endswith("fits")


def test_cli_does_not_fit_exits_1():
    r = run_cli("--gpus", "4", "--gpu-memory", "141GB", "--engram", "sharded", "--expert-format", "fp8")
    assert r.returncode == 1, r.stderr
    assert "DOES NOT FIT" in r.stdout and "needs 8 GPUs" in r.stdout
    # the engine's default (expert_format="auto") holds the release's experts as FP4 there: 6 GPUs would do
    r = run_cli("--gpus", "4", "--gpu-memory", "141GB", "--engram", "sharded")
    assert r.returncode == 1 and "held as FP4" in r.stdout and "needs 6 GPUs" in r.stdout, r.stdout


def test_cli_bad_input_exits_2(tmp_path):
    r = run_cli("--gpus", "5")
    assert r.returncode == 2 and "num_gpus=5" in r.stderr
    r = run_cli("--gpu-memory", "lots")
    assert r.returncode == 2 and "'lots'" in r.stderr
    r = run_cli("--config", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "nope.json" in r.stderr


@need_tiny
def test_cli_reads_a_folder_and_the_tiny_config():
    r = run_cli("--config", str(TINY), "--gpus", "2", "--gpu-memory", "1GiB", "--reserve", "100MiB")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "routed experts (4 of 8 x 10 layers)" in r.stdout


def test_fp4_experts_hold_the_release_bytes_and_free_kv(release):
    """expert_format="fp4" (EngineArgs' CUDA default): each routed expert as stored (MXFP4 + one E8M0 byte
    per 32 along K: 17/33 of the FP8 stacks' bytes), the rest unchanged; on 8 H200s the KV cache grows by
    what the experts give back."""
    fp8, fp4 = model_bytes(release), model_bytes(release, "fp4")
    assert fp8.routed_expert_bytes == PER_EXPERT_FP8
    assert fp4.routed_expert_bytes == 3 * 2304 * 5120 * 17 // 32
    # the DSpark blocks' experts (replicated on every rank) are held as stored too; nothing else moves
    assert all(fp4.replicated[p] <= fp8.replicated[p] for p in PARTS) and fp4.checkpoint_bytes == fp8.checkpoint_bytes
    assert sum(fp4.replicated[p] != fp8.replicated[p] for p in PARTS) == 1
    p8, p4 = plan(release, 8), plan(release, 8, expert_format="fp4")
    assert p8.fits and p4.fits
    freed = p8.weights.total - p4.weights.total
    assert freed > (PER_EXPERT_FP8 - fp4.routed_expert_bytes) * 48 * fp8.num_moe_layers
    assert p4.max_cache_tokens > 4 * p8.max_cache_tokens
