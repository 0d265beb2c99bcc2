// 8-bit-activation products of gguf_matmul.cpp (qtype | A8_FLAG): llama.cpp's arithmetic for
// the GGUF block types (the 32-element ones and the K-quants Q4_K, Q5_K, Q6_K, seen as blocks
// of 32 with their sub-block scales: gguf_a8_types.h), NOT exact. Included inside gguf_matmul.cpp's anonymous
// namespace, after gguf_blocks.h, Args, with_rows and thread_buffer.
//
// Activations: each row of x is cut into blocks of 32 and quantized as llama.cpp's Q8_0 /
// Q8_1 do, with float32 scales (llama.cpp rounds d and s to float16):
//   amax = max |x_e|, d = amax / 127, a_e = round_half_even(x_e * (1 / d)) (0 when d = 0),
//   s = d * Σ a_e (Q8_1's second field, for the types with an offset m).
// Products per weight block of 32 (weights w_e = dw * q_e [+ m] as in gguf_blocks.h):
//   Σ w_e x̂_e = dw * d * Σ q_e a_e  [+ m * s]
// (Q6_K: dw * d * Σ_{e<16} q_e a_e + dw2 * d * Σ_{e>=16} q_e a_e)
// with Σ q_e a_e an exact integer sum (Q4_0, Q5_0, Q8_0, Q6_K: signed q, |q| against
// sign(a, q); Q4_1, Q5_1, Q4_K, Q5_K: unsigned q against a). Integer lanes: VNNI `vpdpbusd` (4 u8·s8 products per
// int32 lane, no saturation) or AVX2 `vpmaddubsw` + `vpmaddwd` (pairs into int16: at most
// 2 * 128 * 127 < 2^15, so never saturates); each block's 8 int32 lanes go to float and into
// float accumulators scaled by dw * d, lanes summed after K. The result is the float64
// product of the quantized-dequantized x and the exact weights up to float32 rounding.
//
// ISA: chosen at run time (a8_isa: the CPU's best compiled-in variant, lowered by
// DELTASERVE_GGUF_A8_ISA=avx2|scalar or gguf_a8_isa()); builds without AVX2 have the scalar
// variant only.
#pragma once

constexpr int A8_FLAG = 0x100;  // qtype bit: 8-bit activations
constexpr int A8_BLOCK = 32;
enum A8Isa { A8_SCALAR = 0, A8_AVX2 = 1, A8_VNNI = 2 };
#if defined(__AVX512F__)
constexpr int A8_ROWS = 4;  // x rows per tile (32 vector registers)
#else
constexpr int A8_ROWS = 2;  // 16 registers
#endif
constexpr int A8_NR = 4;                         // weight rows per tile
constexpr int64_t A8_X_BLOCK_BYTES = 256 << 10;  // quantized x rows per unit, ~this many bytes

// Quantized activation rows: q int8 [m][k], d and s float [m][k / 32].
struct A8Rows {
    const int8_t* q; const float* d; const float* s;
    int64_t k, nb;
};

// One block of 32 (see the header comment). The AVX2 form gives the same bits: the maximum
// and the integer sum do not depend on the order, and vcvtps2dq rounds half to even under
// the default MXCSR as nearbyint does; |x * id| <= 127 (1 + 3u) rounds to at most 127, so
// the saturating packs never saturate.
inline void quantize_block(const float* x, int8_t* q, float& d, float& s) {
#if defined(__AVX2__)
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4];
    __m256 vmax = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v[j], abs_mask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    d = _mm_cvtss_f32(h) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i n[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]),
                                             _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6,
                                                                             3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]),
                                       _mm256_add_epi32(n[2], n[3]));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 1));
    s = d * static_cast<float>(_mm_cvtsi128_si32(u));
#else
    float amax = 0.0f;
    for (int e = 0; e < A8_BLOCK; ++e) amax = std::max(amax, std::fabs(x[e]));
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int e = 0; e < A8_BLOCK; ++e) {
        const int v = static_cast<int>(std::nearbyint(x[e] * id));
        q[e] = static_cast<int8_t>(v);
        sum += v;
    }
    s = d * static_cast<float>(sum);
