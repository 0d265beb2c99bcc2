// The products of fused_moe.cpp's "large" experts (more rows than the decode tiles take:
// prefill) as one grouped product per phase: every expert's product is gguf_gemm.h's strips
// driver on that expert's matrix, and all of them share two worksharing loops, one packing
// each expert's rows transposed into tiles of MV = NVM * W rows (pack_xt), one over units of
// (block of tiles, strip of RN weight rows) (strip_unit), which threads take as they come
// free. A phase passes two barriers however many experts it holds, so a thread the OS takes
// away for a while costs one wait, not one per expert.
// Included inside fused_moe.cpp's anonymous namespace, after gguf_drive.h and dense_blocks.h.
#pragma once

constexpr int64_t BF16_CODE = 30;  // GGML's code of bfloat16 (dense_blocks.h)

#if defined(__AVX512F__)
// bf16 experts with AVX-512 take the "panel" route instead of the strips driver: the weights,
// not x, are laid out for the tile. A unit is (row block of up to PANEL_ROW_BLOCK x rows,
// strip of PANEL_N weight rows); per K chunk of PANEL_KC it widens the strip's bf16 into a
// float panel, transposed (panel[kk][j] = W[n0 + j][k0 + kk], 32 KB, stays in L1), and runs
//     acc[r][v] (lane i: weight row n0 + 16v + i) += broadcast(x[r0 + r][k0 + kk]) * panel[kk][16v ..)
// over the block's rows PANEL_ROWS at a time, straight from the x rows (no packing). The sums
// of the chunks before the last go to a thread's buffer of the block's rows (L2-resident:
// kept in y, the 68 MB scratch, the tiles' stores missed and took ~12 % of the kernel's
// samples); the last chunk's are stored to y rows as whole vectors (no transposed stores).
// Measured at 2,048 tokens x top-8 of 64 experts (hidden 1024, inter 512; ~256 rows an
// expert), 2 threads: see fused_moe.cpp's header. The strips driver lost its time to 4K-
// aliased transposed stores of 12-column pieces, the per-unit decode and register spills in
// its 24-accumulator tile; it also pads each expert's rows to a multiple of 32.
// Each y element is one unit's sum in k order (chunks added in order): the thread count
// does not change bits.
constexpr int PANEL_NV = 4, PANEL_N = PANEL_NV * 16;  // weight rows of a strip (acc lanes)
constexpr int PANEL_ROWS = 6;                         // x rows per tile: 24 accumulators
constexpr int64_t PANEL_KC = 128;                     // K per panel: 128 x 64 floats
constexpr int64_t PANEL_ROW_BLOCK = 512;              // x rows of a unit, at most
// Experts of at most this many rows keep the strips driver: a panel's transposition costs
// ~0.45 instructions an element, the FMAs m / 16, so a few rows do not repay it (decode
// steps of 32 streams have experts of 9-20 rows).
constexpr int64_t PANEL_MIN_ROWS = 32;
typedef uint32_t PanelLanes __attribute__((vector_size(64)));
#endif

// Whether a product of weight set w over K = k and m rows takes the panel route.
bool panel_route(const ExpertWeights& w, int64_t k, int64_t m) {
#if defined(__AVX512F__)
    return w.qtype == BF16_CODE && k % 16 == 0 && m > PANEL_MIN_ROWS;
#else
    (void)w, (void)k, (void)m;
    return false;
#endif
}

// y[m, n] = x[m, k] · (matrix e of w)ᵀ, x rows contiguous with row stride x_stride (or,
// with x_rows, row i at x + x_rows[i] * x_stride: the panel route reads the token rows in
// place, without a gather).
// Paired (panel route, `up` set): gate and up of one expert in one product, n = inter. A unit's
// strip holds PANEL_N / 2 gate rows and the matching up rows (accumulator columns 0-1 gate
// columns n0..., 2-3 up columns n0...), and after the last K chunk the unit's epilogue writes
// act[i][c] = silu(gate) * up (rounded to bf16 with round_act) while they are in registers:
// y is not used, and there is no pass over it afterwards.
struct GroupedProduct {
    const ExpertWeights* w; int64_t e, m, n, k;
    const float* x; int64_t x_stride;
    float* xt;   // this product's xᵀ tiles [tiles][k][MV]
    bool pack;   // false: xt is the previous product's (gate and up of one expert)
    float* y; int64_t y_stride;
    const int32_t* x_rows = nullptr;  // panel route only
    const ExpertWeights* up = nullptr;  // paired
    float* act = nullptr; int64_t act_stride = 0; bool round_act = false;
    // set by lay_out (panel: the panel route, its units row blocks of `block` rows x strips):
    bool panel = false;
    int nvm = 1; int64_t tiles = 0, block = 0, strips = 0;
    int64_t first_pack = 0, first_unit = 0;  // this product's first index in each loop
};

