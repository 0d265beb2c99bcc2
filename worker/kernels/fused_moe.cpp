// A mixture-of-experts feed-forward over one step's tokens, in one call and one OpenMP
// parallel region (worker/layers/fused_moe/):
//   out[t] (+)= Σ_j weight[t, j] · down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
// 1. group: the (token, choice) rows sorted by expert (a counting sort, tokens ascending
//    within an expert), serially before the region; inactive experts are never read;
// 2. gate/up and SiLU: experts with few rows (decode) share one worksharing loop over units
//    of (expert, DOT_GROUP intermediate columns), each dotting its gate and up rows with the
//    rows' x in place (gguf_gemv.h's tiles) and activating them; an expert with more rows
//    (prefill) gathers its x and runs fused_moe_grouped.h's grouped products (gguf_drive.h's
//    strips driver) by the whole team, then activates; bf16 experts of more than 32 rows
//    with AVX-512 take the panel route instead, gate and up paired in one product that reads
//    the token rows in place and activates in its epilogue (no gather, no SiLU pass);
// 3. down: likewise, into [rows, hidden];
// 4. combine: each token's rows weighted and summed in choice order j = 0..topk-1 (a
//    token's result does not depend on the rest of the batch), into out or added to it.
// A decode step passes three barriers. Weights: GGUF blocks, int8 (I8 with row scales) or
// dense float32 / bfloat16 / float16 rows (dense_blocks.h), each decoded to float32 in
// registers; float32 activations and accumulation throughout, except that bfloat16 experts
// take bfloat16 inputs, as Hugging Face's and vLLM's bf16 experts do: x (for bf16 gate/up)
// and the SiLU product (for a bf16 down) are rounded to bf16 (nearest even) before their
// products, which are then exact in float32, so only the summation order is the kernel's.
// With AVX-512 the decode units split each bf16 weight line into its even and odd elements as
// floats and multiply them with FMAs against x rows split alike (bf16_group_dots), in passes
// of at most 4 x rows (BF16_PASS_ROWS); elsewhere the same values go through the widening
// tiles. SiLU and the gating product run on vectors (silu_mul), a unit's rows at once.
// Prefill of bf16 experts (fused_moe_grouped.h's panel route, scratch rows padded by ROW_PAD),
// measured at 2,048 tokens x top-8 of 64 experts (hidden 1024, inter 512), 2 threads, one
// layer, interleaved: the strips driver 278-295 ms; the first panel route 249-252 (103
// GMAC/s); with gate/up paired (SiLU in the epilogue, x read in place) and chunk sums kept
// in a per-thread buffer instead of y: 199 (197-207) ms, 129 GMAC/s (the host's FMA peak is
// 174). In the model's prefill (bench_moe_prefill.py) the 8 layers' kernel takes 1.69 s
// (was 2.08 on the first panel route, 2.11 on the strips driver).
//
// Layouts: x [tokens, hidden] float32 (row stride x_stride); ids int32 and weights float32
// [tokens, topk], contiguous; out [tokens, hidden] float32 (row stride out_stride). A weight
// set holds E matrices [n, k]: matrix e's row r at w + e * expert_stride + r * row_stride
// (bytes), as GGUF blocks or dense elements; `scale` (or null) is float32 [E, n] with expert
// stride scale_stride: output column c of matrix e is multiplied by scale[e, c].
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "cpu_dtypes.h"
#include "cpu_exp.h"

namespace {

#include "cpu_simd.h"
#include "gguf_blocks.h"
#include "gguf_gemv.h"
#include "gguf_gemm.h"
#include "gguf_drive.h"
#include "dense_blocks.h"
#include "cpu_paged_attention_simd.h"  // the vector exp_nonpositive

}  // namespace

// Mirrored by ctypes Structures in worker/native/fused_moe.py (same order and types).
struct ExpertWeights {
    int64_t qtype; const void* w; int64_t expert_stride, row_stride;
    const float* scale; int64_t scale_stride;
};
struct MoeLayer {
    int64_t num_experts, hidden, inter;  // inter: this rank's intermediate size
    ExpertWeights gate, up, down;        // gate/up [E, inter, hidden], down [E, hidden, inter]
};

