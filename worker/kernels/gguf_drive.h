// The two drivers of gguf_matmul.cpp (see there), shared with fused_moe.cpp: `drive<Q>(args)`
// computes y[M, N] (+)= x[M, K] · W[N, K]^T for one GGUF matrix, called by every thread of a
// parallel region (its rows or units shared among them, ending in a barrier) or by one thread
// outside any. Included inside a .cpp's anonymous namespace, after gguf_gemv.h and gguf_gemm.h.
#pragma once

// Up to this many x rows: the direct driver (one pass over the weights; beyond it, a second
// pass costs more than the strips driver's stage, measured on AVX-512 and AVX2).
constexpr int DIRECT_ROWS = DOT_ROWS;
constexpr int PREFETCH_ROWS = 2 * DOT_GROUP;  // direct: prefetch this many weight rows ahead
constexpr int64_t PARALLEL_WORK = 1 << 16;    // M * N * K below this: one thread
constexpr int64_t X_BLOCK_BYTES = 512 << 10;  // strips: xᵀ rows per unit, ~this many bytes

struct Args {
    const uint8_t* w; int64_t w_stride;
    const float* x; int64_t x_stride;
    float* y; int64_t y_stride;
    int64_t m, n, k;
    bool accumulate;
};

// Calls f.template operator()<R>() for a runtime row count 1 <= rows <= Max.
template <int Max, class F>
void with_rows(int rows, F&& f) {
    if constexpr (Max > 1) {
        if (rows < Max) return with_rows<Max - 1>(rows, f);
    }
    f.template operator()<Max>();
}

// y rows [m0, m0 + R) × columns [n0, n0 + NR) (clipped to the matrix; n0 < N) from x rows
// and weight rows n0... of `src`.
template <class Q, int R, int NR>
void direct_tile(const Args& a, const BlockRows<Q>& src, int64_t m0, int64_t n0) {
    const float* x[R];
    for (int m = 0; m < R; ++m) x[m] = a.x + (m0 + m) * a.x_stride;
    const int cols = static_cast<int>(std::min<int64_t>(NR, a.n - n0));
    float out[R * NR];
    dot_tile<Q, R, NR>(src, cols, x, a.k / Q::kElems, out);
    for (int m = 0; m < R; ++m) {
        float* y = a.y + (m0 + m) * a.y_stride + n0;
        for (int r = 0; r < cols; ++r)
            y[r] = a.accumulate ? y[r] + out[m * NR + r] : out[m * NR + r];
    }
}

// Threads take contiguous ranges of DOT_GROUP weight rows; per group, all x rows DOT_ROWS at a
// time (a second pass over the group's rows reads them from L1). Shares the groups among the
// threads of the enclosing parallel region (all of them call it), or runs them all outside one.
template <class Q>
void direct_groups(const Args& a) {
    const int64_t groups = (a.n + DOT_GROUP - 1) / DOT_GROUP;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t m0 = 0; m0 < a.m; m0 += DOT_ROWS)
            with_rows<DOT_ROWS>(static_cast<int>(std::min<int64_t>(DOT_ROWS, a.m - m0)),
                                [&]<int R>() {
                constexpr int NR = dot_tile_rows(R);
                for (int64_t n0 = g * DOT_GROUP; n0 < std::min(a.n, (g + 1) * DOT_GROUP);
                     n0 += NR) {
                    const BlockRows<Q> src{a.w + n0 * a.w_stride, a.w_stride,
                                           PREFETCH_ROWS * a.w_stride};
                    direct_tile<Q, R, NR>(a, src, m0, n0);
                }
            });
    }
}

// A float buffer of at least `size` elements owned by the calling thread and reused by its
// later calls; slot 0: xᵀ tiles (the caller's thread, or each thread's own: bf16_panels.h),
// 1: a decode stage (each thread), 2: a unit's partial sums (each thread:
// fused_moe_grouped.h's panel units).
float* thread_buffer(int slot, int64_t size) {
    thread_local std::vector<float> buffers[3];
    std::vector<float>& b = buffers[slot];
    if (b.size() < static_cast<size_t>(size)) b.resize(static_cast<size_t>(size));
    return b.data();
}

// x's rows as xᵀ tiles of MV rows, `pack(x, x_stride, m, m0, k, tile)` each, the team
// splitting the tiles: returns them, in the buffer of whichever thread takes the `single`,
// shared with the others. Called by every thread of a parallel region (or by one outside).
template <int MV, class Pack>
float* team_packed_xt(const Args& a, Pack pack) {
    const int64_t tiles = (a.m + MV - 1) / MV;
    float* xt = nullptr;
#pragma omp single copyprivate(xt)
    xt = thread_buffer(0, tiles * MV * a.k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
        pack(a.x, a.x_stride, a.m, t * MV, a.k, xt + t * MV * a.k);
    return xt;
}

// y columns [n0, n0 + RN) (clipped to N) × rows of xᵀ tiles [t0, t1), K chunk by K chunk.
template <class Q, int NVM>
void strip_unit(const Args& a, int64_t n0, int64_t t0, int64_t t1, const float* xt,
                float* stage) {
    constexpr int MV = NVM * W, RN = ACC / NVM;
    const int cols = static_cast<int>(std::min<int64_t>(RN, a.n - n0));
    float out[RN * MV];
    for (int64_t k0 = 0; k0 < a.k; k0 += KC) {
        const int64_t kc = std::min(KC, a.k - k0);
        decode_strip<Q, RN>(a.w, a.w_stride, a.n, n0, k0, kc, stage);
        for (int64_t t = t0; t < t1; ++t) {
            strip_tile<NVM, RN>(xt + (t * a.k + k0) * MV, stage, kc, out);
            store_transposed<MV>(out, static_cast<int>(std::min<int64_t>(MV, a.m - t * MV)),
                                 cols, a.y + t * MV * a.y_stride + n0, a.y_stride,
                                 a.accumulate || k0 > 0);
        }
    }
}

// The strips driver with xᵀ tiles of NVM vectors: all x packed first (threads split the
// tiles), then threads split the units (block of xᵀ tiles of ~X_BLOCK_BYTES, which stays in
// L2 across the strips of a unit range, × strip of weight rows). Units go round-robin, so
// the threads work through the same block at the same time and the last block, which may
// be one tile where the others are seven, is shared too (contiguous halves left it to one
// thread: 256 rows of K = 576 ran at 0.6x the speed of 64 rows).
// Called by every thread of a parallel region (or by one thread outside any).
template <class Q, int NVM>
void strip_units(const Args& a) {
    constexpr int MV = NVM * W, RN = ACC / NVM;
    const int64_t tiles = (a.m + MV - 1) / MV, strips = (a.n + RN - 1) / RN;
    const int64_t block = std::max<int64_t>(1, X_BLOCK_BYTES / (MV * a.k * 4));
    const int64_t units = (tiles + block - 1) / block * strips;
    const float* const xt = team_packed_xt<MV>(a, pack_xt<MV>);
    float* const stage = thread_buffer(1, RN * std::min(KC, a.k));
#pragma omp for schedule(static, 1)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t t0 = u / strips * block;
        strip_unit<Q, NVM>(a, u % strips * RN, t0, std::min(tiles, t0 + block), xt, stage);
    }
}

// The driver for the row count, called by every thread of a parallel region (or by one
// thread outside any).
template <class Q>
void drive(const Args& a) {
    if (a.m <= DIRECT_ROWS) direct_groups<Q>(a);
    else if (a.m <= W) strip_units<Q, 1>(a);
    else strip_units<Q, 2>(a);
}
