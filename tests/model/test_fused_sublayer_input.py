"""block.FUSE_SUBLAYER_INPUT (Block.expand_into: a sublayer's hc_post, the next sublayer's collapse and norm as one op,
its mixes apart, across blocks where the model loop defers a block's output) changes no value: on the CPU the tiny
model's decode logits and DSpark taps are the three ops' bit for bit (the GPU's kernel:
tests/kernels/test_hc_post_norm.py, tests/model/test_side_stream_gpu.py)."""

import torch

from deepinfer.model import block
from deepinfer.model.loader import load_model


def test_fused_sublayer_input_same_logits_on_cpu(tiny_checkpoint, monkeypatch):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import bench_model_decode as bench
    from deepinfer.cache.model_caches import ModelCaches
    model = load_model(tiny_checkpoint, device="cpu", progress=False)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(block, "FUSE_SUBLAYER_INPUT", on)
        caches = ModelCaches.allocate(model.args, 4, 16, 64, "cpu", scratch=True)
        with torch.inference_mode():
            step = bench.decode_step(model, caches, 4, 40, 256, 64, device="cpu", full=True)
            outs[on] = [step() for _ in range(2)]
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a.logits, b.logits)
        assert a.main_hidden is not None and torch.equal(a.main_hidden, b.main_hidden)   # the DSpark taps
