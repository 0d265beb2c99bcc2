// Matrix products with weights kept in their GGUF block formats (gguf_blocks.h), on the CPU:
//   y[M, N] (+)= x[M, K] · W[N, K]^T
// x float32 rows (row stride x_stride floats, contiguous over K); W as N rows of
// K / block_elems blocks, the GGUF byte layout (row stride w_stride bytes, so a row slice or
// a K slice at block boundaries of a bigger tensor is a plain pointer + stride); y float32
// (row stride y_stride floats), overwritten or, with `accumulate`, added to.
//
// Arithmetic: each weight is decoded in registers to exactly the float32 value
// gguf.quants.dequantize gives (gguf_blocks.h) and multiplied into float32 accumulators with
// fused multiply-adds, so the result is dequantize-then-float32-matmul up to the order of the
// summation (direct: W lanes of K / W terms each, then a lane tree; strips: one running sum
// per KC chunk of K, then the chunks' sums). No activation quantization.
//
// Two drivers:
//   direct (M <= DIRECT_ROWS, decode; gguf_gemv.h): each tile decodes up to 4 weight rows in
//     registers straight from the blocks and multiplies them into all the x rows at once;
//     threads take contiguous ranges of rows, so every weight byte is streamed from memory
//     once, in address order (with software prefetch a few rows ahead).
//   strips (more rows; gguf_gemm.h): x is packed transposed once per call; a strip of RN
//     weight rows × KC elements is decoded once into a per-thread float stage and multiplied
//     by all x rows, MV = NVM * W at a time (NVM = 1 up to W rows, else 2); threads split
//     the strips.
// Threads: one OpenMP parallel region per call when the work reaches PARALLEL_WORK, on
// torch's intra-op threads (the library links the OpenMP runtime torch has loaded). With
// num_threads = 0 the call is one step of an enclosing parallel region (cpu_decoder.cpp):
// every thread of that team calls it with the same arguments and the driver's rows or units
// are shared among them (orphaned worksharing loops, the last ending in its barrier).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>  // cpu_simd.h: 16-bit loads; gguf_blocks.h: byte widening
#endif

#include "cpu_dtypes.h"

namespace {

#include "cpu_simd.h"
#include "gguf_blocks.h"
#include "gguf_gemv.h"
#include "gguf_gemm.h"

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
// later calls; slot 0: xᵀ tiles (the caller's thread), 1: a decode stage (each thread).
float* thread_buffer(int slot, int64_t size) {
    thread_local std::vector<float> buffers[2];
    std::vector<float>& b = buffers[slot];
    if (b.size() < static_cast<size_t>(size)) b.resize(static_cast<size_t>(size));
    return b.data();
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
// Called by every thread of a parallel region (or by one thread outside any); xᵀ lives in
// the buffer of whichever thread takes the `single`, shared with the others.
template <class Q, int NVM>
void strip_units(const Args& a) {
    constexpr int MV = NVM * W, RN = ACC / NVM;
    const int64_t tiles = (a.m + MV - 1) / MV, strips = (a.n + RN - 1) / RN;
    const int64_t block = std::max<int64_t>(1, X_BLOCK_BYTES / (MV * a.k * 4));
    const int64_t units = (tiles + block - 1) / block * strips;
    float* xt = nullptr;
#pragma omp single copyprivate(xt)
    xt = thread_buffer(0, tiles * MV * a.k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
        pack_xt<MV>(a.x, a.x_stride, a.m, t * MV, a.k, xt + t * MV * a.k);
    float* const stage = thread_buffer(1, RN * std::min(KC, a.k));
#pragma omp for schedule(static, 1)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t t0 = u / strips * block;
        strip_unit<Q, NVM>(a, u % strips * RN, t0, std::min(tiles, t0 + block), xt, stage);
    }
}

#include "gguf_a8.h"

// The driver for the row count, called by every thread of a parallel region (or by one
// thread outside any).
template <class Q>
void drive(const Args& a) {
    if (a.m <= DIRECT_ROWS) direct_groups<Q>(a);
    else if (a.m <= W) strip_units<Q, 1>(a);
    else strip_units<Q, 2>(a);
}

}  // namespace

extern "C" {

// Status: 0, or 1 for bad sizes (K not a whole number of blocks, negative sizes), 2 for a
// GGML type without a kernel here.
__attribute__((visibility("default")))
int gguf_matmul(int qtype, const void* w, int64_t w_stride, const float* x, int64_t x_stride,
                float* y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int accumulate,
                int num_threads) {
    if (m < 0 || n < 0 || k <= 0 || num_threads < 0) return 1;
    const Args a{static_cast<const uint8_t*>(w), w_stride, x, x_stride, y, y_stride, m, n, k,
                 accumulate != 0};
    const bool parallel = num_threads > 1 && m * n * k >= PARALLEL_WORK;
    int status = 0;
    if (qtype & A8_FLAG) {
        const bool known = with_a8_type(qtype & ~A8_FLAG, [&]<class Q>() {
            if (k % A8_BLOCK) status = 1;
            else if (m == 0 || n == 0) return;
            else if (num_threads == 0) a8_drive<Q>(a);
            else {
#pragma omp parallel num_threads(num_threads) if (parallel)
                a8_drive<Q>(a);
            }
        });
        return known ? status : 2;
    }
    const bool known = with_type(qtype, [&]<class Q>() {
        if (k % Q::kElems) status = 1;
        else if (m == 0 || n == 0) return;
        else if (num_threads == 0) drive<Q>(a);  // a step of the caller's region
        else {
#pragma omp parallel num_threads(num_threads) if (parallel)
            drive<Q>(a);
        }
    });
    return known ? status : 2;
}

// out[N, K] (row stride out_stride floats) = the weights decoded to float32.
__attribute__((visibility("default")))
int gguf_dequantize(int qtype, const void* w, int64_t w_stride, float* out, int64_t out_stride,
                    int64_t n, int64_t k) {
    if (n < 0 || k <= 0) return 1;
    int status = 0;
    const bool known = with_type(qtype, [&]<class Q>() {
        if (k % Q::kElems) { status = 1; return; }
        for (int64_t r = 0; r < n; ++r)
            decode_range<Q>(static_cast<const uint8_t*>(w) + r * w_stride, 0, k,
                            out + r * out_stride);
    });
    return known ? status : 2;
}

// x [M, K] (row stride x_stride floats) quantized as the 8-bit-activation products do
// (gguf_a8.h): q int8 [M, K], d and s float [M, K / 32], contiguous. For tests.
__attribute__((visibility("default")))
int gguf_quantize_q8(const float* x, int64_t x_stride, int64_t m, int64_t k, int8_t* q,
                     float* d, float* s) {
    if (m < 0 || k <= 0 || k % A8_BLOCK) return 1;
    const int64_t nb = k / A8_BLOCK;
    for (int64_t r = 0; r < m; ++r)
        quantize_row(x + r * x_stride, nb, q + r * k, d + r * nb, s + r * nb);
    return 0;
}

// The 8-bit-activation ISA (0 scalar, 1 AVX2, 2 VNNI): request < 0 returns the one in use;
// else selects `request` if the build and the CPU have it (returns it), or returns -1.
__attribute__((visibility("default"))) int gguf_a8_isa(int request) {
    if (request < 0) return a8_isa();
    if (request > a8_detect()) return -1;
    g_a8_isa.store(request);
    return request;
}

// Floats per SIMD vector this build uses (16: AVX-512, 8: AVX2, 4: baseline); for tests.
__attribute__((visibility("default"))) int gguf_simd_width() { return W; }

}  // extern "C"
