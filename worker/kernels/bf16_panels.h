// bf16_panels: y[M, N] (+)= x[M, K] · W[N, K]^T for bfloat16 weight rows at a decode batch's
// row count (DIRECT_ROWS < M, x small enough to stay in L2: PANEL_X_BYTES), the bf16 linears
// of a 32-128-row step (LM head, q/k/v, o) on a CPU whose float32 FMAs outrun its bf16
// products (worker/layers/bf16_linear.py). Included inside gguf_matmul.cpp's anonymous
// namespace, after gguf_drive.h (Args, team_packed_xt, ACC, transpose, broadcast) and
// gguf_gemm.h (tile_step, store_tile).
//
// Why not the strips driver (gguf_gemm.h): at 32 rows each stage of 12 rows x 1024 k (48 KB,
// all of L1) is written, then read once by one xᵀ tile; its weights come from memory in a
// burst between the tiles' FMAs, unprefetched. The 32000 x 1024 LM head then ran at 44 GMAC/s
// on one core of 87 (and oneDNN's packed float32 copy at 41, reading 2x the bytes). Here the
// weights go from their rows to registers to a 1.5 KB stage, a line at a time (line s + 1
// widened into a second stage during line s's FMAs, so the L2 latency of its loads is
// hidden), while the rows of the thread's next panel are prefetched to L2 during the current
// one's FMAs.
//
// Layout. A panel is RN = ACC / NVM weight rows; each 64-byte line of a row (2W bf16 weights,
// k = 2W s ... 2W s + 2W - 1) is widened to float32 by two integer operations: the even
// elements are the 32-bit lanes shifted left by 16, the odd ones the lanes with their low 16
// bits cleared (bf16 is the high half of a float32). So within each block of 2W k the stage
// and xᵀ hold k in the order (0, 2, ..., 2W - 2, 1, 3, ..., 2W - 1):
//   stage[r * 2W + p]              weight row n0 + r, k = 2W s + perm(p)
//   xt[(2W s + p) * MV + i]        x row t MV + i of tile t, k = 2W s + perm(p) (zero past M)
// The register tile acc[r][j] (lane i: x row t MV + jW + i) += broadcast(stage[r][p]) ·
// xt[p][jW ...] runs over all of K for each xᵀ tile, so each y element is one lane's float32
// sum over k in that fixed order: the result is x · W.float()ᵀ up to summation order, the
// same bits for any thread count (a panel is one thread's) and for both layer loops (both
// call gguf_matmul with the same arguments).
//
// Threads take contiguous ranges of panels (each weight byte read once, in address order), or
// guided chunks of them from GUIDED_PANELS (an LM head: a thread the OS delays no longer
// keeps the other waiting at the end); every panel runs all the xᵀ tiles, which stay in L2
// (xt is at most PANEL_X_BYTES). One xᵀ tile (up to 2W rows) is packed by each thread for
// itself. Measured at 32 rows (interleaved in one process, same bits, bench MoE model's
// shapes; /work/notes/issue-31-panel9.md): the second stage took the LM head from 7.82 to
// 7.47 ms and 8 layers' q/k/v + o from 9.78 to 9.53; the own xᵀ took a [1152, 1024] product
// from 298 to 278 us and q/k/v + o from 10.2 to 9.9 ms; the 32-stream step (all three, 6
// alternating runs of bench_moe_step.py) went from 93.3 to 92.4 ms, its LM head from 8.31
// to 7.74 (in the Python layer loop q/k/v from 6.37 to 5.92 ms, o from 5.22 to 4.78).
// Measured and not kept (32 rows, interleaved in one process, same bits): K blocks of 256
// over groups of 8 panels, so an xᵀ block stays in L1 (partial sums reloaded): LM head 8.66
// ms instead of 8.51, 8 layers' q/k/v + o 13.9 instead of 10.3; dynamic chunks of panels
// instead of static ranges: q/k/v + o 10.5 instead of 10.0 alone; in the 32-stream step the
// LM head 8.05-8.41 instead of 8.32-9.27, the step within its noise (92.9-100.2 vs 93.2-98.8);
// the p loop unrolled 2 (no change) or 32 (LM head 8.25 ms instead of 7.24: front-end bound).
#pragma once

constexpr int64_t PANEL_X_BYTES = 1 << 20;  // x [M, K] float32 up to this: bf16_panels

// Whether bf16_panels takes a bf16 product of m rows of k (else gguf_drive.h's drivers).
inline bool panels_take(int64_t m, int64_t k) {
    return m > DIRECT_ROWS && m * k * 4 <= PANEL_X_BYTES && k % (2 * W) == 0;
}

// xt tile (MV rows from m0) in the panel order above: rows past m are zeros.
template <int MV>
void pack_panel_xt(const float* x, int64_t x_stride, int64_t m, int64_t m0, int64_t k,
                   float* xt) {
    for (int g = 0; g < MV; g += W)
        for (int64_t kk = 0; kk < k; kk += 2 * W) {
            Vec even[W], odd[W];
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i) {
                const bool in = m0 + g + i < m;
                const float* row = x + (m0 + g + i) * x_stride + kk;
                const Vec lo = in ? load(row) : Vec{}, hi = in ? load(row + W) : Vec{};
                even[i] = [&]<int... I>(std::integer_sequence<int, I...>) {
                    return __builtin_shufflevector(lo, hi, (2 * I)...);
                }(std::make_integer_sequence<int, W>{});
                odd[i] = [&]<int... I>(std::integer_sequence<int, I...>) {
                    return __builtin_shufflevector(lo, hi, (2 * I + 1)...);
                }(std::make_integer_sequence<int, W>{});
            }
            transpose(even);
            transpose(odd);
#pragma GCC unroll 16
            for (int p = 0; p < W; ++p) {
                store(xt + (kk + p) * MV + g, even[p]);
                store(xt + (kk + W + p) * MV + g, odd[p]);
            }
        }
}

