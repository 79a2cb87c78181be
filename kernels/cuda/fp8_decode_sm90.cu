// Exact FP8 x FP8 GEMM with per-32 promotion at decode sizes (M <= 128 tokens a tile) for SM90, issue 15.
//
//   C[M, N] bf16 = sum over K/32 slices s of (fp32 sum of the slice's e4m3 x e4m3 products)
//                  * sa[m, s] * sb[n / R, s]          (R = 32: 32x32 weight blocks; R = 1: per (row, 32))
//
// The values of fp8_gemm_sm90.cu, with the operands swapped for memory-bound sizes: the weight rows are
// the wgmma's M side (64 rows a warpgroup row block, RB row blocks a consumer, two consumers: 128 RB rows
// a CTA) and the tokens its N side (BT = 16 / 32 / 64 / 128, one token tile a blockIdx.z). A CTA streams
// its weight rows once per K split; the tokens' tile (BT x 128 bytes a stage, from L2) is the only
// re-read, BT / (128 RB) of the weight bytes, where the token-major forms re-read 64 tokens for every
// 128 weight rows and waste the MMA's rows below 64 tokens.
//
// Pipeline as fp8_gemm_sm90.cu: one producer thread issues the TMA loads of 128-K stages (weights box
// (128, 128 RB), tokens box (128, BT), both SW128, and the stage's two scale tiles) into a ring guarded by
// full / empty mbarriers; each consumer warpgroup issues, per K = 32 slice, its RB wgmmas into RB temporaries
// (one commit group each) and promotes them as they complete (acc += tmp * sw[row] * sa[token]); the other
// consumer's wgmmas fill the tensor cores meanwhile. The pipelined forms (PIPE 1 / 2) keep two temporaries a
// row block and promote slice i-1 while slice i's wgmmas run, in turns of PIPE stages. BT 128 takes RB 1.
//
// Scales, both TMA-loaded with each stage into shared memory (no global load in a consumer: from global
// memory the promotions stalled on L1TEX / L2, the latency-bound pipeline Nsight showed):
//   saT [K/32, m_ld] f32, the activation scales transposed (act_quant_fp8(scales_ld=...)): a [4 slices, BT] tile;
//   sbT [K/32, sb_ld] f32, the weight scales transposed (cuda_fp8_decode.kernel_scales: the E8M0 bytes'
//   values, cached beside the checkpoint's [ceil(N/R), K/32] tensor): a [4 slices, 128 RB / R] tile.
// Tails: TMA zero-fills rows past N / M, K columns past K and scale rows past K/32 (zero scales); stores
// are masked. Split-K: gridDim.y splits take equal runs of the K stages; with more than one the CTA stores
// fp32 partials to ws [splits, M, N] and fp8_splitk_reduce sums them in split order (summing them in the
// kernel, by each tile's last split, was slower from 64 tokens: H200_NOTES, 2026-12-04 afternoon).
// Programmatic dependent launch (cuda_fp8_decode.PDL): the producer issues the first stages' weight loads,
// then waits on the kernel ahead (act_quant, which triggers at its start) before the token loads; consumers
// wait before anything they write; the epilogue lets the split-K reduce launch.

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "sm90_common.cuh"

