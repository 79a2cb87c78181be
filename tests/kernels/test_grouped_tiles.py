"""The MoE's grouped tile map in one Triton launch (kernels/grouped_rows.grouped_tiles_triton) against its
torch form, under Triton's interpreter on the CPU (a subprocess: the interpreter is chosen at import) and
on the GPU: expert counts with empty experts, one expert, all empty, 48 and 384 experts, both tile heights
and both count dtypes."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def check(device) -> int:
    from deepinfer.kernels.grouped_rows import grouped_tiles, grouped_tiles_ref, grouped_tiles_triton
    g = torch.Generator().manual_seed(0)
    cases = [torch.tensor([3, 0, 140, 9, 0, 128]), torch.tensor([0]), torch.tensor([5]), torch.zeros(7, dtype=torch.int64)]
    for e in (2, 48, 160, 384):
        c = torch.randint(0, 300, (e,), generator=g)
        c[torch.randint(0, e, (e // 3,), generator=g)] = 0
        cases.append(c)
    for c in cases:
        for bm in (64, 128):
            for dtype in (torch.int32, torch.int64):
                cc = c.to(dtype).to(device)
                rows = int(cc.sum())
                got, t = grouped_tiles_triton(cc, bm, rows)
                want, tw = grouped_tiles_ref(cc.cpu(), bm, rows)
                assert t == tw and torch.equal(got.cpu(), want), (c.tolist()[:8], bm, dtype)
    if device != "cpu":                       # the dispatcher takes the kernel on CUDA
        c = cases[0].to(device)
        assert torch.equal(grouped_tiles(c, 64, int(c.sum()))[0], grouped_tiles_triton(c, 64, int(c.sum()))[0])
    return len(cases)


def test_grouped_tiles_kernel_under_interpreter():
    code = "import sys; sys.path.insert(0, %r); import test_grouped_tiles as t; print(t.check('cpu'))" % os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "8"


@pytest.mark.gpu
def test_grouped_tiles_kernel_on_gpu():
    assert check("cuda") == 8
