// A mixture-of-experts feed-forward over one step's tokens, in one call and one OpenMP
// parallel region (worker/layers/fused_moe/):
//   out[t] (+)= Σ_j weight[t, j] · down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
// 1. group: the (token, choice) rows are sorted by expert (a counting sort, tokens ascending
//    within an expert), serially before the region;
// 2. gather: each row's x copied into a contiguous block per expert;
// 3. gate/up: one product per active expert over its rows (one matrix when gate and up are
//    adjacent rows of the same type, else two), into [rows, 2 * inter];
// 4. act = silu(gate) * up, per row (weight-only int8's row scales applied here);
// 5. down: one product per active expert, into [rows, hidden];
// 6. combine: each token's rows weighted and summed in choice order j = 0..topk-1 (so a token's
//    result does not depend on the rest of the batch), into out or added to it.
// Inactive experts are never read. Each product is gguf_drive.h's `drive<Q>` on one expert's
// matrix (GGUF blocks, int8, or dense float32 / bfloat16 / float16 rows: dense_blocks.h), run
// by the whole team: its rows (few tokens: decode) or strips (many: prefill) are shared among
// the threads, ending in a barrier. Float32 activations and accumulation throughout.
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

// The step's (token, choice) rows grouped by expert; rows of expert e are [start[e],
// start[e + 1]) of the sorted order.
struct Plan {
    std::vector<int64_t> start;   // [E + 1]
    std::vector<int32_t> token;   // [P]: sorted row p's token
    std::vector<int32_t> expert;  // [P]: sorted row p's expert
    std::vector<int64_t> slot;    // [tokens * topk]: where choice (t, j) went
};

// Status 1 for an expert id outside [0, E).
int group_by_expert(const int32_t* ids, int64_t rows, int64_t topk, int64_t num_experts,
                    Plan& plan) {
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

// y [rows, n] = x [rows, k] · matrix eᵀ of `w`, by the whole team.
void expert_product(const ExpertWeights& w, int64_t e, const float* x, int64_t x_stride,
                    float* y, int64_t y_stride, int64_t rows, int64_t n, int64_t k) {
    const Args a{static_cast<const uint8_t*>(w.w) + e * w.expert_stride, w.row_stride, x,
                 x_stride, y, y_stride, rows, n, k, false};
    with_weight_type(static_cast<int>(w.qtype), [&]<class Q>() { drive<Q>(a); });
}

// Gate and up are one matrix of 2 * inter rows: adjacent rows of one type and layout.
bool fused_gate_up(const MoeLayer& l) {
    const ExpertWeights &g = l.gate, &u = l.up;
    return g.qtype == u.qtype && g.expert_stride == u.expert_stride &&
           g.row_stride == u.row_stride && !g.scale && !u.scale &&
           static_cast<const uint8_t*>(u.w) == static_cast<const uint8_t*>(g.w) +
                                                     l.inter * g.row_stride;
}

struct Scratch {
    float* xs;   // [P, hidden]: gathered x
    float* gu;   // [P, 2 * inter]: gate | up
    float* act;  // [P, inter]
    float* ys;   // [P, hidden]: down's output
};

struct Call {
    const MoeLayer& l; const Plan& plan; const Scratch& s;
    const float* x; int64_t x_stride, tokens; const float* weights; int64_t topk;
    float* out; int64_t out_stride; bool accumulate;
};

void gather(const Call& c) {
    const int64_t h = c.l.hidden, rows = c.tokens * c.topk;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < rows; ++p)
        std::memcpy(c.s.xs + p * h, c.x + c.plan.token[p] * c.x_stride, h * sizeof(float));
}

void gate_up(const Call& c) {
    const MoeLayer& l = c.l;
    const int64_t h = l.hidden, inter = l.inter;
    const bool fused = fused_gate_up(l);
    for (int64_t e = 0; e < l.num_experts; ++e) {
        const int64_t p0 = c.plan.start[e], rows = c.plan.start[e + 1] - p0;
        if (rows == 0) continue;
        const float* xe = c.s.xs + p0 * h;
        float* y = c.s.gu + p0 * 2 * inter;
        if (fused) {
            expert_product(l.gate, e, xe, h, y, 2 * inter, rows, 2 * inter, h);
        } else {
            expert_product(l.gate, e, xe, h, y, 2 * inter, rows, inter, h);
            expert_product(l.up, e, xe, h, y + inter, 2 * inter, rows, inter, h);
        }
    }
}

void activation(const Call& c) {
    const MoeLayer& l = c.l;
    const int64_t inter = l.inter, rows = c.tokens * c.topk;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < rows; ++p) {
        const int64_t e = c.plan.expert[p];
        const float* g = c.s.gu + p * 2 * inter;
        const float* u = g + inter;
        float* a = c.s.act + p * inter;
        if (l.gate.scale) {
            const float* gs = l.gate.scale + e * l.gate.scale_stride;
            const float* us = l.up.scale + e * l.up.scale_stride;
            for (int64_t i = 0; i < inter; ++i) a[i] = silu(g[i] * gs[i]) * (u[i] * us[i]);
        } else {
            for (int64_t i = 0; i < inter; ++i) a[i] = silu(g[i]) * u[i];
        }
    }
}

void down(const Call& c) {
    const MoeLayer& l = c.l;
    for (int64_t e = 0; e < l.num_experts; ++e) {
        const int64_t p0 = c.plan.start[e], rows = c.plan.start[e + 1] - p0;
        if (rows == 0) continue;
        expert_product(l.down, e, c.s.act + p0 * l.inter, l.inter, c.s.ys + p0 * l.hidden,
                       l.hidden, rows, l.hidden, l.inter);
    }
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
            const float* y = c.s.ys + p * h;
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

// Every step by every thread of the region (or by one thread outside any).
void moe_team(const Call& c) {
    gather(c);
    gate_up(c);
    activation(c);
    down(c);
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
    if (group_by_expert(ids, rows, topk, l->num_experts, plan)) return 1;
    thread_local std::vector<float> buffer;
    const int64_t h = l->hidden, inter = l->inter;
    buffer.resize(static_cast<size_t>(rows * (2 * h + 3 * inter)));
    const Scratch s{buffer.data(), buffer.data() + rows * h, buffer.data() + rows * (h + 2 * inter),
                    buffer.data() + rows * (h + 3 * inter)};
    const Call c{*l, plan, s, x, x_stride, tokens, weights, topk, out, out_stride,
                 accumulate != 0};
    const bool parallel = num_threads > 1 && rows * 3 * inter * h >= PARALLEL_WORK;
#pragma omp parallel num_threads(num_threads) if (parallel)
    moe_team(c);
    return 0;
}

}  // extern "C"
