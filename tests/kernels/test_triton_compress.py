"""kernels/triton_compress.py: the ratio > 1 compressor's member rows gathered in one kernel equal
reference.compress_members_ref bit for bit (members from the step's rows, from the carry ring, mixed within
a group; several ring slots; ratio 2 and 4; a row width that is not a power of two), and its carry ring's
writes equal reference.carry_write_ref's (every row, or some rows of the step; rows left alone untouched), on
the GPU (-m gpu) and under Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET is read at import)."""

import os

import pytest
import torch
from kernel_utils import run_under_interpreter


def check(device):
    from deepinfer.kernels.reference import compress_members_ref
    from deepinfer.kernels.triton_compress import compress_members
    g = torch.Generator().manual_seed(0)
    for ratio, D, T, B, ring_len in ((2, 512, 9, 4, 8), (4, 96, 3, 3, 16), (2, 1500, 1, 1, 4)):
        raw = [torch.randn(T, D, generator=g) for _ in range(2)]
        carry = [torch.randn((B + 1) * ring_len, D, generator=g) for _ in range(2)]
        G = 5
        rows = torch.randint(-1, T, (G, ratio), generator=g)
        rows[0] = -1                                       # a group wholly before the step
        rows[1, -1] = T - 1                                # one straddling it
        rows[1, :-1] = -1
        carry_pos = torch.where(rows < 0, torch.randint(0, ring_len, (G, ratio), generator=g), -1)
        slots = torch.randperm(B + 1, generator=g)[:B]
        gseq = torch.randint(0, B, (G,), generator=g)
        args = [t.to(device) for t in (*raw, *carry, rows, carry_pos, slots, gseq)]
        got = compress_members(*args, ring_len)
        want = compress_members_ref(*args, ring_len)
        for a, b in zip(got, want):
            assert a.shape == b.shape == (G, ratio, D) and torch.equal(a, b), (ratio, D)


def check_carry_write(device):
    from deepinfer.kernels.reference import carry_write_ref
    from deepinfer.kernels.triton_compress import carry_write
    g = torch.Generator().manual_seed(1)
    for D, T, ring_rows, some in ((512, 9, 40, False), (96, 5, 16, True), (1500, 1, 4, False), (512, 7, 64, True)):
        raw = [torch.randn(T, D, generator=g).to(device) for _ in range(2)]
        carry = [torch.randn(ring_rows, D, generator=g).to(device) for _ in range(2)]
        rows = torch.randperm(T, generator=g)[:max(1, T // 2)].to(device) if some else None
        n = T if rows is None else rows.shape[0]
        dst = torch.randperm(ring_rows, generator=g)[:n].to(device)
        before = carry[0].clone()
        want = [c.clone() for c in carry]
        carry_write_ref(*raw, *want, dst, rows)
        carry_write(*raw, *carry, dst, rows)
        for a, b in zip(carry, want):
            assert torch.equal(a, b), (D, T, some)
        assert not torch.equal(carry[0][dst], before[dst])                   # the rows were written (not vacuous)


@pytest.mark.gpu
def test_compress_members_cuda():
    check("cuda")


@pytest.mark.gpu
def test_carry_write_cuda():
    check_carry_write("cuda")


def test_compress_members_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    check_carry_write("cpu")
    print("compress members, carry write: ok")