// Lays out a product (MV, tiles, units) and its xt at `xt` (a new one or, with pack false,
// the previous product's); returns the floats of xt it took.
int64_t lay_out(GroupedProduct& p, float* xt, int64_t& packs, int64_t& units) {
    p.xt = xt;
    p.first_pack = packs;
    p.first_unit = units;
    p.panel = panel_route(*p.w, p.k, p.m);
#if defined(__AVX512F__)
    if (p.panel) {
        const int64_t blocks = (p.m + PANEL_ROW_BLOCK - 1) / PANEL_ROW_BLOCK;
        p.block = (p.m + blocks - 1) / blocks;
        const int64_t cols = p.up ? PANEL_N / 2 : PANEL_N;
        p.strips = (p.n + cols - 1) / cols;
        units += blocks * p.strips;
        return 0;
    }
#endif
    p.nvm = p.m <= W ? 1 : 2;
    const int64_t mv = p.nvm * W, rn = ACC / p.nvm;
    p.tiles = (p.m + mv - 1) / mv;
    p.block = std::max<int64_t>(1, X_BLOCK_BYTES / (mv * p.k * 4));
    p.strips = (p.n + rn - 1) / rn;
    packs += p.pack ? p.tiles : 0;
    units += (p.tiles + p.block - 1) / p.block * p.strips;
    return p.pack ? p.tiles * mv * p.k : 0;
}

// The product holding index i of a loop whose products start at first(p), ascending.
template <class First>
const GroupedProduct& holding(const std::vector<GroupedProduct>& ps, int64_t i, First first) {
    const auto it = std::upper_bound(ps.begin(), ps.end(), i, [&](int64_t v,
                                                                 const GroupedProduct& p) {
        return v < first(p);
    });
    return *(it - 1);
}

#if defined(__AVX512F__)
// panel[kk * PANEL_N + j] = bf16 row j (rows[j] + 2 k0, or zeros for a null row) element kk,
// as a float, for kk < kc (a multiple of 16), j < PANEL_N.
void bf16_panel(const uint8_t* const (&rows)[PANEL_N], int64_t k0, int64_t kc, float* panel) {
    for (int g = 0; g < PANEL_N; g += 16)
        for (int64_t kk = 0; kk < kc; kk += 16) {
            Vec t[16];
#pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) {
                if (!rows[g + j]) {
                    t[j] = Vec{};
                    continue;
                }
                const auto* src = rows[g + j] + (k0 + kk) * 2;
                // the maskz form: GCC 12's unmasked one trips -Wmaybe-uninitialized
                const __m512i wide = _mm512_maskz_cvtepu16_epi32(
                    0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
                t[j] = reinterpret_cast<Vec>(reinterpret_cast<PanelLanes>(wide) << 16);
            }
            transpose(t);
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) store(panel + (kk + i) * PANEL_N + g, t[i]);
        }
}

// acc[r][0, PANEL_NV) = Σ_{kk < kc} x[r][kk] · panel[kk][0, PANEL_N) for r < R, then
// finish(acc).
template <int R, class Finish>
SIMD_INLINE void panel_tile(const float* const (&x)[R], const float* panel, int64_t kc,
                            Finish&& finish) {
    __m512 acc[R][PANEL_NV];
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < PANEL_NV; ++v) acc[r][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t kk = 0; kk < kc; ++kk) {
        __m512 w[PANEL_NV];
#pragma GCC unroll 4
        for (int v = 0; v < PANEL_NV; ++v) w[v] = _mm512_loadu_ps(panel + kk * PANEL_N + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512 b = _mm512_set1_ps(x[r][kk]);
#pragma GCC unroll 4
            for (int v = 0; v < PANEL_NV; ++v) acc[r][v] = _mm512_fmadd_ps(b, w[v], acc[r][v]);
        }
    }
    finish(acc);
}

