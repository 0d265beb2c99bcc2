// W8A8 products of gguf_matmul.cpp (`--quantization w8a8`; qtype I8 | A8_FLAG): int8 weight
// rows (per-output-channel scales, applied by the caller) times activations quantized per
// token to int8, vLLM's CPU dynamic per-token W8A8. NOT exact. Included inside
// gguf_matmul.cpp's anonymous namespace after gguf_a8.h (a8_isa, a8_buffer, dot lanes).
//
// Activations, per row of x (vLLM's dynamic_scaled_int8_quant, symmetric):
//   scale = amax / 127, a_e = clamp(round_half_even(x_e * (1 / scale)), -127, 127)
// (0 for an all-zero row; vLLM clamps at -128, which |x_e| <= amax never reaches; -127 keeps
// the sign trick below safe). Products:
//   y[m, n] = float(Σ_e a_e w_e) * scale_m        (the caller then multiplies by w_scale[n])
// with the sum an exact int32 (|Σ| <= K * 127 * 127 < 2^31 for K <= W8_MAX_K): the only
// rounding after the activations' is the conversion to float and the multiplication.
//
// Integer lanes (weights in [-127, 127], as quantize_rows makes them):
//   few rows (decode, and every row count on AVX2): weights in lanes along K, |w| against
//     sign(a, w): VNNI vpdpbusd, or AVX2 vpmaddubsw (pairs of |w| |a| <= 2 * 127 * 127 < 2^15:
//     never saturates) + vpmaddwd into int32;
//   many rows with 512-bit VNNI: x rows in lanes (16 per tile, packed as a + 128, unsigned),
//     each weight row's 4 bytes broadcast, the sum started at -128 Σ w (so it is Σ a w).
#pragma once

constexpr int W8_CODE = 24;                   // GGML's I8: the weight rows
constexpr int64_t W8_MAX_K = 131072;          // int32 sums cannot overflow up to here
constexpr int W8_ZMV = 16, W8_ZRN = 8;        // many rows: x rows per tile, weight rows per strip

// One token: q[0..k) and its scale (k a multiple of 32).
inline float w8_quantize_token(const float* x, int64_t k, int8_t* q) {
    float amax = 0.0f;
    int64_t e = 0;
#if defined(__AVX2__)
    __m256 vmax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; e < k; e += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + e), abs_mask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) amax = std::max(amax, v);
#endif
    for (; e < k; ++e) amax = std::max(amax, std::fabs(x[e]));
    const float scale = amax / 127.0f;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    e = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f),
                 hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; e < k; e += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; ++j)  // x * inv clamped, rounded half to even (MXCSR default)
            v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
                _mm256_mul_ps(_mm256_loadu_ps(x + e + 8 * j), vinv), lo), hi));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                                 _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + e),
                            _mm256_permutevar8x32_epi32(bytes, order));
    }
#endif
    for (; e < k; ++e)
        q[e] = static_cast<int8_t>(std::clamp(std::nearbyint(x[e] * inv), -127.0f, 127.0f));
    return scale;
}

// Σ_e a[m]_e w[r]_e for R activation rows (row stride k) and NR weight rows.
template <int R, int NR>
void w8_tile_scalar(const int8_t* const (&w)[NR], const int8_t* a, int64_t k,
                    int32_t (&out)[R * NR]) {
    for (int m = 0; m < R; ++m)
        for (int r = 0; r < NR; ++r) {
            int32_t sum = 0;
            for (int64_t e = 0; e < k; ++e) sum += a[m * k + e] * w[r][e];
            out[m * NR + r] = sum;
        }
}

#if defined(__AVX2__)
template <int I>
SIMD_INLINE __m256i w8_dot_add(__m256i acc, __m256i u, __m256i s) {  // acc + 4 u8·s8 per lane
#if defined(A8_HAVE_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if constexpr (I == A8_VNNI) return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(A8_HAVE_VNNI)
    if constexpr (I == A8_VNNI) return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
}

inline int32_t hsum8_epi32(__m256i v) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i h2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
}

template <int I, int R, int NR>
SIMD_INLINE void w8_tile_simd(const int8_t* const (&w)[NR], const int8_t* a, int64_t k,
                              int32_t (&out)[R * NR]) {
    __m256i acc[R * NR];
#pragma GCC unroll 16
    for (int i = 0; i < R * NR; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t e = 0; e < k; e += 32) {
        __m256i q[NR], u[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) {
            __builtin_prefetch(w[r] + e + 512);
            q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + e));
            u[r] = _mm256_sign_epi8(q[r], q[r]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * k + e));
