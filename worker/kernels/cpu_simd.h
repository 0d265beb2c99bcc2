// Portable SIMD for the CPU libraries: GCC vector extensions of the widest float vector the
// target has (16 lanes with AVX-512, 8 with AVX/AVX2, 4 otherwise), so one source builds for
// every -march; intrinsics only for 16-bit loads, guarded by the ISA macros. Included inside
// a .cpp's anonymous namespace (needs bf16, half_t, to_float from cpu_dtypes.h; <cstring>,
// <utility> and, with AVX, <immintrin.h> are included there).
#pragma once

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif

typedef float Vec __attribute__((vector_size(W * 4)));
typedef int32_t VecI __attribute__((vector_size(W * 4)));
typedef uint32_t VecU32 __attribute__((vector_size(W * 4)));
typedef uint16_t VecU16 __attribute__((vector_size(W * 2)));
typedef half_t VecH __attribute__((vector_size(W * 2)));

inline Vec splat(float x) { return Vec{} + x; }

// W consecutive elements as floats (unaligned; memcpy compiles to one vector load).
inline Vec load(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
// bf16 -> fp32 is a 16-bit shift; the generic widening compiles to lane-by-lane code with
// GCC 12, so AVX2 / AVX-512 widen with one instruction (fp16 likewise with F16C). The
// maskz forms avoid GCC 12's false "uninitialized" warning in the unmasked AVX-512 ones.
inline Vec load(const bf16* p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return (Vec)((VecU32)_mm512_maskz_cvtepu16_epi32(0xFFFF, h) << 16);
#elif defined(__AVX2__)
    return (Vec)((VecU32)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)) << 16);
#else
    VecU16 h;
    std::memcpy(&h, p, sizeof h);
    return reinterpret_cast<Vec>(__builtin_convertvector(h, VecU32) << 16);
#endif
}
inline Vec load(const half_t* p) {
#if defined(__AVX512F__)
    return (Vec)_mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256((const __m256i*)p));
#elif defined(__AVX__) && defined(__F16C__)
    return (Vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    VecH h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, Vec);
#endif
}
// The first n (< W) elements, zeros after: never touches p[n] and beyond.
template <typename T>
inline Vec load_n(const T* p, int n) {
    Vec v{};
    for (int i = 0; i < n; ++i) v[i] = to_float(p[i]);
    return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline VecI lane_index() {
    VecI v;
    for (int i = 0; i < W; ++i) v[i] = i;
    return v;
}

inline float hmax(Vec v) {
    float m = v[0];
    for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
    return m;
}
inline float hsum(Vec v) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += v[i];
    return s;
}

// Transposes W vectors in place (v[i][j] <-> v[j][i]) by log2(W) rounds of a perfect
// shuffle: out[2i], out[2i + 1] = interleave of v[i] and v[i + W/2] (low, high halves).
#define SIMD_INLINE inline __attribute__((always_inline))  // keeps Vec arrays in registers

// v, kept in a register: GCC otherwise folds a vector used by several multiply-adds into each
// as a memory operand, one load per use, which makes load ports the bottleneck of a tile.
SIMD_INLINE Vec in_register(Vec v) {
#if defined(__SSE2__)
    asm("" : "+v"(v));  // any vector register the target has
#endif
    return v;
}

template <int Half>
SIMD_INLINE Vec interleave(Vec a, Vec b) {  // lanes Half*W/2 .. of a and b, alternating
    return [&]<int... I>(std::integer_sequence<int, I...>) {
        return __builtin_shufflevector(a, b, ((I & 1) ? W : 0) + Half * (W / 2) + I / 2 ...);
    }(std::make_integer_sequence<int, W>{});
}
template <int Round = 1>  // one perfect-shuffle round per recursion (all unrolled)
SIMD_INLINE void transpose(Vec (&v)[W]) {
    if constexpr (Round < W) {
        Vec out[W];
#pragma GCC unroll 16
        for (int i = 0; i < W / 2; ++i) {
            out[2 * i] = interleave<0>(v[i], v[i + W / 2]);
            out[2 * i + 1] = interleave<1>(v[i], v[i + W / 2]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) v[i] = out[i];
        transpose<Round * 2>(v);
    }
}

// Lane i of the result = the sum of all lanes of v[i], by log2(W) rounds of the same
// interleave pairing v[i] with v[i + N/2] (which keeps the lanes in order).
template <int N = W>
SIMD_INLINE Vec sum_lanes(Vec (&v)[W]) {
    if constexpr (N == 1) {
        return v[0];
    } else {
#pragma GCC unroll 16
        for (int i = 0; i < N / 2; ++i)
            v[i] = interleave<0>(v[i], v[i + N / 2]) + interleave<1>(v[i], v[i + N / 2]);
        return sum_lanes<N / 2>(v);
    }
}