namespace fp8dec {
using namespace fp8sm90;

__device__ __forceinline__ void wgmma_m64n16k32_e4m3(float (&d)[8], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n32k32_e4m3(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}


template <int BT>
__device__ __forceinline__ void wgmma_tokens(float (&d)[BT / 2], uint64_t desc_w, uint64_t desc_x) {
    static_assert(BT == 16 || BT == 32 || BT == 64 || BT == 128, "token tiles of 16 / 32 / 64 / 128");
    if constexpr (BT == 16) wgmma_m64n16k32_e4m3(d, desc_w, desc_x, 0);
    else if constexpr (BT == 32) wgmma_m64n32k32_e4m3(d, desc_w, desc_x, 0);
    else if constexpr (BT == 64) wgmma_m64n64k32_e4m3(d, desc_w, desc_x, 0);
    else wgmma_m64n128k32_e4m3(d, desc_w, desc_x, 0);
}

// acc += tmp * sw * sa in the m64nBT fragment layout: tmp[4f + 0/1] is weight row r0, tokens 8f + 2q + 0/1;
// tmp[4f + 2/3] is row r0 + 8 (w0 / w1: the two rows' weight scales). ts[f]: the slice's scales of
// tokens 8f + 2q, 8f + 2q + 1. Where the rows share one scale (32x32 blocks: r0 and r0 + 8 lie in one
// block) a token pair's two products serve both rows: 2 FMULs a pair instead of 4.
template <bool ONE, int R>
__device__ __forceinline__ void promote_tokens(float (&acc)[R], const float (&tmp)[R], float w0, float w1,
                                               const float2 (&ts)[R / 4]) {
    if constexpr (ONE) {
#pragma unroll
        for (int f = 0; f < R / 4; ++f) {
            const float s0 = w0 * ts[f].x, s1 = w0 * ts[f].y;
            acc[4 * f + 0] = fmaf(tmp[4 * f + 0], s0, acc[4 * f + 0]);
            acc[4 * f + 1] = fmaf(tmp[4 * f + 1], s1, acc[4 * f + 1]);
            acc[4 * f + 2] = fmaf(tmp[4 * f + 2], s0, acc[4 * f + 2]);
            acc[4 * f + 3] = fmaf(tmp[4 * f + 3], s1, acc[4 * f + 3]);
        }
        return;
    }
#pragma unroll
    for (int f = 0; f < R / 4; ++f) {
        acc[4 * f + 0] = fmaf(tmp[4 * f + 0], w0 * ts[f].x, acc[4 * f + 0]);
        acc[4 * f + 1] = fmaf(tmp[4 * f + 1], w0 * ts[f].y, acc[4 * f + 1]);
        acc[4 * f + 2] = fmaf(tmp[4 * f + 2], w1 * ts[f].x, acc[4 * f + 2]);
        acc[4 * f + 3] = fmaf(tmp[4 * f + 3], w1 * ts[f].y, acc[4 * f + 3]);
    }
}

// The weight scales of one slice for this thread's two rows of each row block, from the stage's scale tile
// in shared memory ([4 slices][SBC] f32: SBC = ROWS / 32 blocks or ROWS rows; off0 / off1 the rows' columns).
struct RowScales {
    int off0, off1;
};

// Promotes slice j of a stage for every row block: the slice's token scales (sa_p: this thread's first
// token pair of the slice) and weight scales (sb_p: the slice's row of the scale tile), both in shared memory.
// A slice's weight scale from the stage's tile, or 1 where the weight scale is one per row (EPI_ROW: applied
// in the epilogue instead, so the promotion multiplies by the token scale alone).
template <bool EPI_ROW>
__device__ __forceinline__ float slice_wscale(const float* sb_p, int off) {
    if constexpr (EPI_ROW) return 1.f;
    else return sb_p[off];
}

template <int BT, int RB, bool ONE, bool EPI_ROW = false>
__device__ __forceinline__ void promote_slice(float (&acc)[RB][BT / 2], float (&tmp)[RB][BT / 2], const float* sa_p,
                                              const float* sb_p, const RowScales (&rs)[RB]) {
    float2 ts[BT / 8];
#pragma unroll
    for (int f = 0; f < BT / 8; ++f) ts[f] = *reinterpret_cast<const float2*>(sa_p + 8 * f);
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
        const float w0 = slice_wscale<EPI_ROW>(sb_p, rs[rb].off0), w1 = slice_wscale<EPI_ROW>(sb_p, rs[rb].off1);
        fence_regs(tmp[rb]);
        promote_tokens<ONE || EPI_ROW>(acc[rb], tmp[rb], w0, w1, ts);
    }
}

template <int N>
struct Stages { static constexpr int value = N; };

// OCC CTAs a SM: 1 (the register split of fp8_gemm_sm90.cu) or 2 (producer 24, consumers 104 registers:
// 128 x 24 + 256 x 104 <= the 384 x 80 a CTA is launched with (at 112 the launch failed), for the narrow
// token tiles with few stages: twice the loads in flight a SM; BT 64 spills there).
template <int OCC>
__device__ __forceinline__ void split_registers(bool producer) {
    if constexpr (OCC == 1) {
        if (producer) setmaxnreg_producer();
        else setmaxnreg_consumer<2>();
    } else {
        if (producer) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        else asm volatile("setmaxnreg.inc.sync.aligned.u32 104;\n" ::: "memory");
    }
}
// MASKED: the MoE's masked layout (DeepGEMM's): blockIdx.y is the expert g, whose weights are rows g N.. of
// the [G N, K] map, its tokens rows g C.. of the [G C, K] map (C the slab's capacity), M = masked_m[g] of them
// (token tiles past it return at once), its output c[g] [C, N]; no split-K. The tile's weight rows past N and
// tokens past M read the next expert's rows (or TMA's zeros): their products land in outputs never stored.
// EPI_ROW: one pow2 weight scale a row (wrow [G N] f32: the row-scaled expert stacks), multiplied in the
// epilogue (exact: a power of two), no weight-scale tiles loaded.
template <int BT, int RB, int STAGES, int OCC, int PIPE, bool ONE, bool MASKED = false, bool EPI_ROW = false>
__device__ __forceinline__ void decode_body(const CUtensorMap* tmap_w, const CUtensorMap* tmap_x,
                                            const CUtensorMap* tmap_sa, const CUtensorMap* tmap_sb,
                                            __nv_bfloat16* __restrict__ c, float* __restrict__ ws, int M, int N,
                                            int K, int sb_rows, const int* __restrict__ masked_m = nullptr,
                                            int C = 0, const float* __restrict__ wrow = nullptr) {
    constexpr int NCONS = 2;
    constexpr int ROWS = 64 * RB * NCONS;     // weight rows a CTA
    constexpr int R = BT / 2;                 // floats a thread per row block
    constexpr uint32_t W_BYTES = ROWS * BK, X_BYTES = BT * BK;
    constexpr uint32_t SA_BYTES = SLICES * BT * 4;     // the stage's token scales, [slice][token] f32
    constexpr uint32_t SB_BYTES = SLICES * ROWS * 4;   // its weight scales, [slice][SBC] f32 (room for SBC = ROWS)
    static_assert(ROWS <= 256, "a TMA box has at most 256 rows");
    static_assert(X_BYTES % 1024 == 0, "each stage's token tile starts on a swizzle atom");

    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t w_smem = base, x_smem = base + STAGES * W_BYTES, sa_smem = x_smem + STAGES * X_BYTES;
    const uint32_t sb_smem = sa_smem + STAGES * SA_BYTES;
    const uint32_t bars = sb_smem + STAGES * SB_BYTES;   // full[STAGES], then empty[STAGES]
    const float* sa_tiles = reinterpret_cast<const float*>(smem_raw + (sa_smem - smem_u32(smem_raw)));
    const float* sb_tiles = reinterpret_cast<const float*>(smem_raw + (sb_smem - smem_u32(smem_raw)));
    const StageRing<STAGES> ring{bars};

    const int n0 = blockIdx.x * ROWS, t0 = blockIdx.z * BT;
    int row_base = 0, tok_base = 0;          // the expert's first weight row / token row in the maps (MASKED)
    if constexpr (MASKED) {
        grid_dependency_wait();              // masked_m is the routing's (launched programmatically: PDL)
        launch_dependents();                 // the next kernel (SwiGLU, the combine) may be scheduled: it waits
        const int g = blockIdx.y;
        M = min(masked_m[g], C);
        if (t0 >= M) return;                 // the whole CTA: before any barrier
        row_base = g * N;
        tok_base = g * C;
        c += static_cast<int64_t>(g) * C * N;
    }
    const int nkb = (K + BK - 1) / BK;
    const int nsplit = MASKED ? 1 : gridDim.y, split_id = MASKED ? 0 : blockIdx.y;
    const int per = (nkb + nsplit - 1) / nsplit;
    const int kb0 = min(nkb, split_id * per), kb1 = min(nkb, kb0 + per);
    constexpr int sbc = ONE ? ROWS / 32 : ROWS;         // the scale tile's columns (the map's box)

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        ring.init(1, 4 * NCONS);   // empty: one arrival per consumer warp
    }
    __syncthreads();