#pragma GCC unroll 8
            for (int r = 0; r < NR; ++r)
                acc[m * NR + r] = w8_dot_add<I>(acc[m * NR + r], u[r], _mm256_sign_epi8(x, q[r]));
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R * NR; ++i) out[i] = hsum8_epi32(acc[i]);
}
#endif

template <int R, int NR>
void w8_tile(int isa, const int8_t* const (&w)[NR], const int8_t* a, int64_t k,
             int32_t (&out)[R * NR]) {
#if defined(__AVX2__)
#if defined(A8_HAVE_VNNI)
    if (isa == A8_VNNI) return w8_tile_simd<A8_VNNI, R, NR>(w, a, k, out);
#endif
    if (isa == A8_AVX2) return w8_tile_simd<A8_AVX2, R, NR>(w, a, k, out);
#endif
    (void)isa;
    w8_tile_scalar<R, NR>(w, a, k, out);
}

#if defined(A8_HAVE_ZMM)
// Tile t of x (W8_ZMV rows; rows past m zero) quantized and packed: per block of 32, 8 chunks
// of [W8_ZMV rows][4 bytes] as a + 128; the rows' scales at `scales`.
inline void w8_pack(const Args& a, int64_t t, uint8_t* out, float* scales) {
    const int64_t nb = a.k / 32;
    int8_t* q = reinterpret_cast<int8_t*>(a8_buffer(a.k));
    for (int i = 0; i < W8_ZMV; ++i) {
        const int64_t row = t * W8_ZMV + i;
        const bool real = row < a.m;
        scales[i] = real ? w8_quantize_token(a.x + row * a.x_stride, a.k, q) : 0.0f;
        for (int64_t b = 0; b < nb; ++b)
            for (int c = 0; c < 8; ++c) {
                uint32_t v = 0;
                if (real) std::memcpy(&v, q + b * 32 + 4 * c, 4);
                v ^= 0x80808080u;
                std::memcpy(out + b * 32 * W8_ZMV + (c * W8_ZMV + i) * 4, &v, 4);
            }
    }
}

// out[r * 16 + i] = packed x row i · weight row r (W8_ZRN rows), times the row's scale.
SIMD_INLINE void w8_ztile(const uint8_t* xt, const float* scales,
                          const int8_t* const (&w)[W8_ZRN], const int32_t* corr, int64_t nb,
                          float* out) {
    __m512i acc[W8_ZRN];
#pragma GCC unroll 8
    for (int r = 0; r < W8_ZRN; ++r) acc[r] = _mm512_set1_epi32(corr[r]);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = xt + b * 32 * W8_ZMV;
        __m512i x[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) x[c] = _mm512_loadu_si512(p + c * 64);
#pragma GCC unroll 8
        for (int r = 0; r < W8_ZRN; ++r) {
            const int8_t* wb = w[r] + b * 32;
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
                int32_t wv;
                std::memcpy(&wv, wb + 4 * c, 4);
                acc[r] = _mm512_dpbusd_epi32(acc[r], x[c], _mm512_set1_epi32(wv));
            }
        }
    }
    const __m512 s = _mm512_loadu_ps(scales);
#pragma GCC unroll 8
    for (int r = 0; r < W8_ZRN; ++r)
        _mm512_storeu_ps(out + r * 16, _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, acc[r]), s));
}

