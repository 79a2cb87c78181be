"""kernels/triton_engram.py (Engram's gated add) against reference.engram_gate_ref: the GPU at the
full-width shape (-m gpu) and Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET is read at
import). The gate's fp32 sums run in another order than torch's, so a few outputs may round to the
neighbouring bf16 value (on the GPU: under 1% of them); none may move further than that and a few-ulp
change of the gate."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _case(T, hc, d, device, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, hc, d, generator=g) * 2).bfloat16()
    kv = torch.randn(T, (hc + 1) * d, generator=g).bfloat16()
    key, value = kv.split([hc * d, d], dim=-1)
    w = torch.rand(hc, d, generator=g) + 0.5
    mask = (torch.rand(T, generator=g) > 0.3) if masked else None
    to = lambda t: None if t is None else t.to(device)   # noqa: E731
    return to(x), to(key), to(value), to(w), to(mask)


def check(device):
    from deepinfer.kernels.reference import engram_gate_ref
    from deepinfer.kernels.triton_engram import engram_gate
    shapes = [(1, 4, 5120), (64, 4, 5120), (5, 4, 96)] if device == "cuda" else [(3, 4, 96), (2, 2, 1500)]
    for T, hc, d in shapes:
        for masked in (False, True):
            x, key, value, w, mask = _case(T, hc, d, device, masked, seed=T + d)
            got = engram_gate(x, key, value, w, 1e-6, mask)
            want = engram_gate_ref(x, key, value, w, 1e-6, mask)
            diff = got != want       # (the interpreter truncates float -> bf16 casts: any entry may be an ulp off)
            assert device != "cuda" or diff.float().mean().item() < 0.01, (T, d, masked, diff.float().mean().item())
            # an ulp of the result, plus what a gate a few fp32 ulps off moves it by (near cancellation
            # of x and gate * value the result is tiny and its ulp smaller than that)
            tol = want.float().abs() * 2 ** -7 + value.float().abs()[:, None, :] * 2 ** -18
            assert ((got.float() - want.float()).abs() <= tol).all(), (T, d, masked)
            if mask is not None:                         # masked tokens: the stream unchanged
                assert torch.equal(got[~mask], x[~mask])


@pytest.mark.gpu
def test_engram_gate_cuda():
    check("cuda")


def test_engram_gate_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check("cpu")
    print("engram gate: ok")