#endif
}

inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
    for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + b * A8_BLOCK, q + b * A8_BLOCK, d[b], s[b]);
}

#include "gguf_a8_types.h"

// The VNNI variant is compiled where the compiler targets it (256-bit vpdpbusd from
// AVX512-VNNI + VL, or AVX-VNNI) and used where the CPU reports it.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define A8_HAVE_VNNI 1
inline bool a8_cpu_vnni() {
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}
inline __m256i dpbusd(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVXVNNI__)
#define A8_HAVE_VNNI 1
inline bool a8_cpu_vnni() { return __builtin_cpu_supports("avxvnni"); }
inline __m256i dpbusd(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#endif

int a8_detect() {
    int best = A8_SCALAR;
#if defined(__AVX2__)
    if (__builtin_cpu_supports("avx2")) best = A8_AVX2;
#endif
#if defined(A8_HAVE_VNNI)
    if (best == A8_AVX2 && a8_cpu_vnni()) best = A8_VNNI;
#endif
    return best;
}
std::atomic<int> g_a8_isa{-1};
int a8_isa() {
    int isa = g_a8_isa.load(std::memory_order_relaxed);
    if (isa >= 0) return isa;
    isa = a8_detect();
    if (const char* env = std::getenv("DELTASERVE_GGUF_A8_ISA")) {
        if (!std::strcmp(env, "avx2")) isa = std::min<int>(isa, A8_AVX2);
        else if (!std::strcmp(env, "scalar")) isa = A8_SCALAR;
    }
    g_a8_isa.store(isa, std::memory_order_relaxed);
    return isa;
}

// out[m * NR + r] = x row m0 + m · weight row r (r < valid; rows past it repeat the last).
// `ahead`: bytes past each block to prefetch (the rows of a later tile; SIMD variants).
template <class Q, int R, int NR>
void a8_tile_scalar(const uint8_t* const (&w)[NR], const A8Rows& x, int64_t m0,
                    float (&out)[R * NR]) {
    float acc[R * NR] = {};
    for (int64_t b = 0; b < x.nb; ++b) {
        const int j = static_cast<int>(b % Q::kSub);
        for (int r = 0; r < NR; ++r) {
            const uint8_t* blk = w[r] + b / Q::kSub * Q::kBytes;
            int8_t q[32];
            Q::quants(blk, j, q);
            const float dw = Q::dw(blk, j), dw2 = Q::dw2(blk, j), mw = Q::m(blk, j);
            for (int m = 0; m < R; ++m) {
                const int64_t i = (m0 + m) * x.nb + b;
                const int8_t* a = x.q + i * A8_BLOCK;
                int sum = 0, sum2 = 0;
                for (int e = 0; e < A8_BLOCK / 2; ++e) sum += q[e] * a[e];
                for (int e = A8_BLOCK / 2; e < A8_BLOCK; ++e) sum2 += q[e] * a[e];
                if constexpr (Q::kSplit)
                    acc[m * NR + r] += x.d[i] * (dw * static_cast<float>(sum) +
                                                 dw2 * static_cast<float>(sum2));
                else acc[m * NR + r] += dw * x.d[i] * static_cast<float>(sum + sum2);
                if constexpr (Q::kOffset) acc[m * NR + r] += mw * x.s[i];
            }
        }
    }
    for (int i = 0; i < R * NR; ++i) out[i] = acc[i];
}

#if defined(__AVX2__)
template <int I>
SIMD_INLINE __m256i dot_us(__m256i u, __m256i s) {  // 8 lanes of 4 u8 · s8 products each
#if defined(A8_HAVE_VNNI)
    if constexpr (I == A8_VNNI) return dpbusd(u, s);
#endif
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

template <class Q, int I, int R, int NR>
SIMD_INLINE void a8_tile_simd(const uint8_t* const (&w)[NR], const A8Rows& x, int64_t m0,
                              int64_t ahead, float (&out)[R * NR]) {
    __m256 acc[R * NR];
    float off[R * NR] = {};
#pragma GCC unroll 16
    for (int i = 0; i < R * NR; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
        __m256i q[NR], u[NR];  // quants; u: what goes in unsigned (|q| for signed types)
        __m256 dw[NR];         // int32 lanes 0-3 hold elements 0-15, lanes 4-7 16-31
        float mw[NR];
        const int j = static_cast<int>(b % Q::kSub);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
            const uint8_t* blk = w[r] + b / Q::kSub * Q::kBytes;
            if (Q::kSub == 1 || j == 0) __builtin_prefetch(blk + ahead);
            if constexpr (Q::kSub > 1) {  // a super-block spans several cache lines
                if (j == 0) __builtin_prefetch(blk + ahead + 64);
                if (j == 0) __builtin_prefetch(blk + ahead + 128);
                if (j == 0 && Q::kBytes > 192) __builtin_prefetch(blk + ahead + 192);
            }
            q[r] = Q::quants_v(blk, j);
            u[r] = Q::kSigned ? _mm256_sign_epi8(q[r], q[r]) : q[r];
            if constexpr (Q::kSplit)
                dw[r] = _mm256_set_m128(_mm_set1_ps(Q::dw2(blk, j)), _mm_set1_ps(Q::dw(blk, j)));
            else dw[r] = _mm256_set1_ps(Q::dw(blk, j));
            mw[r] = Q::m(blk, j);
        }
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) {
            const int64_t i = (m0 + m) * x.nb + b;
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * 32));
            const __m256 d = _mm256_broadcast_ss(x.d + i);
#pragma GCC unroll 8
            for (int r = 0; r < NR; ++r) {
                const __m256i s = Q::kSigned ? _mm256_sign_epi8(a, q[r]) : a;
                const __m256 p = _mm256_cvtepi32_ps(dot_us<I>(u[r], s));
                acc[m * NR + r] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw[r], d), acc[m * NR + r]);
                if constexpr (Q::kOffset) off[m * NR + r] += mw[r] * x.s[i];
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R * NR; ++i) out[i] = hsum8(acc[i]) + off[i];
}
#endif

