// The weight block types of the 8-bit-activation products (gguf_a8.h), as signed or unsigned
// byte quants: byte layouts as in gguf_blocks.h. Included inside gguf_a8.h.
#pragma once

// Per weight type, for its 32-element block j of the stored block at b (kSub blocks of 32
// per stored block of kBytes: 1, or 8 for the K-quants' super-blocks of 256): the scale dw,
// the offset m, and the 32 quants, as int8 for the scalar variant (`quants`) and as one
// 256-bit vector for the SIMD ones (`quants_v`); w_e = dw * q_e + m. kSigned: q is signed
// (Q4_0, Q5_0, Q6_K shifted by 8 / 16 / 32); kOffset: the block has m; kSplit: elements
// 16..31 have their own scale dw2 (Q6_K's 16-element sub-blocks), else dw2 = dw.
// The K-quants' sub-block scales are integers times the super-block's float16 d (and
// dmin): dw = d * sc and m = -(dmin * mn) are the float32 products gguf_blocks.h decodes
// with, so x̂ · w differs from the exact products only by the activations' rounding. Their
// activations are the same per-32 blocks as the other types' (finer than llama.cpp's Q8_K,
// one scale per 256).
inline void nibbles_scalar(const uint8_t* qs, int8_t* q) {
    for (int e = 0; e < 16; ++e) {
        q[e] = static_cast<int8_t>(qs[e] & 15);
        q[e + 16] = static_cast<int8_t>(qs[e] >> 4);
    }
}
inline void high_bits_scalar(uint32_t qh, int8_t* q) {
    for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(q[e] | (((qh >> e) & 1) << 4));
}
#if defined(__AVX2__)
inline __m256i nibbles_v(const uint8_t* qs) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
}
// Byte e = 16 where bit e of qh is set, else 0.
inline __m256i high_bits_v(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(16));
}
#endif

struct A8Q4_0 {
    static constexpr int kBytes = 18;
    static constexpr int kMaxAbs = 8;  // largest |q|
    static constexpr bool kSigned = true, kOffset = false, kSplit = false;
    static constexpr int kSub = 1;
    static float dw(const uint8_t* b, int) { return f16(b); }
    static float dw2(const uint8_t* b, int) { return f16(b); }
    static float m(const uint8_t*, int) { return 0.0f; }
    static void quants(const uint8_t* b, int, int8_t* q) {
        nibbles_scalar(b + 2, q);
        for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(q[e] - 8);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int) {
        return _mm256_sub_epi8(nibbles_v(b + 2), _mm256_set1_epi8(8));
    }
#endif
};
struct A8Q4_1 {
    static constexpr int kBytes = 20;
    static constexpr int kMaxAbs = 15;  // largest |q|
    static constexpr bool kSigned = false, kOffset = true, kSplit = false;
    static constexpr int kSub = 1;
    static float dw(const uint8_t* b, int) { return f16(b); }
    static float dw2(const uint8_t* b, int) { return f16(b); }
    static float m(const uint8_t* b, int) { return f16(b + 2); }
    static void quants(const uint8_t* b, int, int8_t* q) { nibbles_scalar(b + 4, q); }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int) { return nibbles_v(b + 4); }
#endif
};
struct A8Q5_0 {
    static constexpr int kBytes = 22;
    static constexpr int kMaxAbs = 16;  // largest |q|
    static constexpr bool kSigned = true, kOffset = false, kSplit = false;
    static constexpr int kSub = 1;
    static float dw(const uint8_t* b, int) { return f16(b); }
    static float dw2(const uint8_t* b, int) { return f16(b); }
    static float m(const uint8_t*, int) { return 0.0f; }
    static void quants(const uint8_t* b, int, int8_t* q) {
        nibbles_scalar(b + 6, q);
        high_bits_scalar(u32(b + 2), q);
        for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(q[e] - 16);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int) {
        return _mm256_sub_epi8(_mm256_or_si256(nibbles_v(b + 6), high_bits_v(u32(b + 2))),
                               _mm256_set1_epi8(16));
    }
#endif
};
struct A8Q5_1 {
    static constexpr int kBytes = 24;
    static constexpr int kMaxAbs = 31;  // largest |q|
    static constexpr bool kSigned = false, kOffset = true, kSplit = false;
    static constexpr int kSub = 1;
    static float dw(const uint8_t* b, int) { return f16(b); }
    static float dw2(const uint8_t* b, int) { return f16(b); }
    static float m(const uint8_t* b, int) { return f16(b + 2); }
    static void quants(const uint8_t* b, int, int8_t* q) {
        nibbles_scalar(b + 8, q);
        high_bits_scalar(u32(b + 4), q);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int) {
        return _mm256_or_si256(nibbles_v(b + 8), high_bits_v(u32(b + 4)));
    }
#endif
};
struct A8Q8_0 {
    static constexpr int kBytes = 34;
    static constexpr int kMaxAbs = 128;  // largest |q|
    static constexpr bool kSigned = true, kOffset = false, kSplit = false;
    static constexpr int kSub = 1;
    static float dw(const uint8_t* b, int) { return f16(b); }
    static float dw2(const uint8_t* b, int) { return f16(b); }
    static float m(const uint8_t*, int) { return 0.0f; }
    static void quants(const uint8_t* b, int, int8_t* q) { std::memcpy(q, b + 2, 32); }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    }
