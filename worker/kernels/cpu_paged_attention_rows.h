// The register-blocked pieces of a work unit (cpu_paged_attention_tile.h): key chunk
// offsets, K transposition, scores and p · V for a group of up to RG query rows, and the
// per-row online-softmax state. Included inside cpu_paged_attention.cpp's anonymous
// namespace, after cpu_paged_attention_simd.h.
#pragma once

constexpr int KC = 16;      // key positions per chunk (a multiple of W)
constexpr int NK = KC / W;  // vectors per chunk of scores
constexpr int RG = 4;       // query rows per register block

// Element offsets (into either cache; the two share a layout) of one KV head's rows for
// consecutive key positions, walking the request's block table.
class KeyChunks {
public:
    struct Peek { int64_t offsets[KC]; int n; };

    // Starting at key position `first`.
    KeyChunks(const int32_t* table, int block_size, int64_t kv_row, int64_t head_offset,
              int first)
        : table_(table), block_size_(block_size), kv_row_(kv_row), head_offset_(head_offset),
          block_(first / block_size), in_block_(first % block_size) {}

    void next(int n) {  // offsets of the next n (<= KC) positions; advances past them
        fill(offsets, n, block_, in_block_);
    }
    Peek peek(int n) const {  // the n positions after those, without advancing
        Peek p{{}, n};
        int block = block_, in_block = in_block_;
        fill(p.offsets, n, block, in_block);
        return p;
    }

    int64_t offsets[KC];

private:
    void fill(int64_t* off, int n, int& block, int& in_block) const {
        for (int t = 0; t < n; ++t) {
            off[t] = (static_cast<int64_t>(table_[block]) * block_size_ + in_block) * kv_row_
                     + head_offset_;
            if (++in_block == block_size_) in_block = 0, ++block;
        }
    }

    const int32_t* table_;
    const int block_size_;
    const int64_t kv_row_, head_offset_;
    int block_, in_block_;
};

// kt[d * KC + t] = k row t, element d, for t < n (rows off[t] of the cache); zeros for
// t in [n, KC), so rows past n are never read. W x W blocks, transposed in registers.
template <typename T>
void transpose_keys(const T* cache, const int64_t* off, int n, int dim, float* kt) {
    const int full = dim / W * W, tail = dim - full;
    for (int kb = 0; kb < KC; kb += W) {
        Vec v[W];
        for (int c = 0; c < full; c += W) {
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i) v[i] = kb + i < n ? load(cache + off[kb + i] + c) : Vec{};
            transpose(v);
#pragma GCC unroll 16
            for (int j = 0; j < W; ++j) store(kt + (c + j) * KC + kb, v[j]);
        }
        if (tail) {
            for (int i = 0; i < W; ++i)
                v[i] = kb + i < n ? load_n(cache + off[kb + i] + full, tail) : Vec{};
            transpose(v);
            for (int j = 0; j < tail; ++j) store(kt + (full + j) * KC + kb, v[j]);
        }
    }
}

// s[r] = q_r . k_t for the chunk's KC keys (zero keys past n), rows q + r * q_stride (the
// queries, prescaled). P independent partial sums per (row, vector) hide the FMA latency.
template <int R>
void group_scores(const float* q, int dim, const float* kt, Vec (*s)[NK]) {
    constexpr int P = 8 / (R * NK) > 1 ? 8 / (R * NK) : 1;
    Vec acc[P][R][NK] = {};
    const auto add = [&](int u, int64_t d) __attribute__((always_inline)) {
#pragma GCC unroll 4
        for (int j = 0; j < NK; ++j) {
            const Vec k = load(kt + d * KC + j * W);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[u][r][j] += q[r * dim + d] * k;
        }
    };
    const int64_t full = dim / P * P;
    for (int64_t d = 0; d < full; d += P)
#pragma GCC unroll 8
        for (int u = 0; u < P; ++u) add(u, d + u);
    for (int u = 0; u < dim % P; ++u) add(u, full + u);
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NK; ++j) {
            s[r][j] = acc[0][r][j];
            for (int u = 1; u < P; ++u) s[r][j] += acc[u][r][j];
        }
}