namespace {

// silu(g) * u lane-wise: cpu_exp.h's silu on vectors (the exponent rounded to nearest by
// cpu_paged_attention_simd.h's exp, so a lane may differ from the scalar form in its last
// bits; every activation of the kernel goes through this one).
SIMD_INLINE Vec silu_mul(Vec g, Vec u) {
    const Vec e = exp_nonpositive(g < 0.0f ? g : -g);
    return g * ((g < 0.0f ? e : splat(1.0f)) / (e + 1.0f)) * u;
}

// v rounded to bf16 (nearest even; NaN stays NaN), as floats.
SIMD_INLINE Vec round_bf16(Vec v) {
    const VecU32 u = reinterpret_cast<VecU32>(v);
    const VecU32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    const VecU32 nan = ((u >> 16) | 0x40u) << 16;
    return reinterpret_cast<Vec>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

#include "fused_moe_grouped.h"

// The step's (token, choice) rows grouped by expert; rows of expert e are [start[e],
// start[e + 1]) of the sorted order.
struct Plan {
    std::vector<int64_t> start;   // [E + 1]
    std::vector<int32_t> token;   // [P]: sorted row p's token
    std::vector<int32_t> expert;  // [P]: sorted row p's expert
    std::vector<int64_t> slot;    // [tokens * topk]: where choice (t, j) went
    std::vector<int32_t> small;   // active experts of at most small_rows(l) rows, ascending
    std::vector<int32_t> large;   // active experts of more rows, ascending
    // the large experts' rows whose gate/up products read gathered x and whose activation
    // is a pass of its own (experts without a paired panel product), set by plan_large
    std::vector<int64_t> gathered_rows;
    // the large experts' grouped products (fused_moe_grouped.h) and their loops' sizes
    std::vector<GroupedProduct> gate_up, down;
    int64_t gate_up_packs = 0, gate_up_units = 0, down_packs = 0, down_units = 0;
};

// Status 1 for an expert id outside [0, E). Experts of at most `small_rows` rows are small.
int group_by_expert(const int32_t* ids, int64_t rows, int64_t topk, int64_t num_experts,
                    int64_t small_rows, Plan& plan) {
    plan.start.assign(num_experts + 1, 0);
    for (int64_t i = 0; i < rows; ++i) {
        if (ids[i] < 0 || ids[i] >= num_experts) return 1;
        ++plan.start[ids[i] + 1];
    }
    for (int64_t e = 0; e < num_experts; ++e) plan.start[e + 1] += plan.start[e];
    std::vector<int64_t> next(plan.start.begin(), plan.start.end() - 1);
    plan.token.resize(rows);
    plan.expert.resize(rows);
    plan.slot.resize(rows);
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t p = next[ids[i]]++;
        plan.token[p] = static_cast<int32_t>(i / topk);
        plan.expert[p] = ids[i];
        plan.slot[i] = p;
    }
    plan.small.clear();
    plan.large.clear();
    for (int32_t e = 0; e < num_experts; ++e) {
        const int64_t n = plan.start[e + 1] - plan.start[e];
        if (n > 0) (n <= small_rows ? plan.small : plan.large).push_back(e);
    }
    return 0;
}

// Elements a weight set's rows hold, checked against its type: 0 when fine, 1 for a K that
// is not whole blocks, 2 for an unknown type.
int check_weights(const ExpertWeights& w, int64_t k) {
    int status = 0;
    const bool known = with_weight_type(static_cast<int>(w.qtype), [&]<class Q>() {
        if (k <= 0 || k % Q::kElems) status = 1;
    });
    return known ? status : 2;
}

// Gate and up are one matrix of 2 * inter rows: adjacent rows of one type and layout.
bool fused_gate_up(const MoeLayer& l) {
    const ExpertWeights &g = l.gate, &u = l.up;
    return g.qtype == u.qtype && g.expert_stride == u.expert_stride &&
           g.row_stride == u.row_stride && !g.scale && !u.scale &&
           static_cast<const uint8_t*>(u.w) == static_cast<const uint8_t*>(g.w) +
                                                     l.inter * g.row_stride;
}

// Scratch rows are padded by ROW_PAD floats: unpadded, xs/ys/gu rows of 1024 floats lie 4 KB
// apart, so the strips driver's transposed stores (and pack_xt's loads) touch 32 rows in one
// L1 set (4K aliasing): with the strips driver at 2,048 tokens (64 experts, hidden 1024,
// inter 512, bf16) 285 ms a layer instead of 295 (noisy; the panel route no longer stores
// transposed, but pack_xt and other types still read and write such rows).
constexpr int64_t ROW_PAD = 16;

struct Scratch {
    float* xs;   // [P, hs]: gathered x (experts with more than DIRECT_ROWS rows)
    float* gu;   // [P, gs]: gate | up (likewise)
    float* act;  // [P, is]
    float* ys;   // [P, hs]: down's output
    int64_t hs, gs, is;  // row strides: hidden, 2 * inter and inter, each + ROW_PAD
    float* xb;    // [tokens, hidden]: x as split rows (bf16 gate/up, BF16_SPLIT), else null
    float* actb;  // [P, inter]: act as split rows (bf16 down, BF16_SPLIT), else null
};

inline float round_bf16(float v) { return to_float(from_float<bf16>(v)); }

// The large experts' grouped products over the scratch rows (gate and up one product when
// they are one matrix, else two sharing the packed x), their packed x in `xt`. Experts whose
// gate and up both take the panel route are one paired product instead, reading x (rows of
// x_stride, indexed by token) in place and writing act itself.
void plan_large(const MoeLayer& l, const Scratch& s, const float* x, int64_t x_stride,
                Plan& plan, std::vector<float>& xt) {
    const int64_t h = l.hidden, inter = l.inter;
    const bool fused = fused_gate_up(l);
    plan.gate_up.clear();
    plan.down.clear();
    plan.gathered_rows.clear();
    int64_t gp = 0, gu = 0, dp = 0, du = 0, need = 0;
    std::vector<int64_t> at;  // each product's xt offset
    for (const int32_t e : plan.large) {
        const int64_t p0 = plan.start[e], m = plan.start[e + 1] - p0;
        if (panel_route(l.gate, h, m) && panel_route(l.up, h, m) && !l.gate.scale &&
            !l.up.scale) {
            GroupedProduct g{&l.gate, e, m, inter, h, x, x_stride, nullptr, false,
                             s.gu + p0 * s.gs, s.gs, plan.token.data() + p0, &l.up,
                             s.act + p0 * s.is, s.is, l.down.qtype == BF16_CODE};
            at.push_back(need);
            need += lay_out(g, nullptr, gp, gu);
            plan.gate_up.push_back(g);
            continue;
        }
        for (int64_t p = p0; p < p0 + m; ++p) plan.gathered_rows.push_back(p);
        GroupedProduct g{&l.gate, e, m, fused ? 2 * inter : inter, h, s.xs + p0 * s.hs,
                         s.hs, nullptr, true, s.gu + p0 * s.gs, s.gs};
        at.push_back(need);
        need += lay_out(g, nullptr, gp, gu);
        plan.gate_up.push_back(g);
        if (!fused) {
            // up shares gate's packed x, unless gate took the panel route (packs none)
            GroupedProduct u{&l.up, e, m, inter, h, s.xs + p0 * s.hs, s.hs, nullptr,
                             panel_route(l.gate, h, m), s.gu + p0 * s.gs + inter, s.gs};
            at.push_back(u.pack ? need : at.back());
            need += lay_out(u, nullptr, gp, gu);
            plan.gate_up.push_back(u);
        }
    }
    for (const int32_t e : plan.large) {
        const int64_t p0 = plan.start[e], m = plan.start[e + 1] - p0;
        GroupedProduct d{&l.down, e, m, h, inter, s.act + p0 * s.is, s.is, nullptr,
                         true, s.ys + p0 * s.hs, s.hs};
        at.push_back(need);
        need += lay_out(d, nullptr, dp, du);
        plan.down.push_back(d);
    }
    xt.resize(static_cast<size_t>(need));
    size_t i = 0;
    for (auto* products : {&plan.gate_up, &plan.down})
        for (GroupedProduct& p : *products) p.xt = xt.data() + at[i++];
    plan.gate_up_packs = gp;
    plan.gate_up_units = gu;
    plan.down_packs = dp;
    plan.down_units = du;
}

struct Call {
    const MoeLayer& l; const Plan& plan; const Scratch& s;  // x: rounded to bf16 for bf16 gate/up
    const float* x; int64_t x_stride, tokens; const float* weights; int64_t topk;
    float* out; int64_t out_stride; bool accumulate;
};

// out[m * DOT_GROUP + (r - n0)] = x[m] · row r of matrix e, for m < R, r in [n0, n1)
// (n1 - n0 <= DOT_GROUP): the direct driver's tiles on row pointers.
template <class Q, int R>
void group_dots(const ExpertWeights& w, int64_t e, int64_t n0, int64_t n1, int64_t k,
                const float* const (&x)[R], float* out) {
    constexpr int NR = dot_tile_rows(R);
    const auto* base = static_cast<const uint8_t*>(w.w) + e * w.expert_stride;
    for (int64_t r0 = n0; r0 < n1; r0 += NR) {
        const BlockRows<Q> src{base + r0 * w.row_stride, w.row_stride,
                               PREFETCH_ROWS * w.row_stride};
        float tile[R * NR];
        dot_tile<Q, R, NR>(src, static_cast<int>(std::min<int64_t>(NR, n1 - r0)), x,
                           k / Q::kElems, tile);
        for (int m = 0; m < R; ++m)
            for (int64_t r = r0; r < std::min(n1, r0 + NR); ++r)
                out[m * DOT_GROUP + r - n0] = tile[m * NR + r - r0];
    }
}

// group_dots for a runtime row count (rows <= DOT_ROWS) and weight type.
void dots(const ExpertWeights& w, int64_t e, int64_t n0, int64_t n1, int64_t k,
          const float* const* x, int rows, float* out) {
    with_rows<DOT_ROWS>(rows, [&]<int R>() {
        const float* xr[R];
        for (int m = 0; m < R; ++m) xr[m] = x[m];
        with_weight_type(static_cast<int>(w.qtype), [&]<class Q>() {
            group_dots<Q, R>(w, e, n0, n1, k, xr, out);
        });
    });
}

// bf16 rows as float32 pairs: a 32-bit lane of a vector of 32 bf16 holds elements 2j (low
// half) and 2j + 1 (high half); `lane << 16` is element 2j as a float, `lane & 0xFFFF0000`
// element 2j + 1. x rows for these tiles are stored split to match ("split rows"): per 32
// elements, the 16 even ones as floats, then the 16 odd ones (split_index).
inline int64_t split_index(int64_t i) { return (i & ~int64_t{31}) + (i & 1) * 16 + (i & 31) / 2; }

// x rows per bf16 unit pass: an expert with more rows is multiplied in passes of at most 4
// rows over the same weight rows (the 4 x 4 tile; the repeat reads come from L1/L2).
// Measured at 32 tokens (8 layers, 64 experts, ~4 rows each, from memory): 77-82 ms instead
// of 84-102 with 5-8 rows in one pass (4 x 3 and 4 x 2 tiles, whose few weight lines per
// instruction keep fewer misses in flight); passes of 2 or 3 rows were slower again.
// Reading a unit's weight rows one after another instead (address order, 4 R accumulators
// per row, x as memory operands: a load per FMA) was slower too: 76.6 ms instead of 71.4
// from memory, 47 instead of 40 with the weights in L1 (interleaved in one process); a
// 64-byte aligned split x changed nothing (72.1).
constexpr int BF16_PASS_ROWS = 4;

// Rows an expert may have and still be a decode ("small") expert: DOT_ROWS, except where all
// three matrices are bf16 and the build splits them (BF16_SPLIT): then up to BF16_UNIT_ROWS,
// in passes of BF16_PASS_ROWS, instead of the whole team's grouped product (which gathers x
// and widens bf16 into strips of 16 rows). Measured (8 layers, 64 random bf16 experts,
// interleaved with the grouped form): 64 tokens from memory 101-116 ms instead of 139-147;
// 32 tokens 70.7-80.5 instead of 74.5-94.9 (there one expert has 12 rows; with the weights
// L1-resident its grouped product took ~7 % of the kernel's time for 4.7 % of its
// multiply-adds).
constexpr int BF16_UNIT_ROWS = 16;
constexpr int UNIT_ROWS = std::max(DOT_ROWS, BF16_UNIT_ROWS);  // the units' arrays

#if defined(__AVX512F__)
constexpr bool BF16_SPLIT = true;
typedef uint32_t Lanes32 __attribute__((vector_size(64)));
// out[m * DOT_GROUP + (r - n0)] = x[m] · row r of bf16 matrix e, for m < R, r in [n0, n1):
// each 64-byte step of a weight row (one cache line, 32 bf16) split into its even and odd
// elements as floats (two integer ops, no shuffle) and multiplied with the split x rows by
// FMAs. The products are exact in float32, as with vdpbf16ps, which this kernel used before:
// on the Xeon it was measured on, FMAs issue two a cycle and vdpbf16ps one in ~1.7, so at
// ~4 rows an expert (32 tokens) the vdpbf16ps tiles were bound by the multiplier, not memory.
template <int R>
void bf16_group_dots(const ExpertWeights& w, int64_t e, int64_t n0, int64_t n1, int64_t k,
                     const float* const* x, float* out) {
    constexpr int NR = dot_tile_rows(R);
    const auto* base = static_cast<const uint8_t*>(w.w) + e * w.expert_stride;
    const int64_t ahead = PREFETCH_ROWS * w.row_stride;
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t r0 = n0; r0 < n1; r0 += NR) {
        const int valid = static_cast<int>(std::min<int64_t>(NR, n1 - r0));
        const uint8_t* rows[NR];
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) rows[r] = base + (r0 + std::min(r, valid - 1)) * w.row_stride;
        __m512 acc[R * NR];
#pragma GCC unroll 16
        for (int i = 0; i < R * NR; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k; i += 32) {
            // the even halves for every x row, then the odd ones: one set of NR weight
            // registers live at a time (with both sets GCC spilled one of the 4 x 4 tile's to
            // an unaligned stack slot each step; no clear change in time was measured, the
            // sums and their order are the same)
            __m512 half[NR];
#pragma GCC unroll 8
            for (int r = 0; r < NR; ++r) {
                __builtin_prefetch(rows[r] + 2 * i + ahead, 0, 2);  // to L2 (gguf_gemv.h)
                // a shift by vector extension: GCC 12's _mm512_slli_epi32 trips
                // -Wmaybe-uninitialized
                half[r] = (__m512)((Lanes32)_mm512_loadu_si512(rows[r] + 2 * i) << 16);
            }
#pragma GCC unroll 8
            for (int m = 0; m < R; ++m) {
                const __m512 xe = _mm512_loadu_ps(x[m] + i);
#pragma GCC unroll 8
                for (int r = 0; r < NR; ++r)
                    acc[m * NR + r] = _mm512_fmadd_ps(xe, half[r], acc[m * NR + r]);
            }
#pragma GCC unroll 8
            for (int r = 0; r < NR; ++r)
                half[r] = _mm512_castsi512_ps(
                    _mm512_and_si512(_mm512_loadu_si512(rows[r] + 2 * i), high));
#pragma GCC unroll 8
            for (int m = 0; m < R; ++m) {
                const __m512 xo = _mm512_loadu_ps(x[m] + i + 16);
#pragma GCC unroll 8
                for (int r = 0; r < NR; ++r)
                    acc[m * NR + r] = _mm512_fmadd_ps(xo, half[r], acc[m * NR + r]);
            }
        }
        Vec v[R * NR];
        float tile[R * NR];
#pragma GCC unroll 16
        for (int i = 0; i < R * NR; ++i) v[i] = (Vec)acc[i];
        reduce_lanes(v, tile);
        for (int m = 0; m < R; ++m)
            for (int r = 0; r < valid; ++r) out[m * DOT_GROUP + r0 + r - n0] = tile[m * NR + r];
    }
}