    if (wg == NCONS) {  // producer warpgroup
        split_registers<OCC>(true);
        if (tid == 0) {
            tma_prefetch(tmap_w);
            tma_prefetch(tmap_x);
            tma_prefetch(tmap_sa);
            if constexpr (!EPI_ROW) tma_prefetch(tmap_sb);
            const uint32_t bytes = W_BYTES + X_BYTES + SA_BYTES + (EPI_ROW ? 0 : SLICES * sbc * 4);
            // the first stages' weights (and their scales: made once, at load) before waiting on the kernel that
            // wrote the tokens: under a programmatic launch they stream while it ends (its stages start empty)
            const int ahead = min(kb1 - kb0, STAGES);
            for (int j = 0; j < ahead; ++j) {
                mbar_arrive_expect_tx(ring.full(j), bytes);
                tma_load_2d(w_smem + j * W_BYTES, tmap_w, ring.full(j), (kb0 + j) * BK, row_base + n0);
                if constexpr (!EPI_ROW)
                    tma_load_2d(sb_smem + j * SB_BYTES, tmap_sb, ring.full(j), (row_base + n0) / sb_rows,
                                (kb0 + j) * SLICES);
            }
            grid_dependency_wait();
            for (int j = 0; j < ahead; ++j) {
                tma_load_2d(x_smem + j * X_BYTES, tmap_x, ring.full(j), (kb0 + j) * BK, tok_base + t0);
                tma_load_2d(sa_smem + j * SA_BYTES, tmap_sa, ring.full(j), tok_base + t0, (kb0 + j) * SLICES);
            }
            int stage = ahead % STAGES;
            uint32_t phase = ahead == STAGES ? 1 : 0;
            for (int kb = kb0 + ahead; kb < kb1; ++kb) {
                mbar_wait_or_trap(ring.empty(stage), phase ^ 1);
                mbar_arrive_expect_tx(ring.full(stage), bytes);
                tma_load_2d(w_smem + stage * W_BYTES, tmap_w, ring.full(stage), kb * BK, row_base + n0);
                tma_load_2d(x_smem + stage * X_BYTES, tmap_x, ring.full(stage), kb * BK, tok_base + t0);
                // slices past K/32, rows past N read as zero scales (the maps end there)
                tma_load_2d(sa_smem + stage * SA_BYTES, tmap_sa, ring.full(stage), tok_base + t0, kb * SLICES);
                if constexpr (!EPI_ROW)
                    tma_load_2d(sb_smem + stage * SB_BYTES, tmap_sb, ring.full(stage), (row_base + n0) / sb_rows,
                                kb * SLICES);
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            const int nloads = kb1 - kb0;   // the consumers' releases of the last loads (the hang check)
            for (int j = max(0, nloads - STAGES); j < nloads; ++j)
                mbar_wait_or_trap(ring.empty(j % STAGES), (j / STAGES) & 1);
        }
        return;
    }

    split_registers<OCC>(false);
    grid_dependency_wait();                  // every global write after the kernel ahead has ended (PDL)
    const int warp = tid / 32, lane = tid % 32, q = lane % 4;
    // this thread's weight rows: row block rb's r0 = row0 + 64 rb, r1 = r0 + 8 (one 32-row block: same scale)
    const int row0 = n0 + 64 * RB * wg + 16 * warp + lane / 4;
    RowScales rs[RB];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
        const int l0 = row0 + 64 * rb - n0;
        rs[rb] = ONE ? RowScales{l0 / 32, l0 / 32} : RowScales{l0, l0 + 8};
    }