// Lane t = q . k_t for the W keys at rows off[t] of the cache, t < n; 0 for t >= n (never
// read). For few query rows: each key's products stay in one vector, summed across lanes
// for all W keys at once (no transposition of K).
template <typename T>
SIMD_INLINE Vec key_dots(const float* q, const T* cache, const int64_t* off, int n, int dim) {
    const int full = dim / W * W, tail = dim - full;
    Vec acc[W];
#pragma GCC unroll 16
    for (int t = 0; t < W; ++t) {
        acc[t] = Vec{};
        if (t >= n) continue;
        const T* k = cache + off[t];
        for (int c = 0; c < full; c += W) acc[t] += load(q + c) * load(k + c);
        if (tail) acc[t] += load_n(q + full, tail) * load_n(k + full, tail);
    }
    return sum_lanes(acc);
}

// a_r = a_r * alpha[r] + sum_{t < vis[r]} p_r[t] v_t over NV vectors of columns from col,
// for rows a + r * a_stride (fp32) and p + r * KC; vis grows with r; `row(t, vt)` loads V row
// t's NV vectors (from col). Each V row is loaded once for the whole group, and only into the
// rows that see it (p_r[t] is 0 past vis[r], but 0 * inf would still be NaN).
template <int R, int NV, class Row>
SIMD_INLINE void accumulate_rows(const int* vis, const float* p, const float* alpha, int col,
                                 float* a, int64_t a_stride, const Row& row) {
    Vec acc[R][NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < NV; ++i) acc[r][i] = load(a + r * a_stride + col + i * W) * alpha[r];
    const auto add = [&](int t, bool all) __attribute__((always_inline)) {
        Vec vt[NV];
        row(t, vt);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            if (all || t < vis[r])
#pragma GCC unroll 4
                for (int i = 0; i < NV; ++i) acc[r][i] += p[r * KC + t] * vt[i];
    };
    int t = 0;
    for (; t < vis[0]; ++t) add(t, true);
    for (; t < vis[R - 1]; ++t) add(t, false);  // the causal diagonal of a prefill tile
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int i = 0; i < NV; ++i) store(a + r * a_stride + col + i * W, acc[r][i]);
}

// accumulate_rows over V rows of T, widened as they load.
template <typename T, int R, int NV>
void accumulate_columns(const T* cache, const int64_t* off, const int* vis, const float* p,
                        const float* alpha, int col, float* a, int64_t a_stride) {
    accumulate_rows<R, NV>(vis, p, alpha, col, a, a_stride,
                           [&](int t, Vec (&vt)[NV]) __attribute__((always_inline)) {
        const T* v = cache + off[t] + col;
#pragma GCC unroll 4
        for (int i = 0; i < NV; ++i) vt[i] = load(v + i * W);
    });
}

// The same over all of head_dim: blocks of NVC vectors, then 1-3, then a partial vector
// (head_dim % W columns, loaded without reading past the row).
template <typename T, int R>
void accumulate(const T* cache, const int64_t* off, const int* vis, const float* p,
                const float* alpha, int dim, float* a, int64_t a_stride) {
    constexpr int NVC = W >= 16 ? 4 : 2;  // accumulators R x NVC stay in registers
    const int vectors = dim / W;
    int c = 0;
    for (; c + NVC <= vectors; c += NVC)
        accumulate_columns<T, R, NVC>(cache, off, vis, p, alpha, c * W, a, a_stride);
    switch (vectors - c) {
        case 0: break;
        case 1: accumulate_columns<T, R, 1>(cache, off, vis, p, alpha, c * W, a, a_stride); break;
        case 2: accumulate_columns<T, R, 2>(cache, off, vis, p, alpha, c * W, a, a_stride); break;
        default: accumulate_columns<T, R, 3>(cache, off, vis, p, alpha, c * W, a, a_stride);
    }
    if (const int tail = dim - vectors * W) {
        const int col = vectors * W;
        Vec acc[R];
        for (int r = 0; r < R; ++r) acc[r] = load(a + r * a_stride + col) * alpha[r];
        for (int t = 0; t < vis[R - 1]; ++t) {
            const Vec v = load_n(cache + off[t] + col, tail);
            for (int r = 0; r < R; ++r)
                if (t < vis[r]) acc[r] += p[r * KC + t] * v;
        }
        for (int r = 0; r < R; ++r) store(a + r * a_stride + col, acc[r]);
    }
}

