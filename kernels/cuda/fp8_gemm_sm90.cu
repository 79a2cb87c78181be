// Exact FP8 x FP8 GEMM with per-32 promotion for SM90 (H100 / H200), issue 15.
//
//   C[M, N] bf16 = sum over K/32 slices s of (fp32 sum of the slice's e4m3 x e4m3 products)
//                  * sa[m, s] * sb[n / 32, s]
//
// A [M, K] e4m3 (K-major), B [N, K] e4m3 (K-major; or [E * N, K] for the grouped contiguous form),
// sa [M, K/32] f32, sb [ceil(N/32), K/32] f32 (32x32 weight blocks; [E, ceil(N/32), K/32] grouped), or
// per-(row, 32) / per-row weight scales (SB_ROWK / SB_ROW below: sb[n, s] in place of sb[n / 32, s]).
//
// CTA: one producer warpgroup (one thread issues the TMA loads of 128-K stages into a ring of shared
// memory buffers guarded by full/empty mbarriers) and NCONS consumer warpgroups, each owning 64 rows of
// the tile. Each consumer issues one m64nBNk32 wgmma per K=32 slice into one of two temporaries (scale-d
// 0: no clearing), and while the tensor cores run slice s it promotes slice s-1 on the CUDA cores:
// acc += tmp * (sa * sb). That overlap is what the Triton kernel cannot express (it waits on every
// wgmma before the promotion). OVERLAP=false (the debugging form) waits on each wgmma instead.
//
// Shared memory per stage: A BM x 128 bytes, B BN x 128 bytes, both written by TMA with the 128-byte
// swizzle, which is the wgmma K-major SW128 canonical layout (8 rows x 128 bytes per 1024-byte atom,
// SBO 1024); slice j of a stage starts 32 * j bytes into the atom (the descriptor start address + 2 * j).
// Forms (FP8_GEMM_ENTRY at the end): BN 128 with two temporaries (the overlap above) or BN 192 with one
// (acc + tmp = 192 floats; the other consumer's wgmmas overlap a promotion), split-K over gridDim.y for
// decode sizes (fp32 partials + fp8_splitk_reduce), and the three weight-scale layouts.
//
// Tails: TMA zero-fills out-of-bounds rows and K columns; slices past K/32 and scale blocks past N get
// scale 0 (never read out of bounds); stores are masked.
// The scale-tile forms (gemm_body_ts, FP8_GEMM_TS_ENTRY: K a multiple of 128) TMA-load each stage's scales
// into shared memory beside A and B and run the K loop in turns of two stages: half the instructions a
// stage of gemm_body's consumers (perf/sass_issue_model.py), the same arithmetic in the same order.

#include <type_traits>

#include "sm90_common.cuh"

namespace fp8sm90 {

constexpr int GROUP_M = 8;       // M tiles per rasterization group (B tiles stay hot in L2)

// Weight-scale layouts (the SBMODE template flag):
//   SB_BLOCK  sb [ceil(N/32), K/32]: one scale per 32x32 block (E8M0 checkpoints), 4 (BN/32) per slice
//   SB_ROWK   sbT [K/32, sb_ld] (the host's transpose of [N, K/32], sb_ld >= N a multiple of BN, zero
//             padded; [E, K/32, sb_ld] grouped): one scale per (row, 32); the promotion multiplies each column pair by its own
//             scale pair (a float2 load per 8-column fragment group), one temporary (registers)
//   SB_ROW    sb [N] (of [N, 1]): one scale per weight row over all of K; the promotion uses the
//             activation scale only and the epilogue multiplies each column by its row's scale
constexpr int SB_BLOCK = 0, SB_ROWK = 1, SB_ROW = 2;

template <int WN>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[WN / 2], uint64_t desc_a, uint64_t desc_b) {
    static_assert(WN == 128 || WN == 192, "m64n128 / m64n192 only");
    if constexpr (WN == 128) wgmma_m64n128k32_e4m3(d, desc_a, desc_b, 0);
    else wgmma_m64n192k32_e4m3(d, desc_a, desc_b, 0);
}

// One slice's scales for this thread: its two rows' activation scales and the tile's BN/32 32-column
// weight blocks (SB_BLOCK; 1 for SB_ROW, unused for SB_ROWK). Zero where the slice lies past K/32, the
// row past M or the block past N.
template <int NB>
struct SliceScales {
    float a0, a1, b[NB];
};

template <int NB, int SBMODE>
__device__ __forceinline__ SliceScales<NB> load_scales(const float* __restrict__ sa_r0, const float* __restrict__ sa_r1,
                                                       const float* __restrict__ sb_blk, int ks, int nblk, int g) {
    SliceScales<NB> s;
    const bool k_ok = g < ks;
    s.a0 = (k_ok && sa_r0 != nullptr) ? __ldg(sa_r0 + g) : 0.f;
    s.a1 = (k_ok && sa_r1 != nullptr) ? __ldg(sa_r1 + g) : 0.f;
#pragma unroll
    for (int c = 0; c < NB; ++c) {
        if constexpr (SBMODE == SB_BLOCK) s.b[c] = (k_ok && c < nblk) ? __ldg(sb_blk + static_cast<int64_t>(c) * ks + g) : 0.f;
        else s.b[c] = 1.f;
    }
    return s;
}