#else
constexpr bool BF16_SPLIT = false;
#endif

// The most rows a small expert of layer l has (above).
int64_t small_rows(const MoeLayer& l) {
    const bool bf16 = l.gate.qtype == BF16_CODE && l.up.qtype == BF16_CODE &&
                      l.down.qtype == BF16_CODE;
    return BF16_SPLIT && bf16 ? BF16_UNIT_ROWS : DOT_ROWS;
}

// dots() for bf16 weights and split x rows (only called where BF16_SPLIT), rows <=
// BF16_UNIT_ROWS.
void bf16_dots(const ExpertWeights& w, int64_t e, int64_t n0, int64_t n1, int64_t k,
               const float* const* x, int rows, float* out) {
#if defined(__AVX512F__)
    for (int m0 = 0; m0 < rows; m0 += BF16_PASS_ROWS) {
        with_rows<BF16_PASS_ROWS>(std::min(BF16_PASS_ROWS, rows - m0), [&]<int R>() {
            bf16_group_dots<R>(w, e, n0, n1, k, x + m0, out + m0 * DOT_GROUP);
        });
    }
#else
    (void)w, (void)e, (void)n0, (void)n1, (void)k, (void)x, (void)rows, (void)out;
#endif
}

// g[i] = silu(g[i] * gs[c]) * (u[i] * us[c]) for i < n, in place (whole vectors and a
// zero-padded tail), with c = i % period: rows of `period` columns of which the first
// `valid` count (gs, us: their scales, or null: 1; the other columns' results are not used).
void silu_mul_in_place(float* g, float* u, int64_t n, const float* gs, const float* us,
                       int64_t period, int64_t valid) {
    for (int64_t i = 0; (gs || us) && i < n; ++i) {
        const int64_t c = i % period;
        if (c < valid && gs) g[i] *= gs[c];
        if (c < valid && us) u[i] *= us[c];
    }
    int64_t i = 0;
    for (; i + W <= n; i += W) store(g + i, silu_mul(load(g + i), load(u + i)));
    if (i < n) {
        float gt[W] = {}, ut[W] = {};
        std::memcpy(gt, g + i, (n - i) * sizeof(float));
        std::memcpy(ut, u + i, (n - i) * sizeof(float));
        store(gt, silu_mul(load(gt), load(ut)));
        std::memcpy(g + i, gt, (n - i) * sizeof(float));
    }
}