// stage[r * 2W ...] = weight rows [r0, r1) of `rows`, line `s` (2W bf16 from byte s 4W),
// widened in the panel order; prefetches next[r]'s line s to L2 when `next` is set.
template <int RN>
SIMD_INLINE void widen_lines(const uint8_t* const (&rows)[RN], const uint8_t* const* next,
                             int r0, int r1, int64_t s, float* stage) {
    const int64_t offset = s * 4 * W;  // bytes of 2W bf16
    for (int r = r0; r < r1; ++r) {
        if (next) __builtin_prefetch(next[r] + offset, 0, 2);
        VecU32 line;
        std::memcpy(&line, rows[r] + offset, sizeof line);
        store(stage + r * 2 * W, (Vec)(line << 16));
        store(stage + r * 2 * W + W, (Vec)(line & 0xFFFF0000u));
    }
}

// out[r * MV + i] = Σ_k weight row r · xt tile row i over all of K (rows[r]: its first byte);
// prefetches next[r]'s lines at the same offsets to L2 when `next` is set. Two stages: the
// rows' line s + 1 is widened into one, a quarter of the rows per quarter of line s's k,
// while the FMAs read line s from the other.
template <int NVM, int RN>
SIMD_INLINE void panel_tile(const uint8_t* const (&rows)[RN], const uint8_t* const* next,
                            const float* xt, int64_t k, float* out) {
    constexpr int MV = NVM * W, Q = 4, PQ = 2 * W / Q;
    Vec acc[RN][NVM] = {};
    alignas(64) float stage[2][RN * 2 * W];
    const int64_t steps = k / (2 * W);
    widen_lines<RN>(rows, next, 0, RN, 0, stage[0]);
    for (int64_t s = 0; s < steps; ++s) {
        const float* cur = stage[s & 1];
        float* ahead = stage[(s + 1) & 1];
        const float* xs = xt + s * 2 * W * MV;
        for (int q = 0; q < Q; ++q) {
            if (s + 1 < steps)
                widen_lines<RN>(rows, next, q * RN / Q, (q + 1) * RN / Q, s + 1, ahead);
#pragma GCC unroll 16
            for (int p = q * PQ; p < (q + 1) * PQ; ++p)
                tile_step<NVM, RN>(acc, cur + p, 2 * W, xs + p * MV);
        }
    }
    store_tile<NVM, RN>(acc, out);
}

// One panel (weight rows n0 ... n0 + RN, clipped to N) times every xᵀ tile of NVM vectors.
template <int NVM>
void panel_unit(const Args& a, int64_t n0, const float* xt) {
    constexpr int MV = NVM * W, RN = ACC / NVM;
    const int cols = static_cast<int>(std::min<int64_t>(RN, a.n - n0));
    const uint8_t* rows[RN];
    const uint8_t* next[RN];
    for (int r = 0; r < RN; ++r) {
        rows[r] = a.w + std::min<int64_t>(n0 + r, a.n - 1) * a.w_stride;  // past N: repeats
        next[r] = a.w + std::min<int64_t>(n0 + RN + r, a.n - 1) * a.w_stride;
    }
    const int64_t tiles = (a.m + MV - 1) / MV;
    float out[RN * MV];
    for (int64_t t = 0; t < tiles; ++t) {
        panel_tile<NVM, RN>(rows, t == 0 ? next : nullptr, xt + t * MV * a.k, a.k, out);
        store_transposed<MV>(out, static_cast<int>(std::min<int64_t>(MV, a.m - t * MV)), cols,
                             a.y + t * MV * a.y_stride + n0, a.y_stride, a.accumulate);
    }
}

// From this many panels (an LM head's 2667 at RN = 12; q/k/v's 214 stay static), threads
// take guided chunks of panels (from half of those left down to GUIDED_CHUNK panels) instead
// of one static range each.
constexpr int64_t GUIDED_PANELS = 1024;
constexpr int GUIDED_CHUNK = 8;

// xᵀ for the panels: with one tile, each thread packs its own (no barrier, and the tile is
// read from the thread's own L2); else the team splits the tiles (team_packed_xt).
template <int MV>
const float* panels_xt(const Args& a) {
    if (a.m > MV) return team_packed_xt<MV>(a, pack_panel_xt<MV>);
    float* const own = thread_buffer(0, MV * a.k);
    pack_panel_xt<MV>(a.x, a.x_stride, a.m, 0, a.k, own);
    return own;
}

// The driver, called by every thread of a parallel region (or by one thread outside any):
// xᵀ packed (panels_xt), then ranges of panels per thread.
template <int NVM>
void panel_units(const Args& a) {
    constexpr int MV = NVM * W, RN = ACC / NVM;
    const int64_t panels = (a.n + RN - 1) / RN;
    const float* const xt = panels_xt<MV>(a);
    if (panels >= GUIDED_PANELS) {
#pragma omp for schedule(guided, GUIDED_CHUNK)
        for (int64_t u = 0; u < panels; ++u) panel_unit<NVM>(a, u * RN, xt);
    } else {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < panels; ++u) panel_unit<NVM>(a, u * RN, xt);
    }
}

// bf16_panels for the row count: tiles of 2W rows (2 vectors each), or of W rows up to W.
inline void panels_drive(const Args& a) {
    if (a.m <= W) panel_units<1>(a);
    else panel_units<2>(a);
}
