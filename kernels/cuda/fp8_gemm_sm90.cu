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

    // Tile: GROUP_M M tiles share each N tile in launch order.
    const int tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x, per_group = GROUP_M * tiles_n;
    const int first_m = (pid / per_group) * GROUP_M;
    const int group_rows = min(tiles_m - first_m, GROUP_M);
    const int pm = first_m + (pid % per_group) % group_rows, pn = (pid % per_group) / group_rows;
    const int n0 = pn * BN;
    const int ks = K / 32, nkb = (K + BK - 1) / BK, nblk32 = (N + 31) / 32;
    // this CTA's K stages [kb0, kb1): all of them, or split blockIdx.y's equal run
    int kb0 = 0, kb1 = nkb;
    if constexpr (SPLITK) {
        const int per = (nkb + gridDim.y - 1) / gridDim.y;
        kb0 = min(nkb, static_cast<int>(blockIdx.y) * per);
        kb1 = min(nkb, kb0 + per);
    }
    int m0 = pm * BM, m_end = M, expert = 0;
    if (tiles != nullptr) {  // grouped contiguous: (first row, row end, expert) of this M tile
        m0 = tiles[3 * pm];
        m_end = tiles[3 * pm + 1];
        expert = tiles[3 * pm + 2];
        if (expert < 0) return;  // an unused tile: the whole CTA, before any barrier is used
    }

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

        // epilogue, masked: bf16 (round to nearest even), or fp32 partials for split-K
        const bool pairs = (N % 2) == 0;              // 4 / 8-byte aligned pairs
        const float* sb_row = sb + static_cast<int64_t>(expert) * N;   // SB_ROW: [E * N]
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = h == 0 ? r0 : r1;
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
    // neither CTA exits while the peer may still arrive on its barriers (its last releases)
    if constexpr (CLUSTER > 1) cluster_sync();
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

// fp8_splitk_reduce (the split-K forms' second launch) is in sm90_common.cuh.
