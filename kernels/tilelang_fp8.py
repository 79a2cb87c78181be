"""FP8 x FP8 per-32-promotion GEMM in TileLang (optional: only where `tilelang` imports; the H200 carries
0.1.15): a candidate perf/bench_fp8_prefill.py --variants measures beside the Triton variants.

    tilelang_fp8_gemm(a, sa, b, sb)   D[M, N] = sum_kb (A_kb . B_kb^T) * sa[m, kb] * sb[n / 32, kb]  (bf16)

Same values as triton_fp8_prefill.fp8_prefill_gemm for weights with one scale per 32x32 tile (the dense
linears): one wgmma per 32-wide K slice into a fresh fp32 tile, scaled by the two powers of two and added
in fp32 (nvcc contracts the multiply-add into one FFMA; d * s is exact, so the same bits). What TileLang
adds over Triton 3.6 on SM90: a warp-specialized kernel (a producer warpgroup issuing TMA loads on
mbarriers, two consumer warpgroups), which Triton's tl.range(warp_specialize=True) does not do on
Hopper (the sm_90 compile is identical with and without it). The promotion still waits on each slice's
wgmma: an explicitly asynchronous form (T.wgmma_gemm + T.wait_wgmma) compiled, but TileLang's pipeliner
then refills a slice's shared-memory stage right after issuing the wgmma that reads it (checked in the
generated CUDA, 2026-12-02), a race, so it is not used.

M is a run-time size (one compile per (N, K)), masked; N a multiple of 128 (the tile: the scale loads are
not bounds-checked in N) and K of 32 (asserted).
Compiles offline for sm_90a (nvcc 13.0); never run on a GPU before the H200 run that measures it.
"""

from __future__ import annotations

import functools

import torch


def available() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:  # noqa: BLE001 (not installed, or its native libraries missing)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernel(n: int, k: int, block_m: int = 128, block_n: int = 128, stages: int = 4, threads: int = 256):
    import tilelang
    import tilelang.language as T

    m = T.dynamic("m")

    @T.prim_func
    def main(A: T.Tensor((m, k), "float8_e4m3"), B: T.Tensor((n, k), "float8_e4m3"),
             SA: T.Tensor((m, k // 32), "float32"), SB: T.Tensor(((n + 31) // 32, k // 32), "float32"),
             C: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, block_n), T.ceildiv(m, block_m), threads=threads) as (bx, by):
            a_s = T.alloc_shared((block_m, 32), "float8_e4m3")
            b_s = T.alloc_shared((block_n, 32), "float8_e4m3")
            sa_s = T.alloc_shared((block_m,), "float32")
            sb_s = T.alloc_shared((block_n // 32,), "float32")
            d = T.alloc_fragment((block_m, block_n), "float32")
            acc = T.alloc_fragment((block_m, block_n), "float32")
            T.clear(acc)
            for kb in T.Pipelined(k // 32, num_stages=stages):
                T.copy(A[by * block_m, kb * 32], a_s)
                T.copy(B[bx * block_n, kb * 32], b_s)
                for i in T.Parallel(block_m):
                    sa_s[i] = SA[by * block_m + i, kb]
                for j in T.Parallel(block_n // 32):
                    sb_s[j] = SB[bx * (block_n // 32) + j, kb]
                T.gemm(a_s, b_s, d, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(block_m, block_n):
                    acc[i, j] += d[i, j] * (sa_s[i] * sb_s[j // 32])
            T.copy(acc, C[by * block_m, bx * block_n])

    return tilelang.compile(main, out_idx=None, target={"kind": "cuda", "arch": "sm_90a"})


def tilelang_fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """a [M, K] e4m3, sa [M, K/32] f32, b [N, K] e4m3, sb [ceil(N/32), K/32] (E8M0 bytes or f32 pow2) ->
    [M, N] bf16."""
    from .triton_fp8_prefill import as_f32_scale
    m, k = a.shape
    n = b.shape[0]
    assert k % 32 == 0 and n % 128 == 0 and b.shape[1] == k and sa.shape == (m, k // 32), (a.shape, b.shape)
    assert sb.shape == (n // 32, k // 32), ("one scale per 32x32 weight tile only", sb.shape)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        _kernel(n, k)(a.contiguous(), b.contiguous(), sa.contiguous(), as_f32_scale(sb).contiguous(), c)
    return c
