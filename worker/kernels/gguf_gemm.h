// The many-rows path of gguf_matmul.cpp, computed transposed: yᵀ[n][m] = Σ_k W[n][k] xᵀ[k][m].
// x is packed once per call as xᵀ tiles of MV = NVM * W rows (xt[k][MV], rows past M zero);
// a strip of RN weight rows × up to KC elements is decoded once per thread into a float stage
// in "row-blocked" layout (for each W elements of k: RN rows of W floats, so decoding is plain
// vector stores, no transposition), and the register tile
//     acc[r][j] (lane i: x row jW + i) += broadcast(W[n0 + r][k]) * xt[k][jW ..)
// runs over it for every xᵀ tile: each decoded weight is used by all M rows, each xᵀ vector
// by RN weight rows. y takes each tile's sums for the K chunk, added when `accumulate` or
// after the first chunk. Included inside gguf_matmul.cpp's anonymous namespace, after
// gguf_blocks.h.
#pragma once

constexpr int ACC = W == 16 ? 24 : 12;  // accumulators per tile (RN * NVM) of 32 / 16 registers
constexpr int64_t KC = 1024;            // K elements per stage (a multiple of every kElems)

// out[0, kc) = elements [k0, k0 + kc) of one weight row (k0, kc multiples of Q::kElems).
template <class Q>
void decode_range(const uint8_t* row, int64_t k0, int64_t kc, float* out) {
    for (int64_t b = k0 / Q::kElems; b < (k0 + kc) / Q::kElems; ++b)
#pragma GCC unroll 8
        for (int c = 0; c < Q::kChunks; ++c) {
            const typename Q::Chunk chunk = Q::chunk(row + b * Q::kBytes, c);
            float* o = out + b * Q::kElems - k0 + c * CHUNK;
#pragma GCC unroll 8
            for (int v = 0; v < VPC; ++v) store(o + v * W, Q::at(chunk, v));
        }
}

// stage[(kv * RN + r) * W + i] = weight row n0 + r, element k0 + kv * W + i, for kv * W < kc;
// rows past n repeat the last row (their sums are never stored).
template <class Q, int RN>
void decode_strip(const uint8_t* w, int64_t w_stride, int64_t n, int64_t n0, int64_t k0,
                  int64_t kc, float* stage) {
    for (int r = 0; r < RN; ++r) {
        const uint8_t* row = w + std::min(n0 + r, n - 1) * w_stride;
        for (int64_t b = k0 / Q::kElems; b < (k0 + kc) / Q::kElems; ++b)
#pragma GCC unroll 8
            for (int c = 0; c < Q::kChunks; ++c) {
                const typename Q::Chunk chunk = Q::chunk(row + b * Q::kBytes, c);
                float* o = stage + ((b * Q::kElems - k0 + c * CHUNK) / W * RN + r) * W;
#pragma GCC unroll 8
                for (int v = 0; v < VPC; ++v) store(o + v * RN * W, Q::at(chunk, v));
            }
    }
}

// xt[k * MV + i] = x row m0 + i, element k, for k < K; zeros for rows at or past m.
template <int MV>
void pack_xt(const float* x, int64_t x_stride, int64_t m, int64_t m0, int64_t k, float* xt) {
    for (int g = 0; g < MV; g += W)
        for (int64_t kk = 0; kk < k; kk += W) {
            Vec t[W];
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i)
                t[i] = m0 + g + i < m ? load(x + (m0 + g + i) * x_stride + kk) : Vec{};
            transpose(t);
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i) store(xt + (kk + i) * MV + g, t[i]);
        }
}

// One k of a register tile: acc[r][j] += w[r * w_stride] (broadcast) × x[j W, j W + W).
template <int NVM, int RN>
SIMD_INLINE void tile_step(Vec (&acc)[RN][NVM], const float* w, int w_stride, const float* x) {
    Vec xv[NVM];
#pragma GCC unroll 4
    for (int j = 0; j < NVM; ++j) xv[j] = in_register(load(x + j * W));
#pragma GCC unroll 32
    for (int r = 0; r < RN; ++r) {
        const Vec a = broadcast(w[r * w_stride]);
#pragma GCC unroll 4
        for (int j = 0; j < NVM; ++j) acc[r][j] += a * xv[j];
    }
}

// out[r * NVM W + j W + lane] = acc[r][j][lane]: a register tile stored row by row.
template <int NVM, int RN>
SIMD_INLINE void store_tile(const Vec (&acc)[RN][NVM], float* out) {
#pragma GCC unroll 32
    for (int r = 0; r < RN; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < NVM; ++j) store(out + (r * NVM + j) * W, acc[r][j]);
}

// out[r * MV + i] = Σ_{k < kc} stage row r, element k × xt[k][i] (kc a multiple of W).
template <int NVM, int RN>
SIMD_INLINE void strip_tile(const float* xt, const float* stage, int64_t kc, float* out) {
    constexpr int MV = NVM * W;
    Vec acc[RN][NVM] = {};
    for (int64_t kv = 0; kv < kc / W; ++kv) {
        const float* s = stage + kv * RN * W;
        const float* xk = xt + kv * W * MV;
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) tile_step<NVM, RN>(acc, s + i, W, xk + i * MV);
    }
    store_tile<NVM, RN>(acc, out);
}

// y[m0 + i][n0 + r] = (add ? y + : ) out[r * MV + i] for i < rows, r < cols.
template <int MV>
void store_transposed(const float* out, int rows, int cols, float* y, int64_t y_stride,
                      bool add) {
    for (int i = 0; i < rows; ++i) {
        float* yr = y + i * y_stride;
        for (int r = 0; r < cols; ++r) yr[r] = add ? yr[r] + out[r * MV + i] : out[r * MV + i];
    }
}
