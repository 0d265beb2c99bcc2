// The decode tile of gguf_matmul.cpp (few x rows): dot products of R activation rows with NR
// weight rows over all of K, the weights decoded in registers straight from their blocks.
// R * NR <= DOT_ACC accumulators (NR = 4 for the fewest rows, 2 or 1 for more).
// Included inside gguf_matmul.cpp's anonymous namespace, after gguf_blocks.h.
//
// acc[m * NR + r] holds W partial sums (lane i: elements k = i mod W) of x row m · weight row
// r; each x vector is loaded once per step and each weight vector decoded once and used R
// times; after K the R * NR accumulators are summed across lanes together. Every weight byte
// is read once, in address order per row; the rows PREFETCH_ROWS further on (the next tiles
// of the same thread) are prefetched at the same offset, since a row of a few hundred bytes
// is too short a stream for the hardware prefetchers to pick up. The prefetch goes to L2
// (prefetcht1), not L1: a thread keeps more lines in flight that way (bf16 experts at one
// token read 24.5-25.5 GB/s instead of 19-22, 2 threads; none at all: 13.5-17).
#pragma once

constexpr int DOT_ACC = W == 16 ? 16 : 8;  // accumulator registers per decode tile
constexpr int DOT_ROWS = DOT_ACC / 2;      // x rows per decode tile at most
constexpr int DOT_GROUP = 4;               // weight rows per decode work unit (1 to 4 tiles)

// Weight rows per tile with R x rows: as many as the accumulators allow, at most DOT_GROUP.
constexpr int dot_tile_rows(int r) { return std::min(DOT_GROUP, DOT_ACC / r); }

// The chunk's vectors in the order (0, VPC/2, 1, VPC/2 + 1, ...): a 4-bit type's low and
// high nibbles of the same bytes (vectors v and v + VPC/2) are decoded one after the other, so
// the widened bytes are used at once instead of being kept, or spilled, for half a chunk.
constexpr int nibble_pair_order(int i) { return i % 2 * (VPC / 2) + i / 2; }

// Weight rows as GGUF blocks: row r at base + r * stride (bytes).
template <class Q>
struct BlockRows {
    const uint8_t* base;
    int64_t stride;
    int64_t ahead;  // prefetch distance (bytes)
    const uint8_t* row(int r) const { return base + r * stride; }
};

// out[i] = the sum of acc[i]'s lanes, for i < N, W accumulators per transpose-and-add.
template <int N>
SIMD_INLINE void reduce_lanes(const Vec (&acc)[N], float (&out)[N]) {
#pragma GCC unroll 4
    for (int g = 0; g < N; g += W) {
        Vec v[W];
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) v[i] = g + i < N ? acc[g + i] : Vec{};
        const Vec s = sum_lanes(v);
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i)
            if (g + i < N) out[g + i] = s[i];
    }
}

// out[m * NR + r] = x row m · weight row r (r < valid; rows past it repeat the last valid
// one, so nothing past it is read). x[m]: row m's first element, float32 contiguous over K.
template <class Q, int R, int NR>
SIMD_INLINE void dot_tile(const BlockRows<Q>& src, int valid, const float* const (&x)[R],
                          int64_t blocks, float (&out)[R * NR]) {
    Vec acc[R * NR] = {};
    const uint8_t* rows[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) rows[r] = src.row(std::min(r, valid - 1));
    for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
        for (int c = 0; c < Q::kChunks; ++c) {  // unrolled: constant scale indices and shifts
            typename Q::Chunk chunk[NR];
            const int64_t offset = b * Q::kBytes + c * (Q::kBytes / Q::kChunks);
#pragma GCC unroll 8
            for (int r = 0; r < NR; ++r) {
                __builtin_prefetch(rows[r] + offset + src.ahead, 0, 2);  // to L2
                chunk[r] = Q::chunk(rows[r] + b * Q::kBytes, c);
            }
            const int64_t e0 = b * Q::kElems + c * CHUNK;
#pragma GCC unroll 8
            for (int i = 0; i < VPC; ++i) {
                const int v = nibble_pair_order(i);
                Vec xv[R];
#pragma GCC unroll 8
                for (int m = 0; m < R; ++m) xv[m] = in_register(load(x[m] + e0 + v * W));
#pragma GCC unroll 8
                for (int r = 0; r < NR; ++r) {
                    const Vec w = Q::at(chunk[r], v);
#pragma GCC unroll 8
                    for (int m = 0; m < R; ++m) acc[m * NR + r] += xv[m] * w;
                }
            }
        }
    }
    reduce_lanes(acc, out);
}