// Where a unit's accumulator column v goes in a y row (offset, lanes); unpaired: the strip's
// columns n0 + 16v...; paired: gate columns n0 + 16v (v < 2), up inter + n0 + 16(v - 2).
struct PanelColumns {
    int64_t offset[PANEL_NV];
    __mmask16 mask[PANEL_NV];
};

// Unit v of panel product p (row block v / strips, strip v % strips); panel: PANEL_KC *
// PANEL_N floats and part: PANEL_ROW_BLOCK * PANEL_N floats, the calling thread's. The sums
// over K chunks before the last are kept in part (L2-resident, reused by every unit of the
// thread), not in y: only the last chunk writes y (or act), once.
void panel_unit(const GroupedProduct& p, int64_t v, float* panel, float* part) {
    const int64_t m0 = v / p.strips * p.block, m1 = std::min(p.m, m0 + p.block);
    const int width = p.up ? PANEL_N / 2 : PANEL_N;
    const int64_t n0 = v % p.strips * width;
    const int cols = static_cast<int>(std::min<int64_t>(width, p.n - n0));
    const uint8_t* rows[PANEL_N];
    PanelColumns out;
    for (int j = 0; j < PANEL_N; ++j) {
        const bool second = p.up && j >= width;  // an up row of a paired strip
        const ExpertWeights& w = second ? *p.up : *p.w;
        const int64_t r = j - (second ? width : 0);
        rows[j] = r < cols ? static_cast<const uint8_t*>(w.w) + p.e * w.expert_stride +
                             (n0 + r) * w.row_stride
                           : nullptr;
    }
    for (int c = 0; c < PANEL_NV; ++c) {
        const bool second = p.up && 16 * c >= width;
        const int lanes = std::clamp(cols - 16 * c + (second ? width : 0), 0, 16);
        out.offset[c] = n0 + 16 * c + (second ? p.n - width : 0);
        out.mask[c] = static_cast<__mmask16>((1u << lanes) - 1);
    }
    for (int64_t k0 = 0; k0 < p.k; k0 += PANEL_KC) {
        const int64_t kc = std::min(PANEL_KC, p.k - k0);
        const bool add = k0 > 0, last = k0 + kc >= p.k;
        bf16_panel(rows, k0, kc, panel);
        // the next chunk's weight lines to L2 while the tiles run: a panel reads 64 rows
        // at once, more streams than the hardware prefetchers follow, so unprefetched its
        // loads wait on memory (bf16_panel was ~9% of the kernel's time without this)
        const int64_t next = std::min(PANEL_KC, p.k - k0 - kc) * 2;
        for (int j = 0; j < PANEL_N && next > 0; ++j)
            for (int64_t b = 0; b < next && rows[j]; b += 64)
                __builtin_prefetch(rows[j] + (k0 + kc) * 2 + b, 0, 2);
        for (int64_t r0 = m0; r0 < m1; r0 += PANEL_ROWS)
            with_rows<PANEL_ROWS>(static_cast<int>(std::min<int64_t>(PANEL_ROWS, m1 - r0)),
                                  [&]<int R>() {
                const float* x[R];
                float* y[R];  // the rows' final destinations (act when paired)
                float* sums[R];
                for (int r = 0; r < R; ++r) {
                    const int64_t row = p.x_rows ? p.x_rows[r0 + r] : r0 + r;
                    x[r] = p.x + row * p.x_stride + k0;
                    y[r] = p.up ? p.act + (r0 + r) * p.act_stride : p.y + (r0 + r) * p.y_stride;
                    sums[r] = part + (r0 + r - m0) * PANEL_N;
                }
                // the next tile's destination lines, to be written (they are cold: first
                // touched in this layer), while this tile runs
                for (int r = 0; last && r < PANEL_ROWS && r0 + PANEL_ROWS + r < m1; ++r)
                    for (int c = 0; c < PANEL_NV; ++c) {
                        const float* next_y = p.up ? p.act + (r0 + PANEL_ROWS + r) * p.act_stride + n0 + 16 * c
                                                   : p.y + (r0 + PANEL_ROWS + r) * p.y_stride + out.offset[c];
                        __builtin_prefetch(next_y, 1, 3);
                        __builtin_prefetch(next_y + 15, 1, 3);
                    }
                panel_tile<R>(x, panel, kc, [&](__m512 (&acc)[R][PANEL_NV]) {
                    if (add) {
#pragma GCC unroll 4
                        for (int c = 0; c < PANEL_NV; ++c)
#pragma GCC unroll 8
                            for (int r = 0; r < R; ++r)
                                acc[r][c] = _mm512_add_ps(_mm512_loadu_ps(sums[r] + 16 * c),
                                                          acc[r][c]);
                    }
                    if (!last) {
#pragma GCC unroll 4
                        for (int c = 0; c < PANEL_NV; ++c)
#pragma GCC unroll 8
                            for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[r] + 16 * c, acc[r][c]);
                    } else if (p.up) {  // paired: act = silu(gate) * up
#pragma GCC unroll 2
                        for (int c = 0; c < PANEL_NV / 2; ++c)
#pragma GCC unroll 8
                            for (int r = 0; r < R; ++r) {
                                Vec a = silu_mul(reinterpret_cast<Vec>(acc[r][c]),
                                                 reinterpret_cast<Vec>(acc[r][c + 2]));
                                if (p.round_act) a = round_bf16(a);
                                _mm512_mask_storeu_ps(y[r] + n0 + 16 * c, out.mask[c],
                                                      reinterpret_cast<__m512>(a));
                            }
                    } else {
#pragma GCC unroll 4
                        for (int c = 0; c < PANEL_NV; ++c)
#pragma GCC unroll 8
                            for (int r = 0; r < R; ++r)
                                _mm512_mask_storeu_ps(y[r] + out.offset[c], out.mask[c],
                                                      acc[r][c]);
                    }
                });
            });
    }
}
#endif

