// Greedy argmax over rows of float32 logits, as torch.argmax(dim=-1) answers it: the first
// index of the row's maximum; NaN counts as the maximum (the first NaN's index); a row of
// -inf gives 0; +0.0 and -0.0 are equal. Rows are independent.
//
// One pass per row in blocks of ARGMAX_BLOCK: each block's maximum (a vectorized reduction)
// and whether it holds a NaN; the row's maximum is first reached in the first block whose
// maximum beats every earlier block's, and only that block is scanned again for the index.
// Included inside a .cpp's anonymous namespace (<cmath> and <cstdint> are included there).
#pragma once

constexpr int64_t ARGMAX_BLOCK = 1024;  // 4 KiB of a row: its second scan stays in L1
constexpr int64_t ARGMAX_AHEAD = 4;  // blocks prefetched ahead (past a row's end: the next's)
// Rows run in parallel from this many elements (~25 us of serial scan; a decode batch of a
// 32k vocabulary crosses it, one row does not).
constexpr int64_t ARGMAX_PARALLEL_WORK = int64_t{1} << 16;

// Index of the first x[i] satisfying `hit` in [0, n) (n when none does).
template <class Hit>
inline int64_t first_index(const float* x, int64_t n, const Hit& hit) {
    for (int64_t i = 0; i < n; ++i)
        if (hit(x[i])) return i;
    return n;
}

inline int64_t argmax_row(const float* x, int64_t n) {
    float best = -INFINITY;
    int64_t best_start = 0;
    for (int64_t start = 0; start < n; start += ARGMAX_BLOCK) {
        const float* block = x + start;
        const int64_t len = n - start < ARGMAX_BLOCK ? n - start : ARGMAX_BLOCK;
        // Logits fresh from the LM head are in memory, not cache: [32, 32000] takes ~230 us
        // on 2 threads with the hardware prefetcher alone, ~180 asking for the lines
        // ARGMAX_AHEAD blocks on (into L2). Integer addresses: a prefetch never faults.
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(block + len) +
                                (ARGMAX_AHEAD - 1) * ARGMAX_BLOCK * sizeof(float);
        for (int64_t i = 0; i < ARGMAX_BLOCK; i += 16)  // 16 floats: a 64-byte line
            __builtin_prefetch(reinterpret_cast<const void*>(ahead + i * sizeof(float)), 0, 2);
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < len; ++i) {
            const float v = block[i];
            m = v > m ? v : m;  // a NaN never wins here: `nan` says it is there
            nan |= v != v;
        }
        if (nan) return start + first_index(block, len, [](float v) { return v != v; });
        if (m > best) {  // strictly: an equal maximum in a later block is not the first
            best = m;
            best_start = start;
        }
    }
    // best is in that block (a row of -inf: its first element); == treats -0.0 as +0.0
    const int64_t len = n - best_start < ARGMAX_BLOCK ? n - best_start : ARGMAX_BLOCK;
    return best_start + first_index(x + best_start, len, [best](float v) { return v == best; });
}

// out[r] = argmax of x[r * x_stride, r * x_stride + cols) for r < rows.
inline void argmax_rows(const float* x, int64_t x_stride, int64_t rows, int64_t cols,
                        int64_t* out, int num_threads) {
    const auto body = [&](int64_t r) { out[r] = argmax_row(x + r * x_stride, cols); };
    if (num_threads > 1 && rows > 1 && rows * cols >= ARGMAX_PARALLEL_WORK) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = 0; r < rows; ++r) body(r);
    } else {
        for (int64_t r = 0; r < rows; ++r) body(r);
    }
}
