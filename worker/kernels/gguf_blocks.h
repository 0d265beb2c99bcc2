// GGUF (ggml) quantized block formats, decoded 32 elements ("a chunk") at a time into float
// vectors of cpu_simd.h. Included inside gguf_matmul.cpp's anonymous namespace, after
// cpu_dtypes.h and cpu_simd.h.
//
// A weight row of K elements is K / kElems consecutive blocks of kBytes bytes, exactly as in
// the GGUF file; a block holds kChunks chunks of 32 elements. Per type, `chunk(block, c)`
// gathers chunk c's scales, `at(chunk, v)` is its vector v (elements [v*W, v*W + W) of the
// chunk, v < VPC). Byte layouts (offsets in bytes; f16 = IEEE half, little-endian):
//   Q4_0  18 B / 32: d f16 @0, qs[16] @2; e < 16: low nibble of qs[e], else high of qs[e-16];
//         w = d * (q - 8)
//   Q4_1  20 B / 32: d @0, m @2, qs[16] @4 (as Q4_0); w = d * q + m
//   Q5_0  22 B / 32: d @0, qh u32 @2 (bit e = 5th bit of element e), qs[16] @6;
//         w = d * (q - 16)
//   Q5_1  24 B / 32: d @0, m @2, qh @4, qs @8; w = d * q + m
//   Q8_0  34 B / 32: d @0, int8 qs[32] @2; w = d * q
//   I8    32 B / 32: int8 qs[32] @0; w = q (GGML's plain int8 tensor, decoded 32 at a time;
//         a per-row scale, as weight-only int8 has, is applied to the products by the caller)
//   Q4_K 144 B / 256: d @0, dmin @2, 6-bit scales/mins packed in 12 B @4, qs[128] @16;
//         chunk c: bytes qs[32 * (c / 2) + l], nibble c % 2; w = (d * sc) * q - dmin * mn
//   Q5_K 176 B / 256: as Q4_K, plus qh[32] @16 (bit c of qh[l] = 5th bit), qs @48
//   Q6_K 210 B / 256: ql[128] @0, qh[64] @128, int8 scales[16] @192, d f16 @208; chunk c =
//         half h = c / 4, part p = c % 4: low 4 bits from ql[64h + 32(p % 2) + l] (nibble
//         p / 2), high 2 bits from qh[32h + l] >> 2p; scale scales[8h + 2p + l / 16];
//         w = (d * scale) * (q - 32)
// Exactness: every product above is exact in float32 (an 11-bit f16 significand times
// integers of at most 13 bits), so each w rounds at most once (the + m / - dmin * mn, done
// as one fused multiply-add) and equals gguf.quants.dequantize's float32 bit for bit.
#pragma once

constexpr int CHUNK = 32;         // elements per chunk
constexpr int VPC = CHUNK / W;    // vectors per chunk

inline uint32_t u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline float f16(const uint8_t* p) {
    half_t h;
    std::memcpy(&h, p, sizeof h);
    return static_cast<float>(h);
}
inline Vec broadcast(float x) {  // (splat's x + 0 would also turn -0 into +0)
    return [&]<int... I>(std::integer_sequence<int, I...>) {
        return Vec{((void)I, x)...};
    }(std::make_integer_sequence<int, W>{});
}
// The f16 at p in every lane, and the adjacent pair at p, p + 2 (d and m) in every lane of
// two vectors. On AVX2 and AVX-512 one broadcast and one conversion: a scalar conversion and
// broadcast per field cost ~3 % of a Q4_1 one-row product and up to ~10 % of a Q8_0 one on
// Zen 3.
#if defined(__AVX512F__)
#define GGUF_SPLAT_F16 512
#elif defined(__AVX2__) && defined(__F16C__)
#define GGUF_SPLAT_F16 256
#endif
inline Vec splat_f16(const uint8_t* p) {
#if GGUF_SPLAT_F16 == 512
    int16_t h;
    std::memcpy(&h, p, sizeof h);
    return (Vec)_mm512_maskz_cvtph_ps(0xFFFF, _mm256_set1_epi16(h));  // maskz: see widen
#elif GGUF_SPLAT_F16 == 256
    int16_t h;
    std::memcpy(&h, p, sizeof h);
    return (Vec)_mm256_cvtph_ps(_mm_set1_epi16(h));
#else
    return broadcast(f16(p));
#endif
}
struct VecPair { Vec first, second; };
inline VecPair splat_f16_pair(const uint8_t* p) {
#if GGUF_SPLAT_F16 == 512
    const __m512 f = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_set1_epi32(static_cast<int>(u32(p))));
    return {(Vec)_mm512_maskz_moveldup_ps(0xFFFF, f), (Vec)_mm512_maskz_movehdup_ps(0xFFFF, f)};
