"""Where hc_post_norm's streams differ from hc_post_kernel's on the GPU (a one-off probe, 2026-12-07)."""
import sys
import os
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
from test_hc_post_norm import _case  # noqa: E402
from deepinfer.kernels import triton_mhc  # noqa: E402
from deepinfer.kernels.triton_hc_post_norm import hc_post_norm  # noqa: E402
from deepinfer.kernels.reference import hc_post_ref  # noqa: E402

for T, d, seed in ((64, 5120, 6), (2, 5120, 6), (64, 5120, 3), (63, 5120, 6), (65, 5120, 6), (24, 256, 1), (16, 5120, 6)):
    y, res, post, comb, pre, w = _case(T, d, "cuda", seed)
    out = hc_post_norm(y, res, post, comb, pre, w, 1e-6)[0]
    want = triton_mhc.hc_post(y, res, post, comb)
    ref = hc_post_ref(y, res, post, comb)
    bad = out.view(torch.int16) != want.view(torch.int16)
    n = int(bad.sum())
    msg = f"T {T} d {d} seed {seed}: {n} of {bad.numel()} differ"
    if n:
        idx = bad.nonzero()
        msg += f"; rows {sorted(set(idx[:, 0].tolist()))[:8]} streams {sorted(set(idx[:, 1].tolist()))} cols {idx[:5, 2].tolist()}"
        a, b, r = out[bad].float(), want[bad].float(), ref[bad].float()
        msg += f"; |out-want| max {(a - b).abs().max():.3g} vs |want| {b.abs().max():.3g}; out==ref {int((a == r).sum())}, want==ref {int((b == r).sum())}"
        # the same rows alone
        sub = hc_post_norm(y[:2].contiguous(), res[:2].contiguous(), post[:2].contiguous(), comb[:2].contiguous(),
                           pre[:2].contiguous(), w, 1e-6)[0]
        msg += f"; first 2 rows alone equal to the T-run's: {torch.equal(sub, out[:2])}, to hc_post's: {torch.equal(sub, want[:2])}"
        sub2 = triton_mhc.hc_post(y[:2].contiguous(), res[:2].contiguous(), post[:2].contiguous(), comb[:2].contiguous())
        msg += f"; hc_post's first 2 rows alone equal to its T-run's: {torch.equal(sub2, want[:2])}"
    print(msg, flush=True)
