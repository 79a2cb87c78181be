"""Engram row lookups: where should the 196B-parameter tables live? (EngineArgs.engram_placement)

Times, per Engram layer and step, for T new tokens x 24 hash columns of 256-byte FP8 rows:
  device   the rows gathered from a table in GPU memory and dequantized (what each rank of the
           sharded placement does for its slice, before the reduce-scatter)
  host     the table in pinned host memory: hash ids to the host, a CPU gather, the rows to the GPU
           (what a host placement pays per lookup when it cannot prefetch, i.e. with async
           scheduling, where the step's new tokens exist only on the device)
  kernel   the lookup kernel (ops.engram_rows: gather + dequant in one launch) on the device table
  zero-copy  that kernel reading a host table in registered, mapped pinned memory straight over PCIe / C2C
           (engram_placement="host": model/host_tables.py; no sync, the ids stay on the device)
and the bytes the sharded placement's collectives move per rank (all-gather of the ids, reduce-
scatter of the bf16 rows), to set against NVLink bandwidth. Prints a table; --rows sets the table
size (the release tables have 384M rows each; a smaller table has the same per-row cost).

    python perf/engram_lookup.py --rows 32000000 --tokens 64 512 8192
"""

from __future__ import annotations

import argparse
import time

import torch

COLS, DIM = 24, 256


def _time(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32_000_000)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 8192])
    p.add_argument("--ranks", type=int, default=8, help="EP ranks for the sharded placement's bytes")
    p.add_argument("--repeat", type=int, default=50)
    a = p.parse_args()
    dev = torch.device("cuda")
    gpu_w = torch.randint(0, 120, (a.rows, DIM), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    gpu_s = torch.full((a.rows, DIM // 32), 127, dtype=torch.uint8, device=dev)
    host_w = torch.empty((a.rows, DIM), dtype=torch.uint8, pin_memory=True)
    host_w.copy_(gpu_w.view(torch.uint8))
    host_s = gpu_s.cpu().pin_memory()
    print(f"table {a.rows:,} rows x {DIM} B (+ scales): {a.rows * (DIM + DIM // 32) / 2**30:.1f} GiB")
    from deepinfer.model import host_tables, ops
    zc_w, zc_s = host_w.clone(), host_s.clone()          # pageable memory, then registered (as the engine does)
    assert host_tables._register(zc_w) and host_tables._register(zc_s), "cudaHostRegister failed"
    view_w, view_s = host_tables.cuda_view(zc_w, dev), host_tables.cuda_view(zc_s, dev)
    assert view_w is not None and view_s is not None, "CUDA cannot map the host table"
    view_w = view_w.view(torch.float8_e4m3fn)
    print(f"{'tokens':>7} {'device us':>10} {'host us':>10} {'host/device':>11} {'kernel us':>10} "
          f"{'zero-copy us':>13} {'zc/kernel':>10} {'sharded bytes/rank':>19}")
    for T in a.tokens:
        ids = torch.randint(0, a.rows, (T, COLS), device=dev)

        def device_lookup():
            w = gpu_w[ids].float().unflatten(-1, (-1, 32))
            return (w * torch.exp2(gpu_s[ids].float() - 127).unsqueeze(-1)).to(torch.bfloat16)

        stage_w = torch.empty((T, COLS, DIM), dtype=torch.uint8, pin_memory=True)
        stage_s = torch.empty((T, COLS, DIM // 32), dtype=torch.uint8, pin_memory=True)

        def host_lookup():
            idx = ids.cpu()                                            # the sync a host lookup needs
            torch.index_select(host_w, 0, idx.flatten(), out=stage_w.view(-1, DIM))
            torch.index_select(host_s, 0, idx.flatten(), out=stage_s.view(-1, DIM // 32))
            w = stage_w.to(dev, non_blocking=True).view(torch.float8_e4m3fn).float().unflatten(-1, (-1, 32))
            return (w * torch.exp2(stage_s.to(dev, non_blocking=True).float() - 127).unsqueeze(-1)).to(torch.bfloat16)

        def kernel_lookup():
            return ops.engram_rows(gpu_w, gpu_s, ids)

        def zero_copy_lookup():
            return ops.engram_rows(view_w, view_s, ids)

        assert torch.equal(device_lookup(), host_lookup())
        assert torch.equal(kernel_lookup(), zero_copy_lookup()) and torch.equal(kernel_lookup(), device_lookup())
        td, th = _time(device_lookup, a.repeat), _time(host_lookup, a.repeat)
        tk, tz = _time(kernel_lookup, a.repeat), _time(zero_copy_lookup, a.repeat)
        moved = a.ranks * T * COLS * 8 + a.ranks * T * COLS * DIM * 2        # ids gathered + rows scattered
        print(f"{T:>7} {td * 1e6:>10.1f} {th * 1e6:>10.1f} {th / td:>11.2f} {tk * 1e6:>10.1f} {tz * 1e6:>13.1f} "
              f"{tz / tk:>10.2f} {moved / 2**20:>16.2f} MiB")


if __name__ == "__main__":
    main()