#elif GGUF_SPLAT_F16 == 256
    const __m256 f = _mm256_cvtph_ps(_mm_set1_epi32(static_cast<int>(u32(p))));
    return {(Vec)_mm256_moveldup_ps(f), (Vec)_mm256_movehdup_ps(f)};
#else
    return {splat_f16(p), splat_f16(p + 2)};
#endif
}
// W bytes widened to int32 lanes: zero-extended (widen) or sign-extended (widen_signed).
// GCC 12 compiles __builtin_convertvector from bytes lane by lane, so each ISA has its
// one-instruction form; the AVX-512 maskz forms avoid GCC 12's false "uninitialized" warning.
inline VecI widen(const uint8_t* p) {
#if defined(__AVX512F__)
    return (VecI)_mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
    return (VecI)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#elif defined(__SSE2__) && !defined(__AVX__)  // 4 lanes
    const __m128i z = _mm_setzero_si128(), b = _mm_cvtsi32_si128(static_cast<int>(u32(p)));
    return (VecI)_mm_unpacklo_epi16(_mm_unpacklo_epi8(b, z), z);
#else  // AVX without AVX2 (8 lanes, no 256-bit integer instructions), other ISAs
    VecI v;
    for (int i = 0; i < W; ++i) v[i] = p[i];
    return v;
#endif
}
inline VecI widen_signed(const uint8_t* p) {
#if defined(__AVX512F__)
    return (VecI)_mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
    return (VecI)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
#elif defined(__SSE2__) && !defined(__AVX__)
    const __m128i b = _mm_cvtsi32_si128(static_cast<int>(u32(p)));
    return (VecI)_mm_srai_epi32(_mm_unpacklo_epi16(_mm_unpacklo_epi8(b, b),
                                                   _mm_unpacklo_epi8(b, b)), 24);
#else
    VecI v;
    for (int i = 0; i < W; ++i) v[i] = static_cast<int8_t>(p[i]);
    return v;
#endif
}
inline Vec to_vec(VecI q) { return __builtin_convertvector(q, Vec); }

// Elements [e, e + W) of a 32-element nibble chunk (qs[16]: low nibbles, then high ones).
inline VecI nibbles32(const uint8_t* qs, int e) {
    const VecI b = widen(qs + e % 16);
    return e < 16 ? b & 15 : b >> 4;
}
// The 5th bits of elements [e, e + W) from a 32-bit mask, as 0 or 16.
inline VecI high_bits32(uint32_t qh, int e) {
    return ((VecI)((VecU32{} + qh) >> (VecU32)(lane_index() + e)) & 1) << 4;
}
// q - 16 for 5-bit quants q = low | 16 * bit: the low nibble where the bit is set, else the
// nibble minus 16. With AVX-512 the bits are a lane mask and this is one masked subtract (the
// shift-and-mask form costs four vector operations per vector, and Q5_0 decoding is
// arithmetic-bound at one row).
inline VecI five_bit_centered(VecI low, uint32_t qh, int e) {
#if defined(__AVX512F__)
    static_assert(W == 16);
    const __mmask16 set = static_cast<__mmask16>(qh >> e);
    return (VecI)_mm512_mask_sub_epi32((__m512i)low, static_cast<__mmask16>(~set),
                                       (__m512i)low, _mm512_set1_epi32(16));
#else
    return (low | high_bits32(qh, e)) - 16;
#endif
}

struct Q4_0 {
    static constexpr int kElems = 32, kBytes = 18, kChunks = 1;
    struct Chunk { Vec d; const uint8_t* qs; };
    static Chunk chunk(const uint8_t* b, int) { return {splat_f16(b), b + 2}; }
    static Vec at(const Chunk& k, int v) { return k.d * to_vec(nibbles32(k.qs, v * W) - 8); }
};

struct Q4_1 {
    static constexpr int kElems = 32, kBytes = 20, kChunks = 1;
    struct Chunk { Vec d, m; const uint8_t* qs; };
    static Chunk chunk(const uint8_t* b, int) {
        const auto [d, m] = splat_f16_pair(b);
        return {d, m, b + 4};
    }
    static Vec at(const Chunk& k, int v) { return k.d * to_vec(nibbles32(k.qs, v * W)) + k.m; }
};

struct Q5_0 {
    static constexpr int kElems = 32, kBytes = 22, kChunks = 1;
    struct Chunk { Vec d; uint32_t qh; const uint8_t* qs; };
    static Chunk chunk(const uint8_t* b, int) { return {splat_f16(b), u32(b + 2), b + 6}; }
    static Vec at(const Chunk& k, int v) {
        const int e = v * W;
        return k.d * to_vec(five_bit_centered(nibbles32(k.qs, e), k.qh, e));
    }
};

