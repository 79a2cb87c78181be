"""What a programmatic dependent launch saves at a kernel boundary inside a CUDA graph.

    python3 perf/bench_pdl_chain.py [--kernels 200]

A chain of dependent Triton kernels (each reads the previous one's output) captured in one graph, launched
plainly and with PDL (`launch_pdl=True`, each kernel's `gdc_wait` before its first dependent read), side by
side in one run: microseconds a kernel at a few sizes, from one CTA to a bandwidth-bound grid. The decode
step is a few hundred such launches; this says how much of a step the launch boundaries are.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _chain_kernel(src, dst, n, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()        # src is the previous kernel's output
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(dst + offs, x + 1.0, mask=offs < n)       # kernel i writes i + 1: a stale read shows


def _launch_chain(bufs: list, n: int, kernels: int, pdl: bool, block: int = 1024) -> torch.Tensor:
    """kernels dependent launches ping-ponging between bufs; the last one's output."""
    for i in range(kernels):
        _chain_kernel[(triton.cdiv(n, block),)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=block, USE_GDC=pdl,
                                                launch_pdl=pdl)
    return bufs[kernels % 2]


def chain_us(n: int, kernels: int, pdl: bool, block: int = 1024) -> float:
    bufs = [torch.zeros(n, device="cuda") for _ in range(2)]

    def run():
        _launch_chain(bufs, n, kernels, pdl, block)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 10 / kernels * 1e3)
    return sorted(times)[len(times) // 2]


def check_chain(n: int, kernels: int) -> None:
    """The PDL chain computes what the plain one does: every element counts every kernel (each kernel read
    its predecessor's output, not the value before it)."""
    for pdl in (False, True):
        out = _launch_chain([torch.zeros(n, device="cuda") for _ in range(2)], n, kernels, pdl)
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, float(kernels))), f"the chain (pdl={pdl}) lost a step"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=200)
    a = p.parse_args()
    check_chain(1 << 20, 51)
    print(f"{torch.cuda.get_device_name()}: {a.kernels} dependent kernels in one graph, us a kernel")
    print(f"{'elements':>10} {'CTAs':>6} {'plain':>8} {'PDL':>8} {'saved':>8}")
    for n in (1024, 64 * 1024, 1 << 20, 8 << 20, 32 << 20):
        plain, pdl = chain_us(n, a.kernels, False), chain_us(n, a.kernels, True)
        print(f"{n:>10} {triton.cdiv(n, 1024):>6} {plain:>8.2f} {pdl:>8.2f} {plain - pdl:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