    float acc[RB][R];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
        for (int i = 0; i < R; ++i) acc[rb][i] = 0.f;
    auto sa_at = [&](int st, int j) { return sa_tiles + st * (SA_BYTES / 4) + j * BT + 2 * q; };
    auto sb_at = [&](int st, int j) { return sb_tiles + st * (SB_BYTES / 4) + j * sbc; };

    int stage = 0;
    uint32_t phase = 0;
    if constexpr (PIPE > 0) {
        // Turns of PIPE stages: slice i's wgmmas run while slice i-1 is promoted, across the turn's stage
        // boundary too (a stage is released once its last slice is promoted); only the turn's last slice
        // waits on its own wgmma (wait 0 before the loop's back edge: ptxas cannot follow a wgmma in flight
        // across it and would serialize every one, C7514).
        float tmp[2][RB][R];
        auto turn = [&](auto ns_tag) {
            constexpr int NS = decltype(ns_tag)::value;
            int st[NS];
#pragma unroll
            for (int sidx = 0; sidx < NS; ++sidx) {
                st[sidx] = stage;
                mbar_wait(ring.full(stage), phase);
                __syncwarp();                          // converged for the .aligned wgmma instructions
                if (++stage == STAGES) stage = 0, phase ^= 1;
                const uint64_t dw = sw128_desc(w_smem + st[sidx] * W_BYTES + 64 * RB * wg * BK);
                const uint64_t dx = sw128_desc(x_smem + st[sidx] * X_BYTES);
#pragma unroll
                for (int j = 0; j < SLICES; ++j) {
                    const int i = sidx * SLICES + j;
#pragma unroll
                    for (int rb = 0; rb < RB; ++rb) {
                        wgmma_fence();
                        fence_regs(tmp[i & 1][rb]);
                        wgmma_tokens<BT>(tmp[i & 1][rb], dw + (64 * BK >> 4) * rb + 2 * j, dx + 2 * j);
                        wgmma_commit();
                    }
                    if (i == 0) continue;
                    wgmma_wait<RB>();                  // slice i-1 done, slice i runs
                    const int ps = st[(i - 1) / SLICES], pj = (i - 1) % SLICES;
                    promote_slice<BT, RB, ONE, EPI_ROW>(acc, tmp[(i - 1) & 1], sa_at(ps, pj), sb_at(ps, pj), rs);
                    if (j == 0 && lane == 0) mbar_arrive(ring.empty(ps));   // its last slice is promoted
                }
            }
            wgmma_wait<0>();
            promote_slice<BT, RB, ONE, EPI_ROW>(acc, tmp[(NS * SLICES - 1) & 1], sa_at(st[NS - 1], SLICES - 1),
                                  sb_at(st[NS - 1], SLICES - 1), rs);
            if (lane == 0) mbar_arrive(ring.empty(st[NS - 1]));
        };
        int kb = kb0;
        for (; kb + PIPE <= kb1; kb += PIPE) turn(Stages<PIPE>{});
        if constexpr (PIPE == 2) {
            if (kb < kb1) turn(Stages<1>{});
        }
    } else {
        // per slice: every row block's wgmma in flight, then each promoted as it completes; the other
        // consumer's wgmmas fill the tensor cores meanwhile
        float tmp[RB][R];
        for (int kb = kb0; kb < kb1; ++kb) {
            mbar_wait(ring.full(stage), phase);
            __syncwarp();                              // converged for the .aligned wgmma instructions
            const uint64_t dw = sw128_desc(w_smem + stage * W_BYTES + 64 * RB * wg * BK);
            const uint64_t dx = sw128_desc(x_smem + stage * X_BYTES);
#pragma unroll
            for (int j = 0; j < SLICES; ++j) {
#pragma unroll
                for (int rb = 0; rb < RB; ++rb) {
                    wgmma_fence();
                    fence_regs(tmp[rb]);
                    wgmma_tokens<BT>(tmp[rb], dw + (64 * BK >> 4) * rb + 2 * j, dx + 2 * j);   // + 32 bytes a slice
                    wgmma_commit();
                }
                float2 ts[R / 4];                      // tokens 8f + 2q, + 1 of slice j
                const float* sa_p = sa_at(stage, j);
                const float* sb_p = sb_at(stage, j);
#pragma unroll
                for (int f = 0; f < R / 4; ++f) ts[f] = *reinterpret_cast<const float2*>(sa_p + 8 * f);
#pragma unroll
                for (int rb = 0; rb < RB; ++rb) {
                    if (rb == RB - 1) wgmma_wait<0>();
                    else wgmma_wait<RB - 1>();         // RB <= 2: row block 0 done, row block 1 may run
                    fence_regs(tmp[rb]);
                    promote_tokens<ONE || EPI_ROW>(acc[rb], tmp[rb], slice_wscale<EPI_ROW>(sb_p, rs[rb].off0),
                                                   slice_wscale<EPI_ROW>(sb_p, rs[rb].off1), ts);
                }
            }
            if (lane == 0) mbar_arrive(ring.empty(stage));  // every wgmma and scale read of this stage is done
            if (++stage == STAGES) stage = 0, phase ^= 1;
        }
    }

