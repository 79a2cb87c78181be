"""The vision path on CUDA: the release-width tower in bf16 against the same weights on the CPU in
fp32 (the CPU suite's path, checked against the references in test_vision.py), and image requests
through the engine on CUDA (async scheduling, CUDA graphs for the decode steps after the image
prefill): the same tokens alone and batched under batch_invariant, and on the eager path."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.gpu


def png(w, h, seed):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def test_release_tower_cuda_bf16_vs_cpu_fp32(cuda):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    from vision_encode import build_tower
    from deepinfer.model.vision import VisionArgs, load_image
    v = VisionArgs()
    gpu, cpu = build_tower(v, 5120, "cuda"), build_tower(v, 5120, "cpu")
    imgs = [load_image(png(1024, 701, 0), v), load_image(png(300, 900, 1), v)]
    got = gpu.encode(imgs)
    want = cpu.encode(imgs)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        rel = (g.float().cpu() - w.float()).norm() / w.float().norm()
        assert rel < 0.03, rel                                    # bf16 weights and GEMMs over 32 layers


def test_engine_images_on_cuda(cuda, tiny_checkpoint):
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=8, temperature=0)
    a, b = png(200, 120, 3), png(90, 160, 4)
    prompt = [0, 100, 200, 129264, 300, 400]
    llm = LLM(str(tiny_checkpoint), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, batch_invariant=True)
    alone = llm.generate([prompt], sp, images=[[a]])[0].token_ids
    both = llm.generate([prompt, prompt, prompt], sp, images=[[a], [a], [b]])
    assert both[0].token_ids == both[1].token_ids == alone
    assert both[2].token_ids != alone
    fast = LLM(str(tiny_checkpoint), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)   # graphs, async
    outs = fast.generate([prompt] * 4 + [[0, 129264]], sp, images=[[a]] * 4 + [[b]])
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs)
    assert fast.engine.image_encoder.num_passes == 1 and fast.engine.image_encoder.num_encoded == 2