// Many rows: tiles packed by the team, then units of (block of tiles) × (strip of W8_ZRN
// weight rows), x-block-major; -128 Σ w per strip row computed when the strip changes.
inline void w8_zdrive(const Args& a) {
    const int64_t nb = a.k / 32, tiles = (a.m + W8_ZMV - 1) / W8_ZMV;
    const int64_t strips = (a.n + W8_ZRN - 1) / W8_ZRN, tile_bytes = a.k * W8_ZMV;
    const int64_t block = std::max<int64_t>(1, Z_X_BLOCK_BYTES / tile_bytes);
    const int64_t units = (tiles + block - 1) / block * strips;
    uint8_t* xt = nullptr;
#pragma omp single copyprivate(xt)
    xt = reinterpret_cast<uint8_t*>(
        thread_buffer(0, (tiles * (tile_bytes + 4 * W8_ZMV) + 64) / 4 + 16));
    float* const scales = reinterpret_cast<float*>(xt + tiles * tile_bytes);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) w8_pack(a, t, xt + t * tile_bytes, scales + t * W8_ZMV);
    int32_t corr[W8_ZRN];
    const int8_t* w[W8_ZRN];
    int64_t staged = -1;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n0 = u % strips * W8_ZRN, t0 = u / strips * block;
        const int cols = static_cast<int>(std::min<int64_t>(W8_ZRN, a.n - n0));
        if (staged != n0) {
            for (int r = 0; r < W8_ZRN; ++r) {
                w[r] = reinterpret_cast<const int8_t*>(a.w + std::min(n0 + r, a.n - 1) * a.w_stride);
                int32_t sum = 0;
                for (int64_t e = 0; e < a.k; ++e) sum += w[r][e];
                corr[r] = -128 * sum;
            }
            staged = n0;
        }
        for (int64_t t = t0; t < std::min(tiles, t0 + block); ++t) {
            alignas(64) float out[W8_ZRN * W8_ZMV];
            w8_ztile(xt + t * tile_bytes, scales + t * W8_ZMV, w, corr, nb, out);
            const int rows = static_cast<int>(std::min<int64_t>(W8_ZMV, a.m - t * W8_ZMV));
            for (int i = 0; i < rows; ++i) {
                float* y = a.y + (t * W8_ZMV + i) * a.y_stride + n0;
                for (int r = 0; r < cols; ++r)
                    y[r] = a.accumulate ? y[r] + out[r * W8_ZMV + i] : out[r * W8_ZMV + i];
            }
        }
    }
}
#endif

// The W8A8 driver (every thread of a region calls it, or one thread outside any). Up to
// A8_ROWS rows each thread quantizes x for itself (no barrier); more rows: 512-bit VNNI's
// w8_zdrive, else the team quantizes into one buffer and units of (x block) × (A8_NR weight
// rows) run the lanes-along-K tile.
inline void w8_drive(const Args& a) {
    const int isa = a8_isa();
#if defined(A8_HAVE_ZMM)
    if (isa == A8_VNNI && a.m > A8_ROWS) return w8_zdrive(a);
#endif
    const int64_t bytes = a.m * (a.k + 4) + 64;
    uint8_t* buf = nullptr;
    if (a.m <= A8_ROWS) buf = a8_buffer(bytes);
    else {
#pragma omp single copyprivate(buf)
        buf = a8_buffer(bytes);
    }
    float* scales = reinterpret_cast<float*>(buf);
    int8_t* q = reinterpret_cast<int8_t*>(buf + ((a.m * 4 + 63) & ~int64_t{63}));
    if (a.m <= A8_ROWS) {
        for (int64_t r = 0; r < a.m; ++r)
            scales[r] = w8_quantize_token(a.x + r * a.x_stride, a.k, q + r * a.k);
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a.m; ++r)
            scales[r] = w8_quantize_token(a.x + r * a.x_stride, a.k, q + r * a.k);
    }
    const int64_t groups = (a.n + A8_NR - 1) / A8_NR;
    const int64_t rows = std::max<int64_t>(A8_ROWS, A8_X_BLOCK_BYTES / a.k / A8_ROWS * A8_ROWS);
    const int64_t units = (a.m + rows - 1) / rows * groups;
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t n0 = unit % groups * A8_NR, x0 = unit / groups * rows;
        const int cols = static_cast<int>(std::min<int64_t>(A8_NR, a.n - n0));
        const int8_t* w[A8_NR];
        for (int r = 0; r < A8_NR; ++r)
            w[r] = reinterpret_cast<const int8_t*>(a.w + (n0 + std::min(r, cols - 1)) * a.w_stride);
        for (int64_t m0 = x0; m0 < std::min(a.m, x0 + rows); m0 += A8_ROWS)
            with_rows<A8_ROWS>(static_cast<int>(std::min<int64_t>(A8_ROWS, a.m - m0)),
                               [&]<int R>() {
                int32_t out[R * A8_NR];
                w8_tile<R, A8_NR>(isa, w, q + m0 * a.k, a.k, out);
                for (int m = 0; m < R; ++m) {
                    float* y = a.y + (m0 + m) * a.y_stride + n0;
                    const float s = scales[m0 + m];
                    for (int r = 0; r < cols; ++r) {
                        const float v = static_cast<float>(out[m * A8_NR + r]) * s;
                        y[r] = a.accumulate ? y[r] + v : v;
                    }
                }
            });
    }
}