// The tile for the chosen ISA.
template <class Q, int R, int NR>
void a8_tile(int isa, const uint8_t* const (&w)[NR], const A8Rows& x, int64_t m0,
             int64_t ahead, float (&out)[R * NR]) {
#if defined(__AVX2__)
#if defined(A8_HAVE_VNNI)
    if (isa == A8_VNNI) return a8_tile_simd<Q, A8_VNNI, R, NR>(w, x, m0, ahead, out);
#endif
    if (isa == A8_AVX2) return a8_tile_simd<Q, A8_AVX2, R, NR>(w, x, m0, ahead, out);
#endif
    (void)isa, (void)ahead;
    a8_tile_scalar<Q, R, NR>(w, x, m0, out);
}

// A per-thread byte buffer of at least `size` bytes (the quantized x of the thread that
// takes the `single`, shared with its team), 64-byte aligned.
uint8_t* a8_buffer(int64_t size) {
    thread_local std::vector<uint64_t> buffer;
    const size_t words = static_cast<size_t>(size + 64) / 8;
    if (buffer.size() < words) buffer.resize(words);
    const auto p = reinterpret_cast<uintptr_t>(buffer.data());
    return reinterpret_cast<uint8_t*>((p + 63) & ~static_cast<uintptr_t>(63));
}

// Many rows (gguf_a8_rows.h), x rows in lanes: a tile of MV x rows (16 with 512-bit VNNI, 8
// with AVX2) is packed per block as 8 chunks of [MV rows][4 bytes] (elements 4c..4c+3 of each
// row, as unsigned a + 128), then d[MV], s[MV]; a strip of ZRN weight rows is decoded once
// into a stage of signed bytes per block (and dw, m, -128 Σq per row and block). Then per
// (weight row, block): 8 vpdpbusd (or vpmaddubsw pairs) with the row's 4 bytes broadcast
// against the tile's chunks sum Σ (a + 128) q for all MV x rows at once, starting from
// -128 Σ q, so the int32 lanes hold Σ a q exactly; one conversion and one fused multiply-add
// by dw * d per 32 * MV products.
#if defined(__AVX2__)
#include "gguf_a8_rows.h"
#endif

