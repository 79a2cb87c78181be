"""The ratio > 1 compressor's latents: one Triton program a group (select.compress_pool: the members read once, the
softmax, weighted sum, bf16 rounding and RMSNorm in registers) against the path it replaced (the members gathered
into [G, ratio, D] twice by compress_members, then softmax, multiply, sum and cast as torch ops, then the Triton
RMSNorm: six launches), side by side in one run as CUDA-graph replays, at decode sizes (a batch's groups that
complete in a step) and prefill sizes.

Why: in the H100's replayed batch-64 decode step (2026-12-07, perf/profiles/decode_b64_h100_2026-12-07.json) the
compressor's branch, which the index scores wait for, spends ~36 us from compress_members to the norm's end.

    python perf/bench_compress_pool.py [--groups 16 64 2048 8192] [--ratios 2 4 128]     (compress_pool.json)

Prints per (ratio, groups): both paths' microseconds and the fused path's speed-up; each fused output is checked
against the apart path first (tests/kernels/test_triton_compress.py's pool_close:
most elements equal, none further than three bf16 ulps or 1e-5 of the row's largest).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from benchutil import save_json, time_calls  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "kernels"))
from test_triton_compress import pool_close  # noqa: E402  (the tests' rule, one place)

D = 512                 # head_dim: the compressor's latent width


def case(ratio: int, groups: int, ring_len: int = 256):
    """The compressor's inputs for `groups` groups of `ratio` members, half of each from the step's rows and half
    from the carry ring (a decode step's groups straddle steps)."""
    T = max(1, groups * ratio // 2)
    seqs = max(1, groups)
    raw = [torch.randn(T, D, device="cuda") for _ in range(2)]
    carry = [torch.randn(seqs * ring_len, D, device="cuda") for _ in range(2)]
    r = torch.arange(ratio, device="cuda")
    rows = torch.where(r[None, :] >= ratio // 2, torch.randint(0, T, (groups, ratio), device="cuda"), -1)
    carry_pos = torch.where(rows < 0, r[None, :].expand(groups, ratio) % ring_len, -1)
    slots = torch.randperm(seqs, device="cuda")
    gseq = torch.arange(groups, device="cuda") % seqs
    weight = torch.rand(D, device="cuda") + 0.5
    return (*raw, *carry, rows, carry_pos, slots, gseq, ring_len, weight, 1e-20)


def plot(result: dict, path: str) -> None:
    """The fused kernel's speed-up over the apart path by groups, one line a ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for ratio in sorted({r["ratio"] for r in result["rows"]}):
        rs = [r for r in result["rows"] if r["ratio"] == ratio]
        ax.plot([r["groups"] for r in rs], [r["apart_us"] / r["fused_us"] for r in rs], marker="o", label=f"ratio {ratio}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("groups completed in the call")
    ax.set_ylabel("apart / fused time")
    ax.set_title(f"compress_pool vs the six launches it replaced ({result['device']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[16, 64, 2048, 8192])
    p.add_argument("--ratios", type=int, nargs="+", default=[2, 4, 128])
    p.add_argument("--plot", metavar="JSON", help="only draw a saved run's plot (compress_pool.json) next to it")
    a = p.parse_args()
    if a.plot:
        import json
        with open(a.plot) as f:
            plot(json.load(f), os.path.splitext(a.plot)[0] + ".png")
        return
    from deepinfer.kernels import select
    from deepinfer.kernels.triton_compress import compress_pool as fused

    def apart(*args):
        select.FAST_OFF = frozenset({"compress_pool"})
        try:
            return select.compress_pool(*args)
        finally:
            select.FAST_OFF = frozenset()

    rows = []
    print(f"{'ratio':>5} {'groups':>6} {'apart us':>9} {'fused us':>9} {'speed-up':>8}")
    for ratio in a.ratios:
        for groups in a.groups:
            if ratio * groups > 2**20:          # a prefill's groups are tokens / ratio: skip the impossible
                continue
            args = case(ratio, groups)
            assert pool_close(fused(*args), apart(*args)), (ratio, groups)
            t_apart = time_calls([lambda: apart(*args)])
            t_fused = time_calls([lambda: fused(*args)])
            rows.append(dict(ratio=ratio, groups=groups, apart_us=t_apart * 1e6, fused_us=t_fused * 1e6))
            print(f"{ratio:>5} {groups:>6} {t_apart * 1e6:>9.1f} {t_fused * 1e6:>9.1f} {t_apart / t_fused:>7.2f}x",
                  flush=True)
    result = dict(device=torch.cuda.get_device_name(), rows=rows)
    plot(result, os.path.splitext(save_json("compress_pool.json", result))[0] + ".png")


if __name__ == "__main__":
    main()
