// vdpbf16ps units of cpu_paged_attention.cpp for bfloat16 caches where the build target has
// AVX512-BF16: q · k and p · V multiply bf16 pairs into float32 sums (one instruction per 32
// elements instead of widening each 16 to float32 and a multiply-add). Included inside the
// .cpp's anonymous namespace, after cpu_paged_attention_rows.h.
//
// Exactness: q and k are the cache's bf16 values, so each product is exact in float32 (the
// widened path's too); only the summation order differs. p (a probability in [0, 1]) is
// rounded to bf16 for p · V (relative error <= 2^-9 per weight, the output's own rounding);
// the softmax's sum keeps the float32 p. Head dims must be multiples of 32 (kBf16DotDims).
#pragma once

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif
constexpr int kBf16DotDims = 32;  // elements per vdpbf16ps: one block of columns

#if defined(__AVX512BF16__)
// Lane t = q · k_t (unscaled) for the 16 keys at rows off[t] of the cache, t < n; 0 for
// t >= n (never read). q: dim bf16, dim a multiple of 32.
SIMD_INLINE Vec key_dots_bf16(const bf16* q, const bf16* cache, const int64_t* off, int n,
                              int dim) {
    Vec acc[W];
#pragma GCC unroll 16
    for (int t = 0; t < W; ++t) {
        __m512 a = _mm512_setzero_ps();
        if (t < n) {
            const bf16* k = cache + off[t];
            for (int c = 0; c < dim; c += kBf16DotDims)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + c),
                                     (__m512bh)_mm512_loadu_si512(k + c));
        }
        acc[t] = (Vec)a;
    }
    return sum_lanes(acc);
}

// Pair layout: vpunpck{l,h}wd of V rows t and t + 1 (32 columns each) pairs column c of both
// per dword, in 128-bit lanes: the low half holds columns 8L + i, the high half 8L + 4 + i at
// dword 4L + i (L < 4, i < 4). kToPairs[h][j] = the column (0-31) of dword j of half h;
// kFromPairs[h][c] = where column 16h + c sits ((half << 4) | dword), for permutex2var.
struct PairIndex {
    int to[2][16], from[2][16];
    constexpr PairIndex() : to(), from() {
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 16; ++j) {
                const int c = 8 * (j / 4) + 4 * h + j % 4;
                to[h][j] = c;
                from[c / 16][c % 16] = (h << 4) | j;
            }
    }
};
constexpr PairIndex kPairs{};

inline __m512i pair_index(const int (&idx)[16]) {
    return _mm512_loadu_si512(idx);
}

// a_r = a_r * alpha[r] + sum_{t < vis[r]} p_r[t] v_t for columns [col, col + 32) of rows
// a + r * a_stride (fp32), p + r * KC; keys two at a time. A key pair's second row is read
// only if some row sees it (t + 1 < vis[R - 1]: a computed value of the tile), and a row
// that sees t but not t + 1 gets the pair with zeros for t + 1 (its 0 * inf would be NaN).
template <int R>
void accumulate_block_bf16(const bf16* cache, const int64_t* off, const int* vis,
                           const uint32_t (&pw)[R][KC / 2], const float* alpha, int col,
                           float* a, int64_t a_stride) {
    const __m512i to_lo = pair_index(kPairs.to[0]), to_hi = pair_index(kPairs.to[1]);
    __m512 acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        float* row = a + r * a_stride + col;
        const __m512 n0 = _mm512_loadu_ps(row), n1 = _mm512_loadu_ps(row + 16);
        const __m512 scale = _mm512_set1_ps(alpha[r]);
        acc[r][0] = _mm512_mul_ps(_mm512_permutex2var_ps(n0, to_lo, n1), scale);
        acc[r][1] = _mm512_mul_ps(_mm512_permutex2var_ps(n0, to_hi, n1), scale);
    }
    const int end = vis[R - 1];
    for (int t = 0; t < end; t += 2) {
        const __m512i v0 = _mm512_loadu_si512(cache + off[t] + col);
        const __m512i v1 = t + 1 < end ? _mm512_loadu_si512(cache + off[t + 1] + col)
                                       : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            if (t >= vis[r]) continue;
            const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[r][t / 2]));
            if (t + 1 < vis[r]) {
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], lo, p);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], hi, p);
            } else {  // the causal edge of a prefill tile: key t alone
                const __m512i zero = _mm512_setzero_si512();
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_unpacklo_epi16(v0, zero), p);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_unpackhi_epi16(v0, zero), p);
            }
        }
    }
    const __m512i from0 = pair_index(kPairs.from[0]), from1 = pair_index(kPairs.from[1]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        float* row = a + r * a_stride + col;
        _mm512_storeu_ps(row, _mm512_permutex2var_ps(acc[r][0], from0, acc[r][1]));
        _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps(acc[r][0], from1, acc[r][1]));
    }
}

// accumulate() (cpu_paged_attention_rows.h) for bf16 V over all of head_dim (a multiple of
// 32): p rows rounded to bf16 pairs once per chunk (dword t / 2 = keys t, t + 1).
template <int R>
void accumulate_bf16(const bf16* cache, const int64_t* off, const int* vis, const float* p,
                     const float* alpha, int dim, float* a, int64_t a_stride) {
    uint32_t pw[R][KC / 2];
    static_assert(KC == 16, "one 16-float vector of p per row");
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw[r]),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * KC)));
    for (int col = 0; col < dim; col += kBf16DotDims)
        accumulate_block_bf16<R>(cache, off, vis, pw, alpha, col, a, a_stride);
}
#endif