// acc += tmp * (sa * sb) in the m64nBN fragment layout: tmp[4j + 0/1] is row r0, columns 8j + 2q + 0/1;
// tmp[4j + 2/3] is row r0 + 8; 32-column block j / 4.
template <int R, int NB>
__device__ __forceinline__ void promote(float (&acc)[R], const float (&tmp)[R], const SliceScales<NB>& s) {
    static_assert(R == 16 * NB, "4 fragment groups of 8 columns per 32-column block");
#pragma unroll
    for (int c = 0; c < NB; ++c) {
        const float s0 = s.a0 * s.b[c], s1 = s.a1 * s.b[c];
#pragma unroll
        for (int j = 4 * c; j < 4 * c + 4; ++j) {
            acc[4 * j + 0] = fmaf(tmp[4 * j + 0], s0, acc[4 * j + 0]);
            acc[4 * j + 1] = fmaf(tmp[4 * j + 1], s0, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(tmp[4 * j + 2], s1, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(tmp[4 * j + 3], s1, acc[4 * j + 3]);
        }
    }
}

// SB_ROWK: each 8-column fragment group's column pair has its own weight scales bc[j] (x: column 2q,
// y: 2q + 1).
template <int R>
__device__ __forceinline__ void promote_cols(float (&acc)[R], const float (&tmp)[R], float a0, float a1,
                                             const float2 (&bc)[R / 4]) {
#pragma unroll
    for (int j = 0; j < R / 4; ++j) {
        acc[4 * j + 0] = fmaf(tmp[4 * j + 0], a0 * bc[j].x, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(tmp[4 * j + 1], a0 * bc[j].y, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(tmp[4 * j + 2], a1 * bc[j].x, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(tmp[4 * j + 3], a1 * bc[j].y, acc[4 * j + 3]);
    }
}

// The output tile of this CTA and its run of K stages. Dense: GROUP_M M tiles share each N tile in
// launch order (B tiles stay hot in L2). Grouped contiguous (tiles != nullptr): the M tile's (first row,
// row end, expert) from the host's map (expert -1: an unused tile). Split-K: blockIdx.y's equal run of
// the K stages [kb0, kb1).
struct TileAt {
    int m0, m_end, n0, expert, kb0, kb1;
};

template <int BN, bool SPLITK>
__device__ __forceinline__ TileAt tile_at(const int* __restrict__ tiles, int M, int N, int K, int tiles_m, int BM) {
    const int tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x, per_group = GROUP_M * tiles_n;
    const int first_m = (pid / per_group) * GROUP_M;
    const int group_rows = min(tiles_m - first_m, GROUP_M);
    const int pm = first_m + (pid % per_group) % group_rows, pn = (pid % per_group) / group_rows;
    const int nkb = (K + BK - 1) / BK;
    TileAt t{pm * BM, M, pn * BN, 0, 0, nkb};
    if constexpr (SPLITK) {
        const int per = (nkb + gridDim.y - 1) / gridDim.y;
        t.kb0 = min(nkb, static_cast<int>(blockIdx.y) * per);
        t.kb1 = min(nkb, t.kb0 + per);
    }
    if (tiles != nullptr) {
        t.m0 = tiles[3 * pm];
        t.m_end = tiles[3 * pm + 1];
        t.expert = tiles[3 * pm + 2];
    }
    return t;
}

// The consumer's epilogue, masked: its rows r0 / r0 + 8 of the m64nR*2 fragment as bf16 (round to nearest
// even), or fp32 partials into ws [splits, M, N] for split-K; SB_ROW multiplies each column by its row
// scale sb_row[col] first (exact: a power of two).
template <int R, int SBMODE, bool SPLITK>
__device__ __forceinline__ void store_tile(const float (&acc)[R], int r0, int m_end, int n0, int q, int M, int N,
                                           const float* __restrict__ sb_row, __nv_bfloat16* __restrict__ c,
                                           float* __restrict__ ws) {
    const bool pairs = (N % 2) == 0;              // 4 / 8-byte aligned pairs
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + 8 * h;
        if (row >= m_end) continue;
#pragma unroll
        for (int j = 0; j < R / 4; ++j) {
            const int col = n0 + 8 * j + 2 * q;
            float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            if constexpr (SBMODE == SB_ROW) {
                v0 *= col < N ? __ldg(sb_row + col) : 0.f;
                v1 *= col + 1 < N ? __ldg(sb_row + col + 1) : 0.f;
            }
            if constexpr (SPLITK) {
                float* wrow = ws + (static_cast<int64_t>(blockIdx.y) * M + row) * N;
                if (pairs) {
                    if (col < N) *reinterpret_cast<float2*>(wrow + col) = make_float2(v0, v1);
                } else {
                    if (col < N) wrow[col] = v0;
                    if (col + 1 < N) wrow[col + 1] = v1;
                }
            } else {
                __nv_bfloat16* crow = c + static_cast<int64_t>(row) * N;
                if (pairs) {
                    if (col < N) *reinterpret_cast<__nv_bfloat162*>(crow + col) = __floats2bfloat162_rn(v0, v1);
                } else {
                    if (col < N) crow[col] = __float2bfloat16_rn(v0);
                    if (col + 1 < N) crow[col + 1] = __float2bfloat16_rn(v1);
                }
            }
        }
    }
}

// BN: 128 or 192 (the wide tile: one temporary, acc + tmp = 192 floats). OVERLAP: two temporaries, slice
// s-1 promoted while slice s runs (BN 128 only); else one temporary waited on per slice, the other
// consumer warpgroup's wgmmas filling the tensor cores meanwhile. SPLITK: blockIdx.y of gridDim.y splits
// takes an equal run of the K stages and stores fp32 partials to ws [splits, M, N] (fp8_splitk_reduce
// sums them in split order). CLUSTER 2: the two CTAs of a cluster (launch order 2c, 2c + 1: adjacent M
// tiles of one N tile; the host pads tiles_m to even) share the B tile: each loads its half (BN / 2 rows,
// tmap_b's box) and multicasts it to both, and a stage is refilled only when the consumers of BOTH CTAs
// have released it (each consumer warp arrives on its own CTA's empty barrier and on the peer's).
template <int BN, int STAGES, int NCONS, bool OVERLAP, int SBMODE, bool SPLITK, int CLUSTER>
__device__ __forceinline__ void gemm_body(const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                          const float* __restrict__ sa, const float* __restrict__ sb,
                                          __nv_bfloat16* __restrict__ c, const int* __restrict__ tiles,
                                          float* __restrict__ ws, int M, int N, int K, int tiles_m, int sb_ld) {
    static_assert(BN == 128 || BN == 192, "the m64n128 and m64n192 wgmma");
    static_assert(!OVERLAP || BN == 128, "two temporaries of BN / 2 floats fit at BN = 128 only");
    static_assert(SBMODE != SB_ROWK || !OVERLAP, "per-column scales take the one-temporary form");
    static_assert(CLUSTER == 1 || (CLUSTER == 2 && !SPLITK), "2-CTA clusters: dense, whole K");
    static_assert((BN / CLUSTER) * BK % 1024 == 0, "each CTA's share of B starts on a swizzle atom");
    constexpr int BM = 64 * NCONS;
    constexpr int R = BN / 2;                 // accumulator floats per thread
    constexpr int NB = SBMODE == SB_ROWK ? 1 : BN / 32;   // SB_ROW: constant 1s (folded away)
    constexpr uint32_t A_BYTES = BM * BK, B_BYTES = BN * BK;

    extern __shared__ uint8_t smem_raw[];
    // 1024-byte aligned base (the SW128 atom): the launch asks for 1024 bytes of slack.
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + 1023u) & ~1023u;
    const uint32_t a_smem = base, b_smem = base + STAGES * A_BYTES;
    const uint32_t bars = b_smem + STAGES * B_BYTES;  // full[STAGES], then empty[STAGES]
    const StageRing<STAGES> ring{bars};

    const TileAt t = tile_at<BN, SPLITK>(tiles, M, N, K, tiles_m, BM);
    if (t.expert < 0) return;  // an unused tile: the whole CTA, before any barrier is used
    const int n0 = t.n0, m0 = t.m0, m_end = t.m_end, expert = t.expert, kb0 = t.kb0, kb1 = t.kb1;
    const int ks = K / 32, nblk32 = (N + 31) / 32;

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        ring.init(1, 4 * NCONS * CLUSTER);   // empty: one arrival per consumer warp (of both CTAs)
    }
    if constexpr (CLUSTER > 1) cluster_sync();   // the peer's barriers exist before any remote arrive / multicast
    else __syncthreads();
    const uint32_t rank = CLUSTER > 1 ? cluster_ctarank() : 0;

    if (wg == NCONS) {  // producer warpgroup (the last one)
        setmaxnreg_producer();
        if (tid == 0) {
            tma_prefetch(tmap_a);
            tma_prefetch(tmap_b);
            const int b_row = expert * N + n0;
            int stage = 0;
            uint32_t phase = 0;
            for (int kb = kb0; kb < kb1; ++kb) {
                mbar_wait_or_trap(ring.empty(stage), phase ^ 1);
                mbar_arrive_expect_tx(ring.full(stage), A_BYTES + B_BYTES);
                tma_load_2d(a_smem + stage * A_BYTES, tmap_a, ring.full(stage), kb * BK, m0);
                if constexpr (CLUSTER == 1) {
                    tma_load_2d(b_smem + stage * B_BYTES, tmap_b, ring.full(stage), kb * BK, b_row);
                } else {   // this CTA's half of B, into both CTAs (the full barrier expects both halves)
                    constexpr uint32_t HALF = B_BYTES / CLUSTER;
                    tma_load_2d_multicast(b_smem + stage * B_BYTES + rank * HALF, tmap_b, ring.full(stage), kb * BK,
                                          b_row + static_cast<int>(rank) * (BN / CLUSTER), (1u << CLUSTER) - 1);
                }
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            // the consumers' releases of the last loads (the hang check; nothing is loaded after them):
            // load j's release completes phase j / STAGES of its stage's empty barrier
            const int nloads = kb1 - kb0;
            for (int j = max(0, nloads - STAGES); j < nloads; ++j)
                mbar_wait_or_trap(ring.empty(j % STAGES), (j / STAGES) & 1);
        }
    } else {
        // consumer warpgroup wg: rows m0 + 64 wg + [0, 64)
        setmaxnreg_consumer<NCONS>();
        const int warp = tid / 32, lane = tid % 32;
        const int q = lane % 4;
        const int r0 = m0 + 64 * wg + 16 * warp + lane / 4, r1 = r0 + 8;
        const float* sa_r0 = r0 < m_end ? sa + static_cast<int64_t>(r0) * ks : nullptr;
        const float* sa_r1 = r1 < m_end ? sa + static_cast<int64_t>(r1) * ks : nullptr;
        const int blk0 = n0 / 32;
        const float* sb_blk = sb + (static_cast<int64_t>(expert) * nblk32 + blk0) * ks;   // SB_BLOCK
        const int nblk = min(BN / 32, nblk32 - blk0);

        float acc[R], t0[R], t1[R];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = 0.f;

        // One stage of one consumer, OVERLAP (tensor cores above, CUDA cores below; t0 / t1 the temporaries):
        //   wgmma s0->t0 | wgmma s1->t1      | wgmma s2->t0      | wgmma s3->t1      |
        //                | wait<=1, prom t0  | wait<=1, prom t1  | wait<=1, prom t0  | wait 0, prom t1, release
        // Per stage: slice j's wgmma runs while slice j-1 is promoted; the stage's last slice is promoted
        // after a wait_group 0 (no wgmma is left in flight across the loop's back edge: ptxas cannot follow
        // one there and would serialize every wgmma of the kernel, C7514). The other consumer warpgroup's
        // wgmmas keep the tensor cores busy meanwhile. Without OVERLAP each slice waits (wait 0) and is
        // promoted from t0: the other consumer's wgmmas are what overlaps.
        int stage = 0;
        uint32_t phase = 0;
        for (int kb = kb0; kb < kb1; ++kb) {
            // the scale rows' cache lines two stages ahead into L1 (a line holds 8 stages of one row's
            // scales: without this, every 8th stage's first promotion waits on L2)
            const int gp = (kb + 2) * SLICES;
            if (gp < ks) {
                if (sa_r0 != nullptr) prefetch_l1(sa_r0 + gp);
                if (sa_r1 != nullptr) prefetch_l1(sa_r1 + gp);
                if constexpr (SBMODE == SB_BLOCK) {
#pragma unroll
                    for (int cb = 0; cb < NB; ++cb)
                        if (cb < nblk) prefetch_l1(sb_blk + static_cast<int64_t>(cb) * ks + gp);
                }
            }
            SliceScales<NB> sc[SLICES];
#pragma unroll
            for (int j = 0; j < SLICES; ++j)
                sc[j] = load_scales<NB, SBMODE>(sa_r0, sa_r1, sb_blk, ks, nblk, kb * SLICES + j);
            mbar_wait(ring.full(stage), phase);
            __syncwarp();                                  // converged for the .aligned wgmma instructions
            const uint64_t da = sw128_desc(a_smem + stage * A_BYTES + wg * 64 * BK);
            const uint64_t db = sw128_desc(b_smem + stage * B_BYTES);
#pragma unroll
            for (int j = 0; j < SLICES; ++j) {
                float(&t)[R] = (OVERLAP && j % 2 == 1) ? t1 : t0;   // one temporary without OVERLAP
                float(&other)[R] = (j % 2 == 0) ? t1 : t0;
                float2 bc[SBMODE == SB_ROWK ? R / 4 : 1];
                if constexpr (SBMODE == SB_ROWK) {   // this slice's column scales, loaded under its wgmma
                    const int g = kb * SLICES + j;
                    const float* row = sb + (static_cast<int64_t>(expert) * ks + (g < ks ? g : 0)) * sb_ld + n0 + 2 * q;
#pragma unroll
                    for (int jj = 0; jj < R / 4; ++jj)
                        bc[jj] = g < ks ? __ldg(reinterpret_cast<const float2*>(row + 8 * jj)) : make_float2(0.f, 0.f);
                }
                wgmma_fence();
                fence_regs(t);
                wgmma_e4m3<BN>(t, da + 2 * j, db + 2 * j);   // + 32 bytes per slice (>> 4)
                wgmma_commit();
                if constexpr (OVERLAP) {
                    if (j > 0) {
                        wgmma_wait<1>();              // slice j-1 is done; slice j runs on the tensor cores
                        fence_regs(other);
                        promote(acc, other, sc[j - 1]);
                    }
                } else {
                    wgmma_wait<0>();
                    fence_regs(t);
                    if constexpr (SBMODE == SB_ROWK) promote_cols(acc, t, sc[j].a0, sc[j].a1, bc);
                    else promote(acc, t, sc[j]);
                }
            }
            if constexpr (OVERLAP) {
                float(&last)[R] = (SLICES % 2 == 0) ? t1 : t0;
                wgmma_wait<0>();
                fence_regs(last);
                promote(acc, last, sc[SLICES - 1]);
            }
            // every wgmma reading this stage has completed: hand the buffers back to the producer
            if (lane == 0) {
                mbar_arrive(ring.empty(stage));
                if constexpr (CLUSTER == 2) mbar_arrive_cluster(mapa_shared(ring.empty(stage), rank ^ 1));
            }
            if (++stage == STAGES) stage = 0, phase ^= 1;
        }

        store_tile<R, SBMODE, SPLITK>(acc, r0, m_end, n0, q, M, N, sb + static_cast<int64_t>(expert) * N, c, ws);
    }
    // neither CTA exits while the peer may still arrive on its barriers (its last releases)
    if constexpr (CLUSTER > 1) cluster_sync();
}


// ---- The scale-tile forms (the _ts entries) -------------------------------------------------------
// gemm_body's consumers spent ~450 of a stage's ~700 instructions a warp on the scales (24 predicated
// global loads with their addresses, prefetches, bounds checks) against 256 FFMAs of promotion: an SM90
// sub-partition issues one instruction a cycle and the stage's wgmmas keep its tensor core busy 256
// cycles, so that kernel could not pass ~0.36 of the FP8 peak (perf/sass_issue_model.py). Here the
// producer TMA-loads each stage's scales beside its A and B tiles:
//   sa [M, K/32] f32 (row-major, K a multiple of 128: 16-byte rows)  -> [BM rows][4 slices], a float4 a row
//   sbT [K/32, ld] f32 (cuda_fp8_decode.kernel_scales: the 32x32-block scales transposed, grouped stacks with
//       each expert's ceil(N/32) columns padded to 4)                -> [4 slices][SBW blocks]
// rows past M, slices past K/32 and blocks past the map read as zeros. A consumer thread reads its two
// rows' float4s once a stage and one float4 (BN 128) of block scales a slice, all from shared memory.
// SB_ROW (per-row weight scales, the MoE's row-scaled stacks) loads no weight-scale tile: the epilogue
// multiplies by the row scale. The K loop runs in turns of PIPE stages: slice i's wgmma runs while slice
// i-1 is promoted across the turn's stage boundaries too (a stage is released once its last slice is
// promoted); only a turn's last slice waits on its own wgmma (wait 0 before the loop's back edge, C7514).
template <int BN>
__host__ __device__ constexpr int sb_tile_cols() { return ((BN / 32 + 3) / 4) * 4; }   // the box's columns: 16-byte multiples

template <int BN, int BM, int SBMODE>
__host__ __device__ constexpr uint32_t ts_stage_scale_bytes() {
    return BM * 16 + (SBMODE == SB_BLOCK ? ((SLICES * sb_tile_cols<BN>() * 4 + 127) / 128) * 128 : 0);
}

template <int BN, int STAGES, int NCONS, int PIPE, int SBMODE, bool SPLITK>
__device__ __forceinline__ void gemm_body_ts(const CUtensorMap* tmap_a, const CUtensorMap* tmap_b,
                                             const CUtensorMap* tmap_sa, const CUtensorMap* tmap_sb,
                                             const float* __restrict__ sb_row, __nv_bfloat16* __restrict__ c,
                                             const int* __restrict__ tiles, float* __restrict__ ws, int M, int N,
                                             int K, int tiles_m) {
    static_assert(BN == 128 || BN == 192, "the m64n128 and m64n192 wgmma");
    static_assert(SBMODE == SB_BLOCK || SBMODE == SB_ROW, "per-(row, 32) scales keep gemm_body");
    static_assert(PIPE == 1 || PIPE == 2, "turns of one or two stages");
    constexpr int BM = 64 * NCONS;
    constexpr int R = BN / 2;                          // accumulator floats per thread
    constexpr int NB = BN / 32;                        // 32-column weight blocks a tile
    constexpr int SBW = sb_tile_cols<BN>();
    // two temporaries fit beside acc at BN 128 with at most two consumers (three: 160 registers a thread)
    constexpr bool TWO = BN == 128 && NCONS <= 2;
    constexpr uint32_t A_BYTES = BM * BK, B_BYTES = BN * BK;
    constexpr uint32_t SA_BYTES = BM * 16, SB_BYTES = ts_stage_scale_bytes<BN, BM, SBMODE>() - SA_BYTES;
    constexpr uint32_t TX_BYTES = A_BYTES + B_BYTES + SA_BYTES + (SBMODE == SB_BLOCK ? SLICES * SBW * 4 : 0);

    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t base = (raw + 1023u) & ~1023u;      // the SW128 atom (1024 bytes of launch slack)
    const uint32_t a_smem = base, b_smem = base + STAGES * A_BYTES;
    const uint32_t sa_smem = b_smem + STAGES * B_BYTES, sb_smem = sa_smem + STAGES * SA_BYTES;
    const uint32_t bars = sb_smem + STAGES * SB_BYTES;   // full[STAGES], then empty[STAGES]
    const StageRing<STAGES> ring{bars};
    const float* sa_tiles = reinterpret_cast<const float*>(smem_raw + (sa_smem - raw));
    const float* sb_tiles = reinterpret_cast<const float*>(smem_raw + (sb_smem - raw));

    const TileAt t = tile_at<BN, SPLITK>(tiles, M, N, K, tiles_m, BM);
    if (t.expert < 0) return;  // an unused tile: the whole CTA, before any barrier is used
    // the tile's first block scale column in sbT (kernel_scales starts an expert's blocks on a 4-column boundary)
    // and how far past the box's start it lies: TMA's innermost coordinate must be 16-byte aligned (4 floats; an
    // unaligned one faulted with an illegal instruction, H100, 2026-12-05), so the box starts at the 4-column
    // boundary at or below it: sb_off is 0 at BN 128, 0 or 2 at BN 192 (6 blocks a tile)
    const int sb_col = t.expert * (((N + 31) / 32 + 3) & ~3) + t.n0 / 32, sb_off = sb_col & 3;
    static_assert(sb_tile_cols<BN>() >= BN / 32 + (BN == 192 ? 2 : 0), "the box holds the tile's blocks past sb_off");

    // warp-uniform (a shuffle from lane 0): the wgmma descriptors stay in uniform registers
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
    const int tid = threadIdx.x % 128;
    if (threadIdx.x == 0) ring.init(1, 4 * NCONS);     // empty: one arrival per consumer warp
    __syncthreads();

    if (wg == NCONS) {  // producer warpgroup (the last one)
        setmaxnreg_producer<NCONS>();
        if (tid == 0) {
            tma_prefetch(tmap_a);
            tma_prefetch(tmap_b);
            tma_prefetch(tmap_sa);
            if constexpr (SBMODE == SB_BLOCK) tma_prefetch(tmap_sb);
            const int b_row = t.expert * N + t.n0;
            int stage = 0;
            uint32_t phase = 0;
            for (int kb = t.kb0; kb < t.kb1; ++kb) {
                mbar_wait_or_trap(ring.empty(stage), phase ^ 1);
                mbar_arrive_expect_tx(ring.full(stage), TX_BYTES);
                tma_load_2d(a_smem + stage * A_BYTES, tmap_a, ring.full(stage), kb * BK, t.m0);
                tma_load_2d(b_smem + stage * B_BYTES, tmap_b, ring.full(stage), kb * BK, b_row);
                tma_load_2d(sa_smem + stage * SA_BYTES, tmap_sa, ring.full(stage), kb * SLICES, t.m0);
                if constexpr (SBMODE == SB_BLOCK)
                    tma_load_2d(sb_smem + stage * SB_BYTES, tmap_sb, ring.full(stage), sb_col - sb_off, kb * SLICES);
                if (++stage == STAGES) stage = 0, phase ^= 1;
            }
            const int nloads = t.kb1 - t.kb0;   // the consumers' releases of the last loads (the hang check)
            for (int j = max(0, nloads - STAGES); j < nloads; ++j)
                mbar_wait_or_trap(ring.empty(j % STAGES), (j / STAGES) & 1);
        }
        return;
    }

    setmaxnreg_consumer<NCONS>();
    const int warp = tid / 32, lane = tid % 32, q = lane % 4;
    const int lrow = 64 * wg + 16 * warp + lane / 4;   // this thread's rows lrow, lrow + 8 of the tile
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;

    // slice j's scales for this thread: its rows' (a.x .. a.w: slices 0-3) times the slice's block scales
    auto promote_from = [&](const float (&tmp)[R], int st, int j, float a0, float a1) {
        SliceScales<NB> sc;
        sc.a0 = a0;
        sc.a1 = a1;
        if constexpr (SBMODE == SB_BLOCK) {
            const float* b = sb_tiles + st * (SB_BYTES / 4) + j * SBW + sb_off;   // sb_off even: float2 aligned
#pragma unroll
            for (int cb = 0; cb < NB; cb += 2) {
                const float2 v = *reinterpret_cast<const float2*>(b + cb);
                sc.b[cb] = v.x;
                sc.b[cb + 1] = v.y;
            }
        } else {
#pragma unroll
            for (int cb = 0; cb < NB; ++cb) sc.b[cb] = 1.f;
        }
        promote(acc, tmp, sc);
    };
    auto comp = [](const float4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; };

    int stage = 0;
    uint32_t phase = 0;
    float tmp[TWO ? 2 : 1][R];
    // one turn: NS stages' 4 NS slices; slice i into tmp[i & 1] (TWO) while slice i-1 is promoted
    auto turn = [&](auto ns_tag) {
        constexpr int NS = decltype(ns_tag)::value;
        int st[NS];
        float4 a0v[NS], a1v[NS];
#pragma unroll
        for (int si = 0; si < NS; ++si) {
            st[si] = stage;
            mbar_wait(ring.full(stage), phase);
            if (++stage == STAGES) stage = 0, phase ^= 1;
            a0v[si] = *reinterpret_cast<const float4*>(sa_tiles + st[si] * (SA_BYTES / 4) + 4 * lrow);
            a1v[si] = *reinterpret_cast<const float4*>(sa_tiles + st[si] * (SA_BYTES / 4) + 4 * (lrow + 8));
            __syncwarp();                              // converged for the .aligned wgmma instructions
            const uint64_t da = sw128_desc(a_smem + st[si] * A_BYTES + wg * 64 * BK);
            const uint64_t db = sw128_desc(b_smem + st[si] * B_BYTES);
#pragma unroll
            for (int j = 0; j < SLICES; ++j) {
                const int i = si * SLICES + j;
                float(&cur)[R] = tmp[TWO ? (i & 1) : 0];
                wgmma_fence();
                fence_regs(cur);
                wgmma_e4m3<BN>(cur, da + 2 * j, db + 2 * j);   // + 32 bytes a slice (>> 4)
                wgmma_commit();
                if constexpr (TWO) {
                    if (i == 0) continue;
                    wgmma_wait<1>();                   // slice i-1 done; slice i runs on the tensor cores
                    const int ps = (i - 1) / SLICES, pj = (i - 1) % SLICES;
                    float(&prev)[R] = tmp[(i - 1) & 1];
                    fence_regs(prev);
                    promote_from(prev, st[ps], pj, comp(a0v[ps], pj), comp(a1v[ps], pj));
                    if (pj == SLICES - 1 && lane == 0) mbar_arrive(ring.empty(st[ps]));   // its last slice
                } else {
                    // one temporary: wait for this slice (the other consumer's wgmmas fill the tensor cores)
                    wgmma_wait<0>();
                    fence_regs(cur);
                    promote_from(cur, st[si], j, comp(a0v[si], j), comp(a1v[si], j));
                    if (j == SLICES - 1 && lane == 0) mbar_arrive(ring.empty(st[si]));
                }
            }
        }
        if constexpr (TWO) {
            wgmma_wait<0>();
            float(&last)[R] = tmp[(NS * SLICES - 1) & 1];
            fence_regs(last);
            promote_from(last, st[NS - 1], SLICES - 1, comp(a0v[NS - 1], SLICES - 1), comp(a1v[NS - 1], SLICES - 1));
            if (lane == 0) mbar_arrive(ring.empty(st[NS - 1]));
        }
    };
    int kb = t.kb0;
    for (; kb + PIPE <= t.kb1; kb += PIPE) turn(std::integral_constant<int, PIPE>{});
    if constexpr (PIPE == 2) {
        if (kb < t.kb1) turn(std::integral_constant<int, 1>{});
    }

    store_tile<R, SBMODE, SPLITK>(acc, t.m0 + lrow, t.m_end, t.n0, q, M, N,
                                  sb_row + static_cast<int64_t>(t.expert) * N, c, ws);
}

}  // namespace fp8sm90

// Entry points (C names for cuModuleGetFunction). Launch: grid (ceil(M/BM) * ceil(N/BN), splits; CLUSTER 2:
// tiles_m rounded up to even, tmap_b's box BN / 2 rows; __cluster_dims__ makes cuLaunchKernel launch clusters), block
// 128 * (NCONS + 1), dynamic shared memory 1024 + STAGES * (BM + BN) * 128 + 16 * STAGES.
// tiles: nullptr (dense: tiles_m = ceil(M / BM)) or int32 [tiles_m, 3], each M tile's (first row, row end,
// expert; -1: unused) with B [E * N, K] and sb [E, ceil(N/32), K/32] / [E * N] (grouped contiguous: rows
// sorted by expert, tiles split at expert boundaries; an A tile may read the next expert's rows, whose
// outputs are not stored). ws: the split-K forms' fp32 [splits, M, N] (else unused); sb_ld: SB_ROWK's
// row length of sbT (else unused).
// (only the CLUSTER 2 forms carry __cluster_dims__: the others stay plain launches)
#define FP8_CLUSTER_ATTR_1
#define FP8_CLUSTER_ATTR_2 __cluster_dims__(2, 1, 1)
#define FP8_GEMM_ENTRY(NAME, BN, STAGES, NCONS, OVERLAP, SBMODE, SPLITK, CLUSTER)                             \
    extern "C" __global__ void FP8_CLUSTER_ATTR_##CLUSTER __launch_bounds__(128 * (NCONS + 1), 1)          \
        NAME(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,        \
             const float* __restrict__ sa, const float* __restrict__ sb, __nv_bfloat16* __restrict__ c,      \
             const int* __restrict__ tiles, float* __restrict__ ws, int M, int N, int K, int tiles_m,       \
             int sb_ld) {                                                                                   \
        fp8sm90::gemm_body<BN, STAGES, NCONS, OVERLAP, fp8sm90::SBMODE, SPLITK, CLUSTER>(                   \
            &tmap_a, &tmap_b, sa, sb, c, tiles, ws, M, N, K, tiles_m, sb_ld);                               \
    }

FP8_GEMM_ENTRY(fp8_gemm_sm90_bn128, 128, 5, 2, true, SB_BLOCK, false, 1)       // the fast form
FP8_GEMM_ENTRY(fp8_gemm_sm90_bm64, 128, 6, 1, true, SB_BLOCK, false, 1)        // one consumer (BM 64): M <= 64
FP8_GEMM_ENTRY(fp8_gemm_sm90_debug, 128, 4, 1, false, SB_BLOCK, false, 1)      // one consumer, no overlap (bisecting aid)
FP8_GEMM_ENTRY(fp8_gemm_sm90_bn192, 192, 5, 2, false, SB_BLOCK, false, 1)      // wide tile, one temporary per consumer
FP8_GEMM_ENTRY(fp8_gemm_sm90_bn128_splitk, 128, 5, 2, true, SB_BLOCK, true, 1) // decode sizes: 64 < M <= 128
FP8_GEMM_ENTRY(fp8_gemm_sm90_bm64_splitk, 128, 6, 1, false, SB_BLOCK, true, 1) // decode sizes: M <= 64 (one temporary:
                                                                            // two spill with split-K)
FP8_GEMM_ENTRY(fp8_gemm_sm90_bn128_mc2, 128, 5, 2, true, SB_BLOCK, false, 2)  // 2-CTA clusters sharing B
FP8_GEMM_ENTRY(fp8_gemm_sm90_bn192_mc2, 192, 5, 2, false, SB_BLOCK, false, 2)
FP8_GEMM_ENTRY(fp8_gemm_sm90_bn128_row, 128, 5, 2, true, SB_ROW, false, 1)     // [N, 1] row scales (MoE stacks)
FP8_GEMM_ENTRY(fp8_gemm_sm90_bm64_row, 128, 6, 1, true, SB_ROW, false, 1)
FP8_GEMM_ENTRY(fp8_gemm_sm90_bn128_rowk, 128, 5, 2, false, SB_ROWK, false, 1)  // [N, K/32] per-(row, 32) scales
FP8_GEMM_ENTRY(fp8_gemm_sm90_bm64_rowk, 128, 6, 1, false, SB_ROWK, false, 1)

// The scale-tile forms: tmap_sa over sa [M, K/32] f32, box (4, BM); tmap_sb over sbT [K/32, ld] f32, box
// (sb_tile_cols(BN), 4) (SB_BLOCK; a placeholder map for SB_ROW); sb_row: SB_ROW's [E * N] row scales (else
// unused). K a multiple of 128. Dynamic shared memory 1024 + STAGES * ((BM + BN) * 128 + ts_stage_scale_bytes)
// + 16 * STAGES.
#define FP8_GEMM_TS_ENTRY(NAME, BN, STAGES, NCONS, PIPE, SBMODE, SPLITK)                                     \
    extern "C" __global__ void __launch_bounds__(128 * (NCONS + 1), 1)                                        \
        NAME(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,          \
             const __grid_constant__ CUtensorMap tmap_sa, const __grid_constant__ CUtensorMap tmap_sb,        \
             const float* __restrict__ sb_row, __nv_bfloat16* __restrict__ c, const int* __restrict__ tiles,   \
             float* __restrict__ ws, int M, int N, int K, int tiles_m) {                                      \
        fp8sm90::gemm_body_ts<BN, STAGES, NCONS, PIPE, fp8sm90::SBMODE, SPLITK>(                              \
            &tmap_a, &tmap_b, &tmap_sa, &tmap_sb, sb_row, c, tiles, ws, M, N, K, tiles_m);                    \
    }

FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bn128_ts, 128, 5, 2, 2, SB_BLOCK, false)
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bn128_ts1, 128, 5, 2, 1, SB_BLOCK, false)     // turns of one stage
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bn192_ts, 192, 4, 2, 1, SB_BLOCK, false)
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bm64_ts, 128, 6, 1, 2, SB_BLOCK, false)
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bn128_ts_splitk, 128, 5, 2, 2, SB_BLOCK, true)
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bn128_row_ts, 128, 5, 2, 2, SB_ROW, false)
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bm64_row_ts, 128, 6, 1, 2, SB_ROW, false)
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bm192_ts, 128, 4, 3, 1, SB_BLOCK, false)     // three consumers, one temporary each
FP8_GEMM_TS_ENTRY(fp8_gemm_sm90_bm192_row_ts, 128, 4, 3, 1, SB_ROW, false)

// fp8_splitk_reduce (the split-K forms' second launch) is in sm90_common.cuh.
