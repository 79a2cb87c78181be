"""deepinfer-make-checkpoint --preset tiny writes a release-format checkpoint that our loader
accepts, with the V4.1 tokenizer; its activations stay finite and greedy tokens vary."""

from __future__ import annotations

import json

import torch

from deepinfer.cli.make_checkpoint import main
from deepinfer.model.loader import checkpoint_index, load_model
from deepinfer.model.simple import SequenceRunner


def test_tiny_preset(tmp_path):
    out = tmp_path / "tiny"
    assert main(["--preset", "tiny", "--seed", "3", "--out", str(out)]) == 0
    infos = checkpoint_index(out)
    assert infos["layers.0.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert infos["layers.0.attn.wq_a.scale"].dtype == "F8_E8M0"
    assert infos["layers.0.ffn.experts.0.w1.weight"].dtype == "I8"
    assert infos["layers.1.engram.embed.scale"].dtype == "F8_E8M0"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41" and cfg["text_config"]["hidden_size"] == 32
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<｜System｜>") == 128799
    torch.set_num_threads(1)
    model = load_model(out, progress=False)
    r = SequenceRunner(model, 128)
    o = r.step(list(range(1000, 1040)))
    toks = []
    for _ in range(12):
        t = int(o.logits[-1].argmax())
        toks.append(t)
        o = r.step([t])
        assert torch.isfinite(o.logits).all()
    assert len(set(toks)) >= 6
