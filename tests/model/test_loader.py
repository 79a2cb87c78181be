"""Bad input fails at load with one message naming the tensor or field; a good checkpoint loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.model.args import ConfigError
from deepinfer.model.loader import CheckpointError, load_model

SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def ckpt(fixture_dir, tmp_path):
    src = fixture_dir("v41-tiny-bf16")
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in ("config.json", "model.safetensors.index.json", "tokenizer.json", "model-00001-of-00002.safetensors", SHARD2):
        shutil.copy(src / f, dst / f)
    return dst


def _rewrite(path, fn):
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def test_missing_shard(ckpt):
    (ckpt / SHARD2).unlink()
    with pytest.raises(CheckpointError, match=f"shard {SHARD2} is missing"):
        load_model(ckpt, progress=False)


def test_wrong_shape(ckpt):
    _rewrite(ckpt / SHARD2, lambda t: t.__setitem__("mtp.0.attn.wq_a.weight", t["mtp.0.attn.wq_a.weight"][:-1].clone()))
    with pytest.raises(CheckpointError, match=r"'mtp.0.attn.wq_a.weight' has shape \[63, 32\], expected \[64, 32\]"):
        load_model(ckpt, progress=False)


def test_wrong_dtype(ckpt):
    _rewrite(ckpt / SHARD2, lambda t: t.__setitem__("mtp.0.attn.attn_sink", t["mtp.0.attn.attn_sink"].half()))
    with pytest.raises(CheckpointError, match=r"'mtp.0.attn.attn_sink' has dtype F16, expected F32"):
        load_model(ckpt, progress=False)


def test_missing_tensor(ckpt):
    _rewrite(ckpt / SHARD2, lambda t: t.pop("mtp.2.markov_head.head.weight"))
    with pytest.raises(CheckpointError, match="mtp.2.markov_head.head.weight"):
        load_model(ckpt, progress=False)


def test_other_model_family(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "deepseek_v4"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'model_type' is 'deepseek_v4'"):
        load_model(ckpt, progress=False)


def test_missing_config_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["text_config"]["hc_mult"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="text_config.hc_mult"):
        load_model(ckpt, progress=False)


def test_good_checkpoint_loads_every_buffer(ckpt):
    model = load_model(ckpt, progress=False)
    for name, buf in model.named_buffers():
        assert buf.device.type == "cpu", name
        if buf.is_floating_point():
            assert torch.isfinite(buf.float()).all(), name
