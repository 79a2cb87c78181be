"""YOCO prefill truncation on CUDA (Triton kernels, in-place attention, CUDA graphs for the decode
steps, asynchronous scheduling): the decoder runs the last N rows, the compressed KV is exact mode's
bits, and a prompt no longer than N is bit-identical to exact mode.

    pytest -m gpu tests/engine/test_yoco_prefill_gpu.py -q -s
"""

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.yoco import decoder_start
from tests.engine.test_yoco_prefill import KEEP, RowCounter, first_prefill, prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def llm(ckpt, keep):
    return LLM(str(ckpt), device="cuda", max_num_seqs=4, max_num_batched_tokens=1024, block_tokens=8,
               num_cache_blocks=256, yoco_prefill_keep_tokens=keep)


def test_yoco_on_cuda(tiny_checkpoint):
    p = prompt(700, 1)
    exact, yoco = llm(tiny_checkpoint, 0), llm(tiny_checkpoint, KEEP)
    (re, pe, _), (ry, py, _) = first_prefill(exact, p), first_prefill(yoco, p)
    B = decoder_start(yoco.engine.model.args)
    assert all(r == [700] for r in ry[:B]) and all(r == [KEEP] for r in ry[B:])
    for k in pe:
        assert torch.equal(pe[k], py[k]), k
    fed = prompt(16, 9)
    sp = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    e = exact.generate(p, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    y = yoco.generate(p, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    print(f"\nYOCO on CUDA, 700-token prompt: max |diff| {np.abs(e - y).max():.3f}, "
          f"top-1 agreement {(e.argmax(-1) == y.argmax(-1)).mean():.2f}")
    assert np.isfinite(y).all() and np.abs(e - y).max() > 0
    short = prompt(KEEP, 3)
    es = exact.generate(short, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    ys = yoco.generate(short, sp, forced_token_ids=[fed], return_logits=True)[0].logits
    assert np.array_equal(es, ys)
