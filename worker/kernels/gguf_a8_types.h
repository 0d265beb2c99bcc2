// The weight block types of the 8-bit-activation products (gguf_a8.h), as signed or unsigned
// byte quants: byte layouts as in gguf_blocks.h. Included inside gguf_a8.h.
#pragma once

// Per weight type: scalar fields and the 32 quants, as int8 for the scalar variant
// (`quants`) and as one 256-bit vector for the SIMD ones (`quants_v`). kSigned: q is signed
// (Q4_0 and Q5_0 shifted by 8 / 16); kOffset: the block has m (w = dw * q + m).
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
    static constexpr bool kSigned = true, kOffset = false;
    static float m(const uint8_t*) { return 0.0f; }
    static void quants(const uint8_t* b, int8_t* q) {
        nibbles_scalar(b + 2, q);
        for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(q[e] - 8);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b) {
        return _mm256_sub_epi8(nibbles_v(b + 2), _mm256_set1_epi8(8));
    }
#endif
};
struct A8Q4_1 {
    static constexpr int kBytes = 20;
    static constexpr int kMaxAbs = 15;  // largest |q|
    static constexpr bool kSigned = false, kOffset = true;
    static float m(const uint8_t* b) { return f16(b + 2); }
    static void quants(const uint8_t* b, int8_t* q) { nibbles_scalar(b + 4, q); }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b) { return nibbles_v(b + 4); }
#endif
};
struct A8Q5_0 {
    static constexpr int kBytes = 22;
    static constexpr int kMaxAbs = 16;  // largest |q|
    static constexpr bool kSigned = true, kOffset = false;
    static float m(const uint8_t*) { return 0.0f; }
    static void quants(const uint8_t* b, int8_t* q) {
        nibbles_scalar(b + 6, q);
        high_bits_scalar(u32(b + 2), q);
        for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(q[e] - 16);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b) {
        return _mm256_sub_epi8(_mm256_or_si256(nibbles_v(b + 6), high_bits_v(u32(b + 2))),
                               _mm256_set1_epi8(16));
    }
#endif
};
struct A8Q5_1 {
    static constexpr int kBytes = 24;
    static constexpr int kMaxAbs = 31;  // largest |q|
    static constexpr bool kSigned = false, kOffset = true;
    static float m(const uint8_t* b) { return f16(b + 2); }
    static void quants(const uint8_t* b, int8_t* q) {
        nibbles_scalar(b + 8, q);
        high_bits_scalar(u32(b + 4), q);
    }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b) {
        return _mm256_or_si256(nibbles_v(b + 8), high_bits_v(u32(b + 4)));
    }
#endif
};
struct A8Q8_0 {
    static constexpr int kBytes = 34;
    static constexpr int kMaxAbs = 128;  // largest |q|
    static constexpr bool kSigned = true, kOffset = false;
    static float m(const uint8_t*) { return 0.0f; }
    static void quants(const uint8_t* b, int8_t* q) { std::memcpy(q, b + 2, 32); }
#if defined(__AVX2__)
    static __m256i quants_v(const uint8_t* b) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
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
        default: return false;
    }
}