// The 8-bit-activation driver, called by every thread of a parallel region (or by one thread
// outside any). Many rows: z_drive (AVX2: 4- and 5-bit types). Else x is quantized first: up to
// A8_ROWS rows (decode) by every thread for itself (no barrier; a few K bytes), more by the
// team into one shared buffer; then units of (block of ~A8_X_BLOCK_BYTES quantized x rows) ×
// (A8_NR weight rows), x-block-major, so a thread's consecutive units reuse its x block from
// L2 while the weights stream.
template <class Q>
void a8_drive(const Args& a) {
    const int64_t nb = a.k / A8_BLOCK;
    const int isa = a8_isa();
#if defined(A8_HAVE_ZMM)
    if (isa == A8_VNNI && a.m > A8_ROWS) return z_drive<Q, 16>(a, nb);  // measured crossover
#endif
#if defined(__AVX2__)
    if (isa >= A8_AVX2 && Q::kMaxAbs <= 32 && a.m > A8_ROWS) return z_drive<Q, 8>(a, nb);
#endif
    const int64_t bytes = a.m * nb * 8 + a.m * a.k;
    uint8_t* buf = nullptr;
    if (a.m <= A8_ROWS) buf = a8_buffer(bytes);
    else {
#pragma omp single copyprivate(buf)
        buf = a8_buffer(bytes);
    }
    float* d = reinterpret_cast<float*>(buf);
    float* s = d + a.m * nb;
    int8_t* q = reinterpret_cast<int8_t*>(s + a.m * nb);
    if (a.m <= A8_ROWS) {
        for (int64_t r = 0; r < a.m; ++r)
            quantize_row(a.x + r * a.x_stride, nb, q + r * a.k, d + r * nb, s + r * nb);
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a.m; ++r)
            quantize_row(a.x + r * a.x_stride, nb, q + r * a.k, d + r * nb, s + r * nb);
    }
    const A8Rows x{q, d, s, a.k, nb};
    const int64_t groups = (a.n + A8_NR - 1) / A8_NR;
    const int64_t rows = std::max<int64_t>(A8_ROWS, A8_X_BLOCK_BYTES / a.k / A8_ROWS * A8_ROWS);
    const int64_t units = (a.m + rows - 1) / rows * groups;
    // A thread's units are consecutive groups of weight rows (one x block at decode): like
    // the exact direct tile, prefetch the rows PREFETCH_ROWS further on at the same offset
    // (a row is a few hundred bytes, too short for the hardware prefetchers).
    const int64_t ahead = PREFETCH_ROWS * a.w_stride;
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t n0 = unit % groups * A8_NR, x0 = unit / groups * rows;
        const int cols = static_cast<int>(std::min<int64_t>(A8_NR, a.n - n0));
        const uint8_t* w[A8_NR];
        for (int r = 0; r < A8_NR; ++r) w[r] = a.w + (n0 + std::min(r, cols - 1)) * a.w_stride;
        for (int64_t m0 = x0; m0 < std::min(a.m, x0 + rows); m0 += A8_ROWS)
            with_rows<A8_ROWS>(static_cast<int>(std::min<int64_t>(A8_ROWS, a.m - m0)),
                               [&]<int R>() {
                float out[R * A8_NR];
                a8_tile<Q, R, A8_NR>(isa, w, x, m0, ahead, out);
                for (int m = 0; m < R; ++m) {
                    float* y = a.y + (m0 + m) * a.y_stride + n0;
                    for (int r = 0; r < cols; ++r)
                        y[r] = a.accumulate ? y[r] + out[m * A8_NR + r] : out[m * A8_NR + r];
                }
            });
    }
}