// act[n0 + c] = v[c] for c < n, rounded to bf16 for a bf16 down (and then also written to
// actb as a split row, if not null).
void store_act(const MoeLayer& l, int64_t n0, int64_t n, const float* v, float* act,
               float* actb) {
    const bool round = l.down.qtype == BF16_CODE;
    for (int64_t i = 0; i < n; ++i) {
        act[n0 + i] = round ? round_bf16(v[i]) : v[i];
        if (actb) actb[split_index(n0 + i)] = act[n0 + i];
    }
}

// The experts of at most small_rows(l) rows ("small", decode), all in one worksharing loop over
// units (expert, DOT_GROUP intermediate columns): gate and up rows dotted with the rows' x
// in place (no gather), then activated. Threads take an expert's units at a time as they
// come free (the experts' row counts differ, and a thread the OS takes away for a while
// leaves its share to the others).
void small_gate_up(const Call& c) {
    const MoeLayer& l = c.l;
    const std::vector<int32_t>& small = c.plan.small;
    const int64_t groups = (l.inter + DOT_GROUP - 1) / DOT_GROUP;
#pragma omp for schedule(dynamic, groups) nowait
    for (int64_t u = 0; u < static_cast<int64_t>(small.size()) * groups; ++u) {
        const int64_t e = small[u / groups], n0 = u % groups * DOT_GROUP;
        const int64_t n1 = std::min(l.inter, n0 + DOT_GROUP), p0 = c.plan.start[e];
        const int rows = static_cast<int>(c.plan.start[e + 1] - p0);
        const float* x[UNIT_ROWS];
        for (int m = 0; m < rows; ++m) x[m] = c.x + c.plan.token[p0 + m] * c.x_stride;
        float g[UNIT_ROWS * DOT_GROUP] = {}, v[UNIT_ROWS * DOT_GROUP] = {};
        if (c.s.xb) {
            const float* xb[UNIT_ROWS];
            for (int m = 0; m < rows; ++m) xb[m] = c.s.xb + c.plan.token[p0 + m] * l.hidden;
            bf16_dots(l.gate, e, n0, n1, l.hidden, xb, rows, g);
            bf16_dots(l.up, e, n0, n1, l.hidden, xb, rows, v);
        } else {
            dots(l.gate, e, n0, n1, l.hidden, x, rows, g);
            dots(l.up, e, n0, n1, l.hidden, x, rows, v);
        }
        silu_mul_in_place(g, v, rows * DOT_GROUP,
                          l.gate.scale ? l.gate.scale + e * l.gate.scale_stride + n0 : nullptr,
                          l.up.scale ? l.up.scale + e * l.up.scale_stride + n0 : nullptr,
                          DOT_GROUP, n1 - n0);
        for (int m = 0; m < rows; ++m)
            store_act(l, n0, n1 - n0, g + m * DOT_GROUP, c.s.act + (p0 + m) * c.s.is,
                      c.s.actb ? c.s.actb + (p0 + m) * l.inter : nullptr);
    }
}