// e^x for x <= 0, lane-wise, bit-equal to the scalar exp_nonpositive (cpu_exp.h): n =
// floor(x log2 e + 0.5) as there (rounded to nearest by the 1.5 * 2^23 trick, then one less
// where that rounded up), not the vector twin's round-to-nearest-even.
inline Vec exp_nonpositive_floor(Vec x) {
    const Vec lo = splat(-87.0f), magic = splat(12582912.0f);  // 1.5 * 2^23
    const Vec c = x < lo ? lo : x;
    const Vec z = c * 1.44269504088896341f + 0.5f;
    const Vec rounded = (z + magic) - magic;
    const Vec n = rounded > z ? rounded - 1.0f : rounded;
    const Vec two_n = reinterpret_cast<Vec>((__builtin_convertvector(n, VecI) + 127) << 23);
    return x < lo ? Vec{} : exp_polynomial(exp_remainder(c, n)) * two_n;
}

// Per-row buffers of a work unit, reused across units: prescaled queries, unnormalized
// outputs, the chunk's probabilities, and the online softmax's running max and lane-wise sum.
struct SoftmaxState {
    std::vector<float> q;    // [rows][head_dim]
    std::vector<float> acc;  // [rows][acc_stride]: head_dim rounded up to W (tail lanes 0)
    std::vector<float> p;    // [rows][KC]: e^(s - max) of the current chunk, 0 if not visible
    std::vector<float> max;  // [rows]
    std::vector<float> sum;  // [rows][W]: lane-wise sums of p (their total is the row's sum)
    int64_t acc_stride = 0;

    void reset(int rows, int dim) {
        acc_stride = (dim + W - 1) / W * W;
        q.resize(static_cast<size_t>(rows) * dim);
        acc.assign(static_cast<size_t>(rows) * acc_stride, 0.0f);
        p.resize(static_cast<size_t>(rows) * KC);
        max.assign(rows, -std::numeric_limits<float>::infinity());
        sum.assign(static_cast<size_t>(rows) * W, 0.0f);
    }
    float* acc_rows(int m) { return acc.data() + m * acc_stride; }
    const float* acc_rows(int m) const { return acc.data() + m * acc_stride; }
    const float* p_rows(int m) const { return p.data() + static_cast<size_t>(m) * KC; }

    // Row m's scores s of the chunk, of which those in [hidden, visible) count (before
    // `hidden`: outside its sliding window): writes p (0 for the others), folds them into the
    // running sum, and returns alpha, the factor rescaling the row's accumulator to the new
    // max (1 when the max stays). Row m's first chunk with hidden < visible starts its sums.
    float update(int m, const Vec (&s)[NK], int hidden, int visible) {
        float* pm = p.data() + static_cast<size_t>(m) * KC;
        if (visible <= hidden) {
            std::fill(pm, pm + KC, 0.0f);
            return 1.0f;
        }
        const Vec minus_inf = splat(-std::numeric_limits<float>::infinity());
        Vec masked[NK];
        float block_max = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < NK; ++j) {
            const VecI lane = lane_index() + j * W;
            masked[j] = ((lane < visible) & (lane >= hidden)) ? s[j] : minus_inf;
            block_max = std::max(block_max, hmax(masked[j]));
        }
        const float new_max = std::max(max[m], block_max);
        const float alpha = new_max > max[m] ? exp_nonpositive(max[m] - new_max) : 1.0f;
        max[m] = new_max;
        Vec total{};
        for (int j = 0; j < NK; ++j) {
            const Vec e = exp_nonpositive(masked[j] - new_max);
            store(pm + j * W, e);
            total += e;
        }
        float* sm = sum.data() + static_cast<size_t>(m) * W;
        store(sm, load(sm) * alpha + total);
        return alpha;
    }

