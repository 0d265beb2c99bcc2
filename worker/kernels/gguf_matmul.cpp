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
// per KC chunk of K, then the chunks' sums). No activation quantization, except where the
// qtype carries A8_FLAG (not exact): 8 bits per block of 32 for the GGUF block types,
// K-quants included (gguf_a8.h), per token for I8 rows (w8a8.h).
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
#include <type_traits>
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
#include "gguf_drive.h"
#include "gguf_a8.h"
#include "w8a8.h"
#include "dense_blocks.h"
#include "bf16_panels.h"

// drive<Q>, or bf16_panels for bf16 rows at the row counts it takes.
template <class Q>
void drive_dense(const Args& a) {
    if constexpr (std::is_same_v<Q, Dense<bf16>>) {
        if (panels_take(a.m, a.k)) return panels_drive(a);
    }
    drive<Q>(a);
}

}  // namespace

extern "C" {

// Status: 0, or 1 for bad sizes (K not a whole number of blocks, negative sizes), 2 for a
// GGML type without a kernel here. Dense float32, float16 and bfloat16 rows (GGML's F32, F16,
// BF16 codes; dense_blocks.h) run through the same drivers, widened to float32 in registers.
__attribute__((visibility("default")))
int gguf_matmul(int qtype, const void* w, int64_t w_stride, const float* x, int64_t x_stride,
                float* y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int accumulate,
                int num_threads) {
    if (m < 0 || n < 0 || k <= 0 || num_threads < 0) return 1;
    const Args a{static_cast<const uint8_t*>(w), w_stride, x, x_stride, y, y_stride, m, n, k,
                 accumulate != 0};
    const bool parallel = num_threads > 1 && m * n * k >= PARALLEL_WORK;
    int status = 0;
    if (qtype == (W8_CODE | A8_FLAG)) {  // w8a8: per-token int8 activations (w8a8.h)
        if (k % 32 || k > W8_MAX_K) return 1;
        if (m == 0 || n == 0) return 0;
        if (num_threads == 0) w8_drive(a);
        else {
#pragma omp parallel num_threads(num_threads) if (parallel)
            w8_drive(a);
        }
        return 0;
    }
    if (qtype & A8_FLAG) {
        const bool known = with_a8_type(qtype & ~A8_FLAG, [&]<class Q>() {
            if (k % (A8_BLOCK * Q::kSub)) status = 1;
            else if (m == 0 || n == 0) return;
            else if (num_threads == 0) a8_drive<Q>(a);
            else {
#pragma omp parallel num_threads(num_threads) if (parallel)
                a8_drive<Q>(a);
            }
        });
        return known ? status : 2;
    }
    const bool known = with_weight_type(qtype, [&]<class Q>() {
        if (k % Q::kElems) status = 1;
        else if (m == 0 || n == 0) return;
        else if (num_threads == 0) drive_dense<Q>(a);  // a step of the caller's region
        else {
#pragma omp parallel num_threads(num_threads) if (parallel)
            drive_dense<Q>(a);
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

// x [M, K] (row stride x_stride floats) quantized per token as the w8a8 products do (w8a8.h):
// q int8 [M, K] contiguous, scale float [M]. For tests.
__attribute__((visibility("default")))
int gguf_quantize_w8a8(const float* x, int64_t x_stride, int64_t m, int64_t k, int8_t* q,
                       float* scale) {
    if (m < 0 || k <= 0 || k % 32) return 1;
    for (int64_t r = 0; r < m; ++r) scale[r] = w8_quantize_token(x + r * x_stride, k, q + r * k);
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
