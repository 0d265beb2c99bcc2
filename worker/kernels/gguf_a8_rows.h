// The many-rows 8-bit-activation driver, x rows in lanes (see gguf_a8.h's comment above its
// #include): MV = 16 rows per tile with 512-bit VNNI, MV = 8 with AVX2 (vpmaddubsw pairs,
// two chunks summed in int16 before vpmaddwd: 4 * 255 * |q| < 2^15 needs |q| <= 32, so the
// 4- and 5-bit types only; Q8_0 keeps the per-block tile there). Included in gguf_a8.h where
// the build has AVX2.
#pragma once

constexpr int ZRN = 8;                               // weight rows per strip
constexpr int64_t Z_X_BLOCK_BYTES = 256 << 10;       // packed tiles per unit, ~this many
// A tile's bytes per block of 32: 8 chunks of [MV rows][4 bytes], then d[MV], s[MV].
constexpr int z_block_bytes(int mv) { return 40 * mv; }

// Tile t of x's rows quantized (quantize_row) and packed into `out` (nb blocks of
// Z_BLOCK_BYTES); rows past m are zeros (a = 0, d = s = 0). Uses the thread's a8_buffer.
template <int ZMV>
void z_pack(const Args& a, int64_t nb, int64_t t, uint8_t* out) {
    int8_t* q = reinterpret_cast<int8_t*>(a8_buffer(a.k + nb * 8));
    float* d = reinterpret_cast<float*>(q + a.k);  // k is a multiple of 32: aligned
    float* s = d + nb;
    for (int i = 0; i < ZMV; ++i) {
        const int64_t row = t * ZMV + i;
        const bool real = row < a.m;
        if (real) quantize_row(a.x + row * a.x_stride, nb, q, d, s);
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* p = out + b * z_block_bytes(ZMV);
            for (int c = 0; c < 8; ++c) {
                uint32_t v = 0;
                if (real) std::memcpy(&v, q + b * 32 + 4 * c, 4);
                v ^= 0x80808080u;  // a + 128 per byte
                std::memcpy(p + (c * ZMV + i) * 4, &v, 4);
            }
            float* ds = reinterpret_cast<float*>(p + 32 * ZMV);
            ds[i] = real ? d[b] : 0.0f;
            ds[ZMV + i] = real ? s[b] : 0.0f;
        }
    }
}

// Stage of weight rows n0.. (ZRN, rows past n repeat the last): per block b and row r, 32
// signed bytes at q + (b * ZRN + r) * 32 and Z_FIELDS floats at f + (b * ZRN + r) * Z_FIELDS:
// {dw, m, -128 Σq (int32 bits), 0}, or for a split type (Q::kSplit: two scales)
// {dw, m, -128 Σq over elements 0-15, dw2, -128 Σq over 16-31, 0, 0, 0}.
constexpr int Z_FIELDS = 8;

inline int32_t z_sum128(__m128i h) {
    const __m128i h2 = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 1)));
}

template <class Q>
void z_stage(const uint8_t* w, int64_t w_stride, int64_t n, int64_t n0, int64_t nb,
             int8_t* q, float* f) {
    for (int r = 0; r < ZRN; ++r) {
        const uint8_t* row = w + std::min(n0 + r, n - 1) * w_stride;
        for (int64_t b = 0; b < nb; ++b) {
            const int j = static_cast<int>(b % Q::kSub);
            const uint8_t* blk = row + b / Q::kSub * Q::kBytes;
            int8_t* qb = q + (b * ZRN + r) * 32;
            const __m256i v = Q::quants_v(blk, j);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), v);
            // Σ q: bytes times 1 in pairs, pairs to int32 (lanes 0-3: elements 0-15).
            const __m256i pairs = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
            const int32_t lo = z_sum128(_mm256_castsi256_si128(pairs));
            const int32_t hi = z_sum128(_mm256_extracti128_si256(pairs, 1));
            float* fb = f + (b * ZRN + r) * Z_FIELDS;
            fb[0] = Q::dw(blk, j);
            fb[1] = Q::m(blk, j);
            const int32_t corr = Q::kSplit ? -128 * lo : -128 * (lo + hi), corr2 = -128 * hi;
            std::memcpy(fb + 2, &corr, 4);
            fb[3] = Q::kSplit ? Q::dw2(blk, j) : 0.0f;
            std::memcpy(fb + 4, &corr2, 4);
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_HAVE_ZMM 1
// out[r * 16 + i] = x row i of the tile · stage row r.
template <bool kOffset, bool kSplit>
SIMD_INLINE void z_tile16(const uint8_t* xt, const int8_t* q, const float* f, int64_t nb,
                        float* out) {
    __m512 acc[ZRN];
#pragma GCC unroll 16
    for (int r = 0; r < ZRN; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = xt + b * z_block_bytes(16);
        __m512i a[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) a[c] = _mm512_loadu_si512(p + c * 64);
        const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(p + 512));
        const __m512 s = _mm512_loadu_ps(reinterpret_cast<const float*>(p + 512) + 16);
#pragma GCC unroll 16
        for (int r = 0; r < ZRN; ++r) {
            const int8_t* qb = q + (b * ZRN + r) * 32;
            const float* fb = f + (b * ZRN + r) * Z_FIELDS;
            int32_t corr, corr2;
            std::memcpy(&corr, fb + 2, 4);
            std::memcpy(&corr2, fb + 4, 4);
            __m512i sum = _mm512_set1_epi32(corr);
            __m512i sum2 = _mm512_set1_epi32(corr2);
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
                int32_t wv;
                std::memcpy(&wv, qb + 4 * c, 4);
                if (kSplit && c >= 4) sum2 = _mm512_dpbusd_epi32(sum2, a[c], _mm512_set1_epi32(wv));
                else sum = _mm512_dpbusd_epi32(sum, a[c], _mm512_set1_epi32(wv));
            }
            // (maskz: GCC 12 warns falsely on the unmasked conversion)
            const __m512 p32 = _mm512_maskz_cvtepi32_ps(0xFFFF, sum);
            acc[r] = _mm512_fmadd_ps(p32, _mm512_mul_ps(d, _mm512_set1_ps(fb[0])), acc[r]);
            if constexpr (kSplit)
                acc[r] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, sum2),
                                         _mm512_mul_ps(d, _mm512_set1_ps(fb[3])), acc[r]);
            if constexpr (kOffset) acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(fb[1]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < ZRN; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
}
#endif