#if defined(__AVX512F__)
    // update for the 8 rows m0 + [0, 8) at once (16-lane vectors, one score vector per row):
    // the row maxima by a shuffle tree, the new maxima and the alphas in one vector (its
    // exp rounds n as the scalar one does), so the results are those of update, row by row.
    void update8(int m0, const Vec (&s)[8][NK], const int* hidden, const int* visible,
                 float* alpha) {
        static_assert(NK == 1);
        const Vec minus_inf = splat(-std::numeric_limits<float>::infinity());
        const auto vmax = [](Vec a, Vec b) { return a < b ? b : a; };  // std::max(a, b)
        Vec masked[8];
        for (int r = 0; r < 8; ++r) {
            const VecI lane = lane_index();
            masked[r] = ((lane < visible[r]) & (lane >= hidden[r])) ? s[r][0] : minus_inf;
        }
        // Row maxima: lanes halve per level; a[i] holds rows 2i, 2i+1 in 8-lane halves, b[i]
        // rows 4i, 4i+2, 4i+1, 4i+3 in quarters, c rows 0, 4, 2, 6, 1, 5, 3, 7 in pairs.
        Vec a[4], b[2];
        for (int i = 0; i < 4; ++i)
            a[i] = vmax(__builtin_shufflevector(masked[2 * i], masked[2 * i + 1], 0, 1, 2, 3, 4,
                                                5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                        __builtin_shufflevector(masked[2 * i], masked[2 * i + 1], 8, 9, 10, 11,
                                                12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
        for (int i = 0; i < 2; ++i)
            b[i] = vmax(__builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18,
                                                19, 8, 9, 10, 11, 24, 25, 26, 27),
                        __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22,
                                                23, 12, 13, 14, 15, 28, 29, 30, 31));
        const Vec c = vmax(__builtin_shufflevector(b[0], b[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                                   24, 25, 12, 13, 28, 29),
                           __builtin_shufflevector(b[0], b[1], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                                   11, 26, 27, 14, 15, 30, 31));
        const Vec block_max = vmax(  // lane r: row r (lanes 8..15: copies)
            __builtin_shufflevector(c, c, 0, 8, 4, 12, 2, 10, 6, 14, 0, 8, 4, 12, 2, 10, 6, 14),
            __builtin_shufflevector(c, c, 1, 9, 5, 13, 3, 11, 7, 15, 1, 9, 5, 13, 3, 11, 7, 15));
        Vec old = minus_inf;
        std::memcpy(&old, max.data() + m0, 8 * sizeof(float));
        const Vec new_max = vmax(old, block_max);
        const Vec alphas = new_max > old ? exp_nonpositive_floor(old - new_max) : splat(1.0f);
        std::memcpy(max.data() + m0, &new_max, 8 * sizeof(float));
        std::memcpy(alpha, &alphas, 8 * sizeof(float));
        for (int r = 0; r < 8; ++r) {
            float* pm = p.data() + static_cast<size_t>(m0 + r) * KC;
            if (visible[r] <= hidden[r]) {
                std::fill(pm, pm + KC, 0.0f);
                continue;
            }
            Vec total{};
            const Vec e = exp_nonpositive(masked[r] - new_max[r]);
            store(pm, e);
            total += e;
            float* sm = sum.data() + static_cast<size_t>(m0 + r) * W;
            store(sm, load(sm) * alpha[r] + total);
        }
    }
#endif
};