// The large experts (prefill): gate/up as one grouped product, activated. Rows of experts
// without a paired panel product are gathered before and activated after it.
void large_gate_up(const Call& c) {
    const MoeLayer& l = c.l;
    const std::vector<int64_t>& rows = c.plan.gathered_rows;
    if (c.plan.large.empty()) return;
    if (!rows.empty()) {
#pragma omp for schedule(static)
        for (size_t i = 0; i < rows.size(); ++i)
            std::memcpy(c.s.xs + rows[i] * c.s.hs, c.x + c.plan.token[rows[i]] * c.x_stride,
                        l.hidden * sizeof(float));
    }
    grouped_products(c.plan.gate_up, c.plan.gate_up_packs, c.plan.gate_up_units);
    if (rows.empty()) return;
#pragma omp for schedule(static)
    for (size_t i = 0; i < rows.size(); ++i) {
        float* g = c.s.gu + rows[i] * c.s.gs;
        const int64_t e = c.plan.expert[rows[i]];
        silu_mul_in_place(g, g + l.inter, l.inter,
                          l.gate.scale ? l.gate.scale + e * l.gate.scale_stride : nullptr,
                          l.up.scale ? l.up.scale + e * l.up.scale_stride : nullptr, l.inter,
                          l.inter);
        store_act(l, 0, l.inter, g, c.s.act + rows[i] * c.s.is, nullptr);
    }
}