// out[r * 8 + i] = x row i of the tile · stage row r (AVX2; |q| <= 32).
template <bool kOffset, bool kSplit>
SIMD_INLINE void z_tile8(const uint8_t* xt, const int8_t* q, const float* f, int64_t nb,
                         float* out) {
    __m256 acc[ZRN];
#pragma GCC unroll 16
    for (int r = 0; r < ZRN; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = xt + b * z_block_bytes(8);
        __m256i a[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c)
            a[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 32));
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256));
        const __m256 s = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 256) + 8);
#pragma GCC unroll 16
        for (int r = 0; r < ZRN; ++r) {
            const int8_t* qb = q + (b * ZRN + r) * 32;
            const float* fb = f + (b * ZRN + r) * Z_FIELDS;
            int32_t corr, corr2;
            std::memcpy(&corr, fb + 2, 4);
            std::memcpy(&corr2, fb + 4, 4);
            __m256i sum = _mm256_set1_epi32(corr);
            __m256i sum2 = _mm256_set1_epi32(corr2);
#pragma GCC unroll 4
            for (int c = 0; c < 8; c += 2) {
                int32_t w0, w1;
                std::memcpy(&w0, qb + 4 * c, 4);
                std::memcpy(&w1, qb + 4 * c + 4, 4);
                const __m256i p16 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(a[c], _mm256_set1_epi32(w0)),
                    _mm256_maddubs_epi16(a[c + 1], _mm256_set1_epi32(w1)));
                if (kSplit && c >= 4) sum2 = _mm256_add_epi32(sum2, _mm256_madd_epi16(p16, ones));
                else sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, ones));
            }
            const __m256 p32 = _mm256_cvtepi32_ps(sum);
            acc[r] = _mm256_fmadd_ps(p32, _mm256_mul_ps(d, _mm256_set1_ps(fb[0])),
                                     acc[r]);
            if constexpr (kSplit)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum2),
                                         _mm256_mul_ps(d, _mm256_set1_ps(fb[3])), acc[r]);
            if constexpr (kOffset) acc[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(fb[1]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < ZRN; ++r) _mm256_storeu_ps(out + r * 8, acc[r]);
}

// The driver (every thread of a region calls it, or one thread outside any): x's tiles
// quantized and packed (threads split them), then units of (block of tiles of
// ~Z_X_BLOCK_BYTES) × (strip of ZRN weight rows), x-block-major.
template <class Q, int ZMV>
void z_drive(const Args& a, int64_t nb) {
    const int64_t tiles = (a.m + ZMV - 1) / ZMV, strips = (a.n + ZRN - 1) / ZRN;
    const int64_t tile_bytes = nb * z_block_bytes(ZMV);
    const int64_t block = std::max<int64_t>(1, Z_X_BLOCK_BYTES / tile_bytes);
    const int64_t units = (tiles + block - 1) / block * strips;
    uint8_t* xt = nullptr;
#pragma omp single copyprivate(xt)
    xt = reinterpret_cast<uint8_t*>(thread_buffer(0, (tiles * tile_bytes + 64) / 4 + 16));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) z_pack<ZMV>(a, nb, t, xt + t * tile_bytes);
    int8_t* const q = reinterpret_cast<int8_t*>(thread_buffer(1, nb * ZRN * (8 + Z_FIELDS)));
    float* const f = reinterpret_cast<float*>(q + nb * ZRN * 32);
    int64_t staged = -1;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t n0 = u % strips * ZRN, t0 = u / strips * block;
        const int cols = static_cast<int>(std::min<int64_t>(ZRN, a.n - n0));
        if (staged != n0) z_stage<Q>(a.w, a.w_stride, a.n, n0, nb, q, f);
        staged = n0;
        for (int64_t t = t0; t < std::min(tiles, t0 + block); ++t) {
            alignas(64) float out[ZRN * ZMV];
#if defined(A8_HAVE_ZMM)
            if constexpr (ZMV == 16) z_tile16<Q::kOffset, Q::kSplit>(xt + t * tile_bytes, q, f, nb, out);
            else
#endif
            z_tile8<Q::kOffset, Q::kSplit>(xt + t * tile_bytes, q, f, nb, out);
            const int rows = static_cast<int>(std::min<int64_t>(ZMV, a.m - t * ZMV));
            for (int i = 0; i < rows; ++i) {
                float* y = a.y + (t * ZMV + i) * a.y_stride + n0;
                for (int r = 0; r < cols; ++r)
                    y[r] = a.accumulate ? y[r] + out[r * ZMV + i] : out[r * ZMV + i];
            }
        }
    }
}