#endif
};

// K-quants (gguf_blocks.h's layouts). Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and
// mins, [Q5_K: 32 bytes of high bits, bit j of byte e for block j], 128 bytes of nibbles
// (blocks 2i and 2i + 1: the low and high nibbles of bytes 32i..32i+31).
struct A8Q4_K {
    static constexpr int kBytes = 144, kSub = 8;
    static constexpr int kMaxAbs = 15;
    static constexpr bool kSigned = false, kOffset = true, kSplit = false;
    static float dw(const uint8_t* b, int j) {
        int sc, mn;
        scale_min_k4(b + 4, j, sc, mn);
        return f16(b) * static_cast<float>(sc);
    }
    static float dw2(const uint8_t* b, int j) { return dw(b, j); }
    static float m(const uint8_t* b, int j) {
        int sc, mn;
        scale_min_k4(b + 4, j, sc, mn);
        return -(f16(b + 2) * static_cast<float>(mn));
    }
    static void quants(const uint8_t* b, int j, int8_t* q) {
        const uint8_t* qs = b + 16 + 32 * (j / 2);
        for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>((qs[e] >> (4 * (j % 2))) & 15);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (j / 2)));
        return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
    }
#endif
};
struct A8Q5_K {
    static constexpr int kBytes = 176, kSub = 8;
    static constexpr int kMaxAbs = 31;
    static constexpr bool kSigned = false, kOffset = true, kSplit = false;
    static float dw(const uint8_t* b, int j) { return A8Q4_K::dw(b, j); }
    static float dw2(const uint8_t* b, int j) { return A8Q4_K::dw(b, j); }
    static float m(const uint8_t* b, int j) { return A8Q4_K::m(b, j); }
    static void quants(const uint8_t* b, int j, int8_t* q) {
        const uint8_t* qh = b + 16;
        const uint8_t* qs = b + 48 + 32 * (j / 2);
        for (int e = 0; e < 32; ++e)
            q[e] = static_cast<int8_t>(((qs[e] >> (4 * (j % 2))) & 15) | (((qh[e] >> j) & 1) << 4));
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (j / 2)));
        const __m256i lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v,
                                            _mm256_set1_epi8(15));
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        const __m256i hi = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(16));
        return _mm256_or_si256(lo, hi);
    }
#endif
};
// Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16
// elements), d. Block j = 4h + p: low nibbles of bytes 64h + 32(p % 2).. shifted by 4(p / 2),
// high parts of bytes 128 + 32h.. shifted by 2p, scales 8h + 2p and 8h + 2p + 1; q - 32.
struct A8Q6_K {
    static constexpr int kBytes = 210, kSub = 8;
    static constexpr int kMaxAbs = 32;
    static constexpr bool kSigned = true, kOffset = false, kSplit = true;
    static float scale(const uint8_t* b, int i) {
        return f16(b + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[i]);
    }
    static float dw(const uint8_t* b, int j) { return scale(b, 8 * (j / 4) + 2 * (j % 4)); }
    static float dw2(const uint8_t* b, int j) { return scale(b, 8 * (j / 4) + 2 * (j % 4) + 1); }
    static float m(const uint8_t*, int) { return 0.0f; }
    static void quants(const uint8_t* b, int j, int8_t* q) {
        const int h = j / 4, p = j % 4;
        const uint8_t* ql = b + 64 * h + 32 * (p % 2);
        const uint8_t* qh = b + 128 + 32 * h;
        for (int e = 0; e < 32; ++e)
            q[e] = static_cast<int8_t>((((ql[e] >> (4 * (p / 2))) & 15) |
                                        (((qh[e] >> (2 * p)) & 3) << 4)) - 32);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b, int j) {
        const int h = j / 4, p = j % 4;
        const __m256i ql = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (p % 2)));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (p / 2))),
                                            _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * p)),
                                            _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)),
                               _mm256_set1_epi8(32));
    }
#endif
};

template <class F>
bool with_a8_type(int qtype, F&& f) {
    switch (qtype) {
        case 2: f.template operator()<A8Q4_0>(); return true;
        case 3: f.template operator()<A8Q4_1>(); return true;
        case 6: f.template operator()<A8Q5_0>(); return true;
        case 7: f.template operator()<A8Q5_1>(); return true;
        case 8: f.template operator()<A8Q8_0>(); return true;
        case 12: f.template operator()<A8Q4_K>(); return true;
        case 13: f.template operator()<A8Q5_K>(); return true;
        case 14: f.template operator()<A8Q6_K>(); return true;
        default: return false;
    }
}