// ys = act · downᵀ per expert: the small experts in one loop over (expert, DOT_GROUP hidden
// rows) units, the large ones as one grouped product.
void down(const Call& c) {
    const MoeLayer& l = c.l;
    const std::vector<int32_t>& small = c.plan.small;
    const int64_t groups = (l.hidden + DOT_GROUP - 1) / DOT_GROUP;
#pragma omp for schedule(dynamic, groups) nowait
    for (int64_t u = 0; u < static_cast<int64_t>(small.size()) * groups; ++u) {
        const int64_t e = small[u / groups], n0 = u % groups * DOT_GROUP;
        const int64_t n1 = std::min(l.hidden, n0 + DOT_GROUP), p0 = c.plan.start[e];
        const int rows = static_cast<int>(c.plan.start[e + 1] - p0);
        float y[UNIT_ROWS * DOT_GROUP];
        if (c.s.actb) {
            const float* x[UNIT_ROWS];
            for (int m = 0; m < rows; ++m) x[m] = c.s.actb + (p0 + m) * l.inter;
            bf16_dots(l.down, e, n0, n1, l.inter, x, rows, y);
        } else {
            const float* x[UNIT_ROWS];
            for (int m = 0; m < rows; ++m) x[m] = c.s.act + (p0 + m) * c.s.is;
            dots(l.down, e, n0, n1, l.inter, x, rows, y);
        }
        for (int m = 0; m < rows; ++m)
            std::memcpy(c.s.ys + (p0 + m) * c.s.hs + n0, y + m * DOT_GROUP,
                        (n1 - n0) * sizeof(float));
    }
    if (!c.plan.large.empty())
        grouped_products(c.plan.down, c.plan.down_packs, c.plan.down_units);
}