    // each output this thread holds: fn(its accumulator, weight row, token), rows past N and tokens past M skipped
    auto for_each_output = [&](auto&& fn) {
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + 64 * rb + 8 * h;
                if (row >= N) continue;
#pragma unroll
                for (int f = 0; f < R / 4; ++f) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int tok = t0 + 8 * f + 2 * q + e;
                        if (tok < M) fn(acc[rb][4 * f + 2 * h + e], row, tok);
                    }
                }
            }
        }
    };

    // epilogue, masked: C[token, row] bf16 (round to nearest even) or ws [split, token, row] fp32
    launch_dependents();                     // the split-K reduce may launch (it waits for this grid's end)
    const bool split = !MASKED && gridDim.y > 1;
    for_each_output([&](float a, int row, int tok) {
        const float v = EPI_ROW ? a * wrow[row_base + row] : a;
        if (split) ws[(static_cast<int64_t>(blockIdx.y) * M + tok) * N + row] = v;
        else c[static_cast<int64_t>(tok) * N + row] = __float2bfloat16_rn(v);
    });
}

}  // namespace fp8dec

// Entry points (C names for cuModuleGetFunction). Launch: grid (ceil(N / (128 RB)), splits, ceil(M / BT)),
// block 384 (two consumer warpgroups, then the producer), dynamic shared memory
// 1024 + STAGES * ((128 RB + BT) * 128 + 16 BT + 16 * 128 RB + 16) (kernels/cuda_fp8_decode.py FORMS must match).
// tmap_sa: the token scales saT [K/32, m_ld] f32, box (BT, 4); tmap_sb: the weight scales sbT [K/32, sb_ld] f32,
// box (128 RB / sb_rows, 4). sb_rows: 32 (one scale per 32x32 block) or 1 (per (row, 32)).
#define FP8_DECODE_ENTRY(NAME, BT, RB, STAGES, OCC, PIPE)                                                           \
    extern "C" __global__ void __launch_bounds__(384, OCC)                                                     \
        NAME(const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_x,         \
             const __grid_constant__ CUtensorMap tmap_sa, const __grid_constant__ CUtensorMap tmap_sb,                    \
             __nv_bfloat16* __restrict__ c, float* __restrict__ ws, int M, int N, int K, int sb_rows) {      \
        if (sb_rows == 32)                                                                                      \
            fp8dec::decode_body<BT, RB, STAGES, OCC, PIPE, true>(&tmap_w, &tmap_x, &tmap_sa, &tmap_sb, c, ws, M, N, K, 32); \
        else                                                                                                    \
            fp8dec::decode_body<BT, RB, STAGES, OCC, PIPE, false>(&tmap_w, &tmap_x, &tmap_sa, &tmap_sb, c, ws, M, N, K, 1); \
    }

FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb2, 16, 2, 5, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb2, 32, 2, 5, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t64_rb2, 64, 2, 5, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb1, 16, 1, 8, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb1, 32, 1, 8, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t64_rb1, 64, 1, 8, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t128_rb1, 128, 1, 6, 1, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb1_x2, 16, 1, 4, 2, 0)   // two CTAs a SM
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb1_x2, 32, 1, 4, 2, 0)
FP8_DECODE_ENTRY(fp8_decode_sm90_t64_rb1_x2, 64, 1, 4, 2, 0)
// slice i's wgmmas in flight while slice i-1 is promoted (two temporaries a row block), turns of 1 or 2 stages
// (t64_rb1_x2_p spills)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb2_p, 16, 2, 5, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb2_p, 32, 2, 5, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t64_rb2_p, 64, 2, 5, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb1_p, 16, 1, 8, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb1_p, 32, 1, 8, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t64_rb1_p, 64, 1, 8, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t128_rb1_p, 128, 1, 6, 1, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb1_x2_p, 16, 1, 4, 2, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb1_x2_p, 32, 1, 4, 2, 1)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb2_p2, 16, 2, 5, 1, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb2_p2, 32, 2, 5, 1, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb1_p2, 16, 1, 8, 1, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb1_p2, 32, 1, 8, 1, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t64_rb1_p2, 64, 1, 8, 1, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t128_rb1_p2, 128, 1, 6, 1, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t16_rb1_x2_p2, 16, 1, 4, 2, 2)
FP8_DECODE_ENTRY(fp8_decode_sm90_t32_rb1_x2_p2, 32, 1, 4, 2, 2)

