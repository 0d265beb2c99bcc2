// bf16 K and V rows read by parity for cpu_paged_attention_tile.h (Tile's kSplit: bf16 caches
// on the widened path, a fixed head_dim that is a multiple of 2W). A dword holds two elements:
// the even one widens by a shift, the odd one by a mask, so K is transposed as dword pairs and
// V accumulates into even/odd columns; the products and their order per column are those of
// transpose_keys / accumulate (cpu_paged_attention_rows.h), so the results are bit-equal.
// Included inside cpu_paged_attention.cpp's anonymous namespace, after _rows.h.
#pragma once

// bf16 rows by parity: 2W consecutive bf16 as W dwords (lane i: element 2i in its low half,
// 2i + 1 in its high half), widened by one ALU op per W elements (even: << 16, odd: the high
// half masked) instead of a zero-extension and a shift (load(const bf16*)).
SIMD_INLINE VecU32 load_words(const bf16* p) {
    VecU32 u;
    std::memcpy(&u, p, sizeof u);
    return u;
}
SIMD_INLINE Vec even_of(VecU32 u) { return reinterpret_cast<Vec>(u << 16); }
SIMD_INLINE Vec odd_of(VecU32 u) { return reinterpret_cast<Vec>(u & 0xFFFF0000u); }

// transpose_keys for bf16 rows with dim a multiple of 2W: each W x W block of dwords (a key's
// dims 2j, 2j + 1 in dword j) is transposed as is, then split by parity into kt rows c + 2j
// and c + 2j + 1; the same kt as transpose_keys, with half the shuffles and widenings.
inline void transpose_keys_split(const bf16* cache, const int64_t* off, int n, int dim,
                                 float* kt) {
    for (int kb = 0; kb < KC; kb += W) {
        for (int c = 0; c < dim; c += 2 * W) {
            Vec v[W];
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i)
                v[i] = kb + i < n ? reinterpret_cast<Vec>(load_words(cache + off[kb + i] + c))
                                  : Vec{};
            transpose(v);
#pragma GCC unroll 16
            for (int j = 0; j < W; ++j) {
                const VecU32 u = reinterpret_cast<VecU32>(v[j]);
                store(kt + (c + 2 * j) * KC + kb, even_of(u));
                store(kt + (c + 2 * j + 1) * KC + kb, odd_of(u));
            }
        }
    }
}

// accumulate_rows for bf16 V rows in the split layout (load_words): per block of 2W columns, a
// holds the W even columns, then the W odd ones (Tile::store puts them back in order). Every
// column gets the same products in the same order as in accumulate(); each V row is loaded
// and widened once per group and NP blocks.
template <int R, int NP>
void accumulate_split_columns(const bf16* cache, const int64_t* off, const int* vis,
                              const float* p, const float* alpha, int col, float* a,
                              int64_t a_stride) {
    accumulate_rows<R, 2 * NP>(vis, p, alpha, col, a, a_stride,
                               [&](int t, Vec (&vt)[2 * NP]) __attribute__((always_inline)) {
        const bf16* v = cache + off[t] + col;
#pragma GCC unroll 4
        for (int b = 0; b < NP; ++b) {
            const VecU32 u = load_words(v + b * 2 * W);
            vt[2 * b] = even_of(u);
            vt[2 * b + 1] = odd_of(u);
        }
    });
}

// The same over all of head_dim (a multiple of 2W): R x 2NP accumulators stay in registers.
template <int R>
void accumulate_split(const bf16* cache, const int64_t* off, const int* vis, const float* p,
                      const float* alpha, int dim, float* a, int64_t a_stride) {
    constexpr int NP = R > 4 || W < 16 ? 1 : 2;
    int c = 0;
    for (; c + 2 * W * NP <= dim; c += 2 * W * NP)
        accumulate_split_columns<R, NP>(cache, off, vis, p, alpha, c, a, a_stride);
    if constexpr (NP > 1)
        for (; c < dim; c += 2 * W)
            accumulate_split_columns<R, 1>(cache, off, vis, p, alpha, c, a, a_stride);
}

// Rounds to bf16 (cpu_dtypes.h's from_float<bf16>, lane-wise): the bits in each lane's low half.
SIMD_INLINE VecU32 bf16_bits(Vec x) {
    const VecU32 u = reinterpret_cast<VecU32>(x);
    const VecU32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded;
}