void combine(const Call& c) {
    const MoeLayer& l = c.l;
    const int64_t h = l.hidden;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < c.tokens; ++t) {
        float* o = c.out + t * c.out_stride;
        for (int64_t j = 0; j < c.topk; ++j) {
            const int64_t p = c.plan.slot[t * c.topk + j];
            const float w = c.weights[t * c.topk + j];
            const float* y = c.s.ys + p * c.s.hs;
            const float* ds = l.down.scale ? l.down.scale + c.plan.expert[p] * l.down.scale_stride
                                           : nullptr;
            const bool first = j == 0 && !c.accumulate;
            for (int64_t i = 0; i < h; ++i) {
                const float v = w * (ds ? y[i] * ds[i] : y[i]);
                o[i] = first ? v : o[i] + v;
            }
        }
    }
}

// Every step by every thread of the region (or by one thread outside any). The small
// experts' loops end without a barrier, the large experts' products and the barriers below
// order the rest: a decode step passes three barriers.
void moe_team(const Call& c) {
    small_gate_up(c);
    large_gate_up(c);
#pragma omp barrier
    down(c);
#pragma omp barrier
    combine(c);
}

}  // namespace

extern "C" {

// Status: 0; 1 for bad sizes or an expert id outside [0, E); 2 for a weight type without a
// kernel here.
__attribute__((visibility("default")))
int fused_moe_forward(const MoeLayer* l, const float* x, int64_t x_stride, int64_t tokens,
                      const int32_t* ids, const float* weights, int64_t topk, float* out,
                      int64_t out_stride, int accumulate, int num_threads) {
    if (tokens < 0 || topk <= 0 || num_threads < 1 || l->num_experts <= 0) return 1;
    for (const auto& [w, k] : {std::pair{l->gate, l->hidden}, std::pair{l->up, l->hidden},
                               std::pair{l->down, l->inter}}) {
        if (const int status = check_weights(w, k)) return status;
    }
    if (tokens == 0) return 0;
    thread_local Plan plan;
    const int64_t rows = tokens * topk;
    if (group_by_expert(ids, rows, topk, l->num_experts, small_rows(*l), plan)) return 1;
    thread_local std::vector<float> buffer;
    thread_local std::vector<float> split;  // the split rows (BF16_SPLIT)
    const int64_t h = l->hidden, inter = l->inter;
    const bool bf16_in = l->gate.qtype == BF16_CODE && l->up.qtype == BF16_CODE;
    const bool bf16_act = l->down.qtype == BF16_CODE;
    const int64_t hs = h + ROW_PAD, gs = 2 * inter + ROW_PAD, is = inter + ROW_PAD;
    const int64_t scratch = rows * (2 * hs + gs + is);
    buffer.resize(static_cast<size_t>(scratch + (bf16_in ? tokens * hs : 0)));
    split.resize(BF16_SPLIT ? static_cast<size_t>(tokens * h + rows * inter) : 0);
    // x rounded (bf16_in), rows padded like the scratch's: the paired panel products read
    // 6 token rows at a time in place, which unpadded share one L1 set at each k
    float* const xr = buffer.data() + scratch;
    float* const b = buffer.data();
    // the split rows only for small (decode) experts' units
    const bool split_rows = BF16_SPLIT && !plan.small.empty();
    const Scratch s{b, b + rows * hs, b + rows * (hs + gs), b + rows * (hs + gs + is), hs, gs, is,
                    split_rows && bf16_in ? split.data() : nullptr,
                    split_rows && bf16_act ? split.data() + tokens * h : nullptr};
    const bool parallel = num_threads > 1 && rows * 3 * inter * h >= PARALLEL_WORK;
    if (bf16_in) {  // x rounded to bf16 once: as floats for the tiles, and as split rows
#pragma omp parallel for num_threads(num_threads) if (parallel && tokens >= 64)
        for (int64_t t = 0; t < tokens; ++t) {
            const float* xrow = x + t * x_stride;
            float* rt = xr + t * hs;
            int64_t i = 0;
            for (; i + W <= h; i += W) store(rt + i, round_bf16(load(xrow + i)));
            for (; i < h; ++i) rt[i] = round_bf16(xrow[i]);
            for (i = 0; s.xb && i < h; ++i) s.xb[t * h + split_index(i)] = rt[i];
        }
        x = xr;
        x_stride = hs;
    }
    thread_local std::vector<float> xt;
    plan_large(*l, s, x, x_stride, plan, xt);
    const Call c{*l, plan, s, x, x_stride, tokens, weights, topk, out, out_stride,
                 accumulate != 0};
#pragma omp parallel num_threads(num_threads) if (parallel)
    moe_team(c);
    return 0;
}

}  // extern "C"