// The masked MoE forms (MASKED, EPI_ROW above: the row-scaled FP8 expert stacks). Launch: grid
// (ceil(N / (128 RB)), G, ceil(C / BT)), block 384, the shared memory of the dense form of the tile. tmap_w over
// the stack [G N, K], tmap_x over the slab [G C, K], tmap_sa: saT [K/32, >= G C] f32 (column g C + t); wrow:
// the stack's row scales [G N] f32; c: [G, C, N] bf16.
#define FP8_MOE_ENTRY(NAME, BT, RB, STAGES, OCC, PIPE)                                                              \
    extern "C" __global__ void __launch_bounds__(384, OCC)                                                     \
        NAME(const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_x,         \
             const __grid_constant__ CUtensorMap tmap_sa, __nv_bfloat16* __restrict__ c,                      \
             const int* __restrict__ masked_m, const float* __restrict__ wrow, int C, int N, int K) {         \
        fp8dec::decode_body<BT, RB, STAGES, OCC, PIPE, false, true, true>(&tmap_w, &tmap_x, &tmap_sa, nullptr, c, \
                                                                          nullptr, 0, N, K, 1, masked_m, C, wrow); \
    }

FP8_MOE_ENTRY(fp8_moe_sm90_t16_rb1_x2, 16, 1, 4, 2, 0)
FP8_MOE_ENTRY(fp8_moe_sm90_t32_rb1_x2, 32, 1, 4, 2, 0)
FP8_MOE_ENTRY(fp8_moe_sm90_t16_rb2, 16, 2, 5, 1, 0)
FP8_MOE_ENTRY(fp8_moe_sm90_t32_rb2, 32, 2, 5, 1, 0)
FP8_MOE_ENTRY(fp8_moe_sm90_t64_rb1_x2, 64, 1, 4, 2, 0)
FP8_MOE_ENTRY(fp8_moe_sm90_t64_rb2_p, 64, 2, 5, 1, 1)
FP8_MOE_ENTRY(fp8_moe_sm90_t128_rb1_p, 128, 1, 6, 1, 1)