// Every product of `ps` (laid out, `packs` and `units` the loops' sizes), by every thread.
void grouped_products(const std::vector<GroupedProduct>& ps, int64_t packs, int64_t units) {
    if (packs > 0) {  // (the same for every thread: no loop, no barrier)
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < packs; ++i) {
        const GroupedProduct& p = holding(ps, i, [](const GroupedProduct& q) {
            return q.first_pack;
        });
        const int64_t t = i - p.first_pack, mv = p.nvm * W;
        if (p.nvm == 1) pack_xt<W>(p.x, p.x_stride, p.m, t * mv, p.k, p.xt + t * mv * p.k);
        else pack_xt<2 * W>(p.x, p.x_stride, p.m, t * mv, p.k, p.xt + t * mv * p.k);
    }
    }
    float* const stage = thread_buffer(1, ACC * KC);
#if defined(__AVX512F__)
    float* const part = thread_buffer(2, PANEL_ROW_BLOCK * PANEL_N);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
        const GroupedProduct& p = holding(ps, u, [](const GroupedProduct& q) {
            return q.first_unit;
        });
        const int64_t v = u - p.first_unit;
#if defined(__AVX512F__)
        static_assert(ACC * KC >= PANEL_KC * PANEL_N, "the panel lives in the decode stage");
        if (p.panel) {
            panel_unit(p, v, stage, part);
            continue;
        }
#endif
        const int64_t t0 = v / p.strips * p.block;
        const int64_t rn = ACC / p.nvm, n0 = v % p.strips * rn;
        const Args a{static_cast<const uint8_t*>(p.w->w) + p.e * p.w->expert_stride,
                     p.w->row_stride, p.x, p.x_stride, p.y, p.y_stride, p.m, p.n, p.k, false};
        with_weight_type(static_cast<int>(p.w->qtype), [&]<class Q>() {
            if (p.nvm == 1) strip_unit<Q, 1>(a, n0, t0, std::min(p.tiles, t0 + p.block), p.xt,
                                             stage);
            else strip_unit<Q, 2>(a, n0, t0, std::min(p.tiles, t0 + p.block), p.xt, stage);
        });
    }
}