struct Q5_1 {
    static constexpr int kElems = 32, kBytes = 24, kChunks = 1;
    struct Chunk { Vec d, m; uint32_t qh; const uint8_t* qs; };
    static Chunk chunk(const uint8_t* b, int) {
        const auto [d, m] = splat_f16_pair(b);
        return {d, m, u32(b + 4), b + 8};
    }
    static Vec at(const Chunk& k, int v) {
        const int e = v * W;
        return k.d * to_vec(nibbles32(k.qs, e) | high_bits32(k.qh, e)) + k.m;
    }
};

struct Q8_0 {
    static constexpr int kElems = 32, kBytes = 34, kChunks = 1;
    struct Chunk { Vec d; const uint8_t* qs; };
    static Chunk chunk(const uint8_t* b, int) { return {splat_f16(b), b + 2}; }
    static Vec at(const Chunk& k, int v) { return k.d * to_vec(widen_signed(k.qs + v * W)); }
};

struct I8 {
    static constexpr int kElems = 32, kBytes = 32, kChunks = 1;
    struct Chunk { const uint8_t* qs; };
    static Chunk chunk(const uint8_t* b, int) { return {b}; }
    static Vec at(const Chunk& k, int v) { return to_vec(widen_signed(k.qs + v * W)); }
};

// Scale and min of sub-block j (< 8) of a Q4_K / Q5_K block's 12 packed bytes: bytes 0-3
// hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the mins likewise,
// bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

struct Q4_K {
    static constexpr int kElems = 256, kBytes = 144, kChunks = 8;
    struct Chunk { Vec ds, dm; const uint8_t* qs; int shift; };
    static Chunk chunk(const uint8_t* b, int c) {
        int sc, mn;
        scale_min_k4(b + 4, c, sc, mn);
        return {broadcast(f16(b) * sc), broadcast(f16(b + 2) * mn), b + 16 + 32 * (c / 2),
                4 * (c % 2)};
    }
    static Vec at(const Chunk& k, int v) {
        return k.ds * to_vec((widen(k.qs + v * W) >> k.shift) & 15) - k.dm;
    }
};

struct Q5_K {
    static constexpr int kElems = 256, kBytes = 176, kChunks = 8;
    struct Chunk { Vec ds, dm; const uint8_t* qh; const uint8_t* qs; int c; };
    static Chunk chunk(const uint8_t* b, int c) {
        int sc, mn;
        scale_min_k4(b + 4, c, sc, mn);
        return {broadcast(f16(b) * sc), broadcast(f16(b + 2) * mn), b + 16,
                b + 48 + 32 * (c / 2), c};
    }
    static Vec at(const Chunk& k, int v) {
        const VecI lo = (widen(k.qs + v * W) >> (4 * (k.c % 2))) & 15;
        const VecI hi = ((widen(k.qh + v * W) >> k.c) & 1) << 4;
        return k.ds * to_vec(lo | hi) - k.dm;
    }
};

struct Q6_K {
    static constexpr int kElems = 256, kBytes = 210, kChunks = 8;
    struct Chunk { Vec s0, s1; const uint8_t* ql; const uint8_t* qh; int lo_shift, hi_shift; };
    static Chunk chunk(const uint8_t* b, int c) {
        const int h = c / 4, p = c % 4;
        const auto* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * p;
        const float d = f16(b + 208);
        return {broadcast(d * scales[0]), broadcast(d * scales[1]), b + 64 * h + 32 * (p % 2),
                b + 128 + 32 * h, 4 * (p / 2), 2 * p};
    }
    static Vec at(const Chunk& k, int v) {
        const int e = v * W;
        const VecI lo = (widen(k.ql + e) >> k.lo_shift) & 15;
        const VecI hi = ((widen(k.qh + e) >> k.hi_shift) & 3) << 4;
        return (e < 16 ? k.s0 : k.s1) * to_vec((lo | hi) - 32);
    }
};

// Calls f.template operator()<Q>() for the GGML type code `qtype` (gguf.GGMLQuantizationType);
// false for a type without a decoder here.
template <class F>
bool with_type(int qtype, F&& f) {
    switch (qtype) {
        case 2: f.template operator()<Q4_0>(); return true;
        case 3: f.template operator()<Q4_1>(); return true;
        case 6: f.template operator()<Q5_0>(); return true;
        case 7: f.template operator()<Q5_1>(); return true;
        case 8: f.template operator()<Q8_0>(); return true;
        case 12: f.template operator()<Q4_K>(); return true;
        case 13: f.template operator()<Q5_K>(); return true;
        case 14: f.template operator()<Q6_K>(); return true;
        case 24: f.template operator()<I8>(); return true;
        default: return false;
    }
}
