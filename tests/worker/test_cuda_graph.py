"""CudaGraphRunner: padding to the captured sizes (CPU, eager fallback) and graph replay equal to
eager on the GPU."""

import pytest
import torch

from deepinfer.worker.cuda_graph import CudaGraphRunner


def _step(x, idx):
    return (x * 2 + idx[:, None].float()).sum(-1), x.flip(0)


def test_padding_and_slicing_eager():
    r = CudaGraphRunner(_step, batch_sizes=(1, 4, 8), enabled=False)
    r.capture(lambda bs: (torch.zeros(bs, 3), torch.zeros(bs, dtype=torch.long)))
    assert [r.padded(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    x, idx = torch.randn(3, 3), torch.tensor([1, 2, 3])
    s, f = r(x, idx, pad_fill=(0.0, -1))
    assert s.shape == (3,) and torch.allclose(s, (x * 2 + idx[:, None]).sum(-1))
    assert torch.equal(r.static_in[4][1][3:], torch.tensor([-1]))
    assert f.shape == (3, 3)
    with pytest.raises(ValueError):
        r.padded(9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager():
    from deepinfer.kernels.triton_quant import act_quant
    from deepinfer.kernels.triton_sparse_attn import sparse_attn

    kv = torch.randn(4096, 512, device="cuda").bfloat16()
    sink = torch.randn(64, device="cuda")

    def step(q, idx):
        return act_quant(sparse_attn(q, kv, sink, idx, 512 ** -0.5))

    r = CudaGraphRunner(step, batch_sizes=(1, 8, 16))
    r.capture(lambda bs: (torch.zeros(bs, 64, 512, device="cuda", dtype=torch.bfloat16),
                          torch.full((bs, 640), -1, device="cuda", dtype=torch.int32)))
    for n in (1, 5, 16):
        q = torch.randn(n, 64, 512, device="cuda").bfloat16()
        idx = torch.randint(0, 4096, (n, 640), device="cuda", dtype=torch.int32)
        assert torch.equal(r(q, idx, pad_fill=(0, -1)), step(q, idx))
