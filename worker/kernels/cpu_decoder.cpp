// A decoder's layers over a few token rows in one call and one OpenMP parallel region: the
// per-layer sequence of the Python layer loop (worker/models/llama.py, gemma3.py, moe.py), each
// step a call of the same kernel the loop would make, so the results are the loop's bit for
// bit. What it saves is the loop's per-layer cost: ~9-13 ctypes calls, their allocations and
// parallel regions. A layer is Llama's (norm, q/k/v, rotary, attention, o, norm, gate/up, silu,
// down) or, where its optional parts are set, Gemma 3's: q/k head norms after q/k/v, a norm of
// the attention output and of the MLP output before each is added, GELU-tanh, and its own
// rotary table and KV group (block table, slots, sliding window).
//
// A mixture-of-experts layer (Layer::moe set) has, instead of gate/up/down, a router linear
// (its logits made in the region), the routing of moe_routing.h (on one thread) and the fused
// experts (fused_moe.cpp's entry point, which opens its own parallel region): so the region
// ends before a MoE layer's experts and the next one starts after them (a Qwen3-MoE step runs
// one region per layer). A bf16 MoE layer's norms round their output to bf16 (its compute
// dtype: the experts and the dense-driver linears take those values as float32 rows), and a
// 16-bit KV cache takes q/k/v rounded to its dtype and gives the attention output back in it,
// widened to float32 for o_proj, as the Python layers and attention backend do.
//
// The kernels live in their own libraries (cpu_ops, gguf_matmul, cpu_paged_attention) and
// are reached through the function pointers in Kernels. Each is called by every thread of
// this region with the same arguments and num_threads = 0, which makes it share its rows
// among the team (an orphaned worksharing loop) and end in that loop's barrier, so a step's
// output is complete before the next step reads it. A step's status is the same on every
// thread (it depends only on the arguments), so all threads leave the loop together.
//
// Layouts (float32, row-major, rows contiguous; m token rows, row strides the widths):
//   residual [m, hidden]          the float32 stream, updated in place
//   pending  [m, hidden]          out: the last layer's MLP output, not yet added to residual
//   h [m, hidden], qkv [m, (num_heads + 2 num_kv_heads) head_dim], attn [m, num_heads
//   head_dim], gate_up [m, 2 intermediate], act [m, intermediate]: scratch
//   k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] per layer, float32 or
//   the 16-bit dtype of Model::cache_dtype
//   Linear: W [N, K] as segments of output rows [start, stop), each a GGUF matrix (qtype,
//   row bytes at w + r * w_stride); `scale` (may be null) multiplies output column n by
//   scale[n] afterwards (weight-only int8's row scales).
//   cos/sin [max_position, head_dim] float32: the layer's rotary table.
//   Group g (a layer's KV group): its slot_mapping [m], block_table [requests, bt_stride],
//   attention work items, and sliding window (0: full attention).
//   LoRA (Step.lora, null without adapter rows): after linear j (qkv, o, gate_up, down) of
//   layer i, each adapter's rows get y[r] += (x[r] · aᵀ) · b with its factors of target
//   4 i + j: a [rank, K], b [rank, N] (float32, the scaling folded into b; a null a: that
//   adapter leaves the layer alone; spans, if set, [rank, 2]: the columns where b's row j may
//   be nonzero). rows[bounds[n]:bounds[n + 1]] are adapter n's step rows;
//   t [rows, max rank] is scratch (every adapter's rows at once). cpu_decoder_lora_delta
//   applies one linear's deltas alone (the Python layer loop's), its tables then indexed by
//   that loop's target index.
//   AllReduce (Step.reduce, null at one rank): a tensor-parallel rank's o_proj and down_proj
//   give partial sums; after each (and its LoRA deltas, before any output norm) pending
//   [m, hidden] is summed in place across the ranks by the shm all-reduce
//   (shm_all_reduce.cpp's entry point, called by one thread of the team), call c of the step
//   (c = 2 i for layer i's o_proj, 2 i + 1 for its down_proj) with sequence number
//   first_seq + c: the numbers the Python loop's RowParallelLinear would have used, so the
//   sums are its bits and the ranks may even take different loops in a step. `calls` (out)
//   counts the sums made (the caller's next sequence number is first_seq + calls, also when a
//   kernel failed part way).
#include <cstdint>

#include "cpu_dtypes.h"
#include "moe_routing.h"

namespace {

using MatmulFn = int (*)(int, const void*, int64_t, const float*, int64_t, float*, int64_t,
                         int64_t, int64_t, int64_t, int, int);
using NormFn = int (*)(int, int, void*, int64_t, const void*, int64_t, float*, int64_t,
                       const float*, int64_t, int64_t, float, int);
using SiluFn = int (*)(int, void*, int64_t, const void*, int64_t, int64_t, int64_t, int);
using HeadNormFn = int (*)(int, void*, int64_t, int, int64_t, const float*, int64_t, float, int);
using RopeFn = int (*)(int, const int64_t*, void*, int64_t, int, void*, int64_t, int, int64_t,
                       int, const float*, const float*, int64_t, int);
using AttentionFn = int (*)(int, const void*, int64_t, const void*, int64_t, const void*,
                            int64_t, void*, void*, const int64_t*, int64_t, const int32_t*,
                            const int32_t*, const int32_t*, int64_t, const int32_t*, int64_t,
                            void*, int, int, int, int, float, int, int);
// shm_all_reduce(base, slot_bytes, rank, world, seq, dtype, data, numel, timeout_s)
using AllReduceFn = int (*)(void*, int64_t, int, int, uint64_t, int, void*, int64_t, double);
// fused_moe_forward(layer, x, x_stride, tokens, ids, weights, topk, out, out_stride,
//                   accumulate, num_threads): opens its own parallel region
using MoeFn = int (*)(const void*, const float*, int64_t, int64_t, const int32_t*, const float*,
                      int64_t, float*, int64_t, int, int);

constexpr int MAX_GROUPS = 8;

constexpr int MAX_SEGMENTS = 4;
constexpr int F32 = 0;   // cpu_dtypes.h's dtype codes
constexpr int BF16 = 1;
constexpr int F16 = 2;
constexpr int DTYPE_MASK = 0xF;  // a code's dtype; above it, a kernel's flags (BF16_DOT)
constexpr int TEAM = 0;  // num_threads: a step of the enclosing region
// A failed all-reduce's status is this plus shm_all_reduce's (1: a peer did not answer in
// time, 2/3: bad arguments); the kernels' own statuses are below it.
constexpr int REDUCE_STATUS = 16;

}  // namespace

// Mirrored by ctypes Structures in worker/native/cpu_decoder.py (same order and types).
struct Kernels {
    MatmulFn matmul; NormFn norm; SiluFn silu; RopeFn rope; AttentionFn attention;
    SiluFn gelu_tanh; HeadNormFn head_norm;
    MoeFn moe;  // null: no fused MoE library (no MoE layer is taken)
};
struct Segment {
    int64_t qtype; const void* w; int64_t w_stride; int64_t start, stop;
};
struct Linear {
    int64_t k; const float* scale; int64_t num_segments; Segment segments[MAX_SEGMENTS];
};
struct Layer {
    const float* input_norm; const float* post_norm;  // post_norm: before the MLP
    Linear qkv, o, gate_up, down;
    void* k_cache; void* v_cache;
    // Optional (null: a Llama layer's): q/k head norms, norms of the attention and MLP
    // outputs before they are added.
    const float* q_norm; const float* k_norm; const float* attn_out_norm;
    const float* mlp_out_norm;
    const float* cos; const float* sin;
    int64_t group;  // its KV group in Step::groups
    // The dtype its norms round their output to (F32 or BF16: a bf16 MoE layer's compute
    // dtype; the linears still take float32 rows of those values).
    int64_t norm_dtype;
    // A mixture-of-experts layer (moe: fused_moe.cpp's MoeLayer; null: the dense MLP of
    // gate_up/down): router [num_experts, hidden] gives the logits, moe_routing.h the top_k
    // experts (renormalized or not), the fused kernel this rank's partial sum.
    const void* moe; Linear router; int64_t num_experts, top_k, renormalize;
};
struct Model {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, max_position;
    float eps, scale;
    int64_t gelu;  // the MLP's activation: 0 silu, 1 gelu (tanh approximation)
    // The KV caches' dtype code as the attention kernel takes it (flags included): F32, or
    // BF16/F16 (q/k/v rounded to it, the attention output widened back to float32).
    int64_t cache_dtype;
};
struct Group {
    const int64_t* slot_mapping; const int32_t* block_table; int64_t bt_stride;
    const int32_t* items; int64_t num_items; int64_t window;
};
struct LoRAFactors {
    int64_t rank; const float* a; const float* b;
    const int64_t* spans;  // [rank, 2]: b's row j is zero outside [spans[2j], spans[2j + 1])
};
struct LoRAStep {
    int64_t num_adapters; const LoRAFactors* const* tables; const int64_t* bounds;
    const int64_t* rows; float* t;
};
struct AllReduce {
    AllReduceFn sum; void* base; int64_t slot_bytes; int64_t rank, world;
    uint64_t first_seq; double timeout_s;
    int64_t calls;  // out: the sums made
};
struct Step {
    int64_t m; const int64_t* positions;
    const int32_t* query_start_loc; const int32_t* seq_lens;
    int64_t num_groups; Group groups[MAX_GROUPS];
    float* residual; float* pending; float* h; float* qkv; float* attn; float* gate_up;
    float* act; const LoRAStep* lora; AllReduce* reduce;
    // 16-bit scratch (2 bytes an element): h16 [m, hidden] (a bf16 norm's output), qkv16
    // [m, qkv width], attn16 [m, num_heads head_dim] (16-bit caches); MoE routing: logits
    // [m, max experts] float32, topk_ids int32 / topk_weights float32 [m, max top_k].
    uint16_t* h16; uint16_t* qkv16; uint16_t* attn16;
    float* logits; int32_t* topk_ids; float* topk_weights;
};

namespace {

// Floats per token row of the fused q/k/v projection.
int64_t qkv_width(const Model& d) { return (d.num_heads + 2 * d.num_kv_heads) * d.head_dim; }

// y [m, N] (row stride y_stride) = x [m, K] (row stride x_stride) · Wᵀ, then × scale.
int linear(const Kernels& f, const Linear& w, const float* x, int64_t x_stride, float* y,
           int64_t y_stride, int64_t m) {
    int64_t n = 0;
    for (int64_t s = 0; s < w.num_segments; ++s) {
        const Segment& g = w.segments[s];
        const int status = f.matmul(static_cast<int>(g.qtype), g.w, g.w_stride, x, x_stride,
                                    y + g.start, y_stride, m, g.stop - g.start, w.k, 0, TEAM);
        if (status) return status;
        n = g.stop;
    }
    if (w.scale) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < n; ++c) y[r * y_stride + c] *= w.scale[c];
    }
    return 0;
}

constexpr int64_t LORA_COLUMNS = 256;  // output columns one expand work item adds to
constexpr int64_t LORA_DOTS = 4;  // rank rows one shrink work item reads a row of x against
// Below this many multiply-adds a linear's deltas run on the calling thread alone: a parallel
// region of their own costs its threads' wake-ups (futex round trips of tens of µs each on a
// VM), more than one thread takes for them at this size.
constexpr int64_t LORA_SERIAL_MACS = int64_t{1} << 20;

// t[0..count) = x_row · a_j for rank rows j = first .. first + count (count <= LORA_DOTS): x
// is read once for all of them, each sum in its own accumulator.
inline void lora_dots(const float* xr, const float* a, int64_t k, int64_t first, int64_t count,
                      float* t) {
    const float* a0 = a + first * k;
    const float* a1 = a0 + (count > 1 ? k : 0);
    const float* a2 = a0 + (count > 2 ? 2 * k : 0);
    const float* a3 = a0 + (count > 3 ? 3 * k : 0);
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t c = 0; c < k; ++c) {
        const float v = xr[c];
        s0 += v * a0[c]; s1 += v * a1[c]; s2 += v * a2[c]; s3 += v * a3[c];
    }
    const float sums[LORA_DOTS] = {s0, s1, s2, s3};
    for (int64_t j = 0; j < count; ++j) t[j] = sums[j];
}

// The adapter whose rows [bounds[a], bounds[a + 1]) hold row p of the step's adapter rows.
inline int64_t lora_adapter_of(const LoRAStep* lora, int64_t p) {
    int64_t ad = 0;
    while (lora->bounds[ad + 1] <= p) ++ad;
    return ad;
}

// y [., N] += each adapter's (x · aᵀ) · b on its rows (target: the linear's LoRA index), as
// punica's one shrink and one expand over all adapters' rows: a worksharing loop
// t = x · aᵀ over (row, LORA_DOTS rank rows) items, then y += t · b over (row, column block)
// items, rank row j only over its columns [spans[2j], spans[2j + 1]) (the rest of b's row is
// zero: a merged layer's other parts). Two barriers, however many adapters. t's row p (of
// the adapter rows, in adapter order) is at t + p · (the largest rank of this target).
void lora_delta(const LoRAStep* lora, int64_t target, const float* x, int64_t x_stride,
                float* y, int64_t y_stride, int64_t k, int64_t n) {
    if (!lora || lora->num_adapters <= 0) return;
    int64_t width = 0;  // t's row stride
    for (int64_t ad = 0; ad < lora->num_adapters; ++ad) {
        const LoRAFactors& f = lora->tables[ad][target];
        if (f.a && f.rank > width) width = f.rank;
    }
    const int64_t total = lora->bounds[lora->num_adapters];
    if (width == 0 || total <= 0) return;
    const int64_t groups = (width + LORA_DOTS - 1) / LORA_DOTS;
    const int64_t blocks = (n + LORA_COLUMNS - 1) / LORA_COLUMNS;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < total * groups; ++q) {
        const int64_t p = q / groups, j0 = (q % groups) * LORA_DOTS;
        const LoRAFactors& f = lora->tables[lora_adapter_of(lora, p)][target];
        if (!f.a || j0 >= f.rank) continue;
        const int64_t count = f.rank - j0 < LORA_DOTS ? f.rank - j0 : LORA_DOTS;
        lora_dots(x + lora->rows[p] * x_stride, f.a, k, j0, count, lora->t + p * width + j0);
    }
#pragma omp for schedule(static)
    for (int64_t q = 0; q < total * blocks; ++q) {
        const int64_t p = q / blocks, b0 = (q % blocks) * LORA_COLUMNS;
        const int64_t b1 = b0 + LORA_COLUMNS < n ? b0 + LORA_COLUMNS : n;
        const LoRAFactors& f = lora->tables[lora_adapter_of(lora, p)][target];
        if (!f.a) continue;
        float* yr = y + lora->rows[p] * y_stride;
        const float* tr = lora->t + p * width;
        for (int64_t j = 0; j < f.rank; ++j) {
            const int64_t c0 = f.spans && f.spans[2 * j] > b0 ? f.spans[2 * j] : b0;
            const int64_t c1 = f.spans && f.spans[2 * j + 1] < b1 ? f.spans[2 * j + 1] : b1;
            const float tj = tr[j];
            const float* br = f.b + j * n;
#pragma omp simd
            for (int64_t c = c0; c < c1; ++c) yr[c] += tj * br[c];
        }
    }
}

// The multiply-adds of one linear's deltas (what decides whether they get a parallel region).
int64_t lora_macs(const LoRAStep* lora, int64_t target, int64_t k, int64_t n) {
    int64_t macs = 0;
    for (int64_t ad = 0; ad < lora->num_adapters; ++ad) {
        const LoRAFactors& f = lora->tables[ad][target];
        if (f.a) macs += (lora->bounds[ad + 1] - lora->bounds[ad]) * f.rank * (k + n);
    }
    return macs;
}

// pending [m, hidden] summed across the tensor-parallel ranks (call c of the step; nothing at
// one rank). One thread calls the all-reduce; the single's barrier publishes the sum and its
// status to the team (the preceding product ended in a barrier, so pending is complete).
int reduce_pending(const Model& d, const Step& s, int64_t call) {
    AllReduce* r = s.reduce;
    if (!r) return 0;
    int status = 0;
#pragma omp single copyprivate(status)
    {
        status = r->sum(r->base, r->slot_bytes, static_cast<int>(r->rank),
                        static_cast<int>(r->world), r->first_seq + static_cast<uint64_t>(call),
                        F32, s.pending, s.m * d.hidden, r->timeout_s);
        r->calls = call + 1;
    }
    return status ? REDUCE_STATUS + status : 0;
}

// dst[r * width + c] = src[r * width + c] widened (T -> float) or rounded (float -> T) for
// the step's rows, shared among the team.
template <class To, class From>
void convert_rows(To* dst, const From* src, int64_t m, int64_t width) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < width; ++c)
            dst[r * width + c] = from_float<To>(to_float(src[r * width + c]));
}

// residual += x (unless x is null), then h = RMSNorm(residual) · weight, rounded to the
// layer's norm dtype (a bf16 norm writes h16, then h holds its values as floats).
int add_and_norm(const Kernels& f, const Model& d, const Layer& l, const Step& s,
                 const float* x, const float* weight) {
    const int64_t hd = d.hidden;
    const bool round = l.norm_dtype == BF16;
    void* out = round ? static_cast<void*>(s.h16) : static_cast<void*>(s.h);
    const int out_dtype = round ? BF16 : F32;
    const int status = x ? f.norm(F32, out_dtype, out, hd, x, hd, s.residual, hd, weight, s.m,
                                  hd, d.eps, TEAM)
                         : f.norm(F32, out_dtype, out, hd, s.residual, hd, nullptr, 0, weight,
                                  s.m, hd, d.eps, TEAM);
    if (!status && round)
        convert_rows(s.h, reinterpret_cast<const bf16*>(s.h16), s.m, hd);
    return status;
}

// x [m, hidden] normalized in place (no residual).
int norm_in_place(const Kernels& f, const Model& d, const Step& s, float* x,
                  const float* weight) {
    return f.norm(F32, F32, x, d.hidden, x, d.hidden, nullptr, 0, weight, s.m, d.hidden, d.eps,
                  TEAM);
}

// q/k head-normed (if the layer has the norms) and rotated in place, the step's K/V written
// to their slots, attn = attention(q, K, V) over the layer's KV group.
int attention(const Kernels& f, const Model& d, const Layer& l, const Step& s) {
    const int64_t width = qkv_width(d);
    float* q = s.qkv;
    float* k = q + d.num_heads * d.head_dim;
    float* v = k + d.num_kv_heads * d.head_dim;
    const int nh = static_cast<int>(d.num_heads), nkv = static_cast<int>(d.num_kv_heads);
    const int hd = static_cast<int>(d.head_dim);
    int status = 0;
    if (l.q_norm) status = f.head_norm(F32, q, width, nh, hd, l.q_norm, s.m, d.eps, TEAM);
    if (!status && l.k_norm)
        status = f.head_norm(F32, k, width, nkv, hd, l.k_norm, s.m, d.eps, TEAM);
    if (!status)
        status = f.rope(F32, s.positions, q, width, nh, k, width, nkv, s.m, hd, l.cos, l.sin,
                        d.max_position, TEAM);
    if (status) return status;
    if (l.group < 0 || l.group >= s.num_groups) return 1;
    const Group& g = s.groups[l.group];
    const int dtype = static_cast<int>(d.cache_dtype & DTYPE_MASK);
    void* qs = s.qkv;
    void* out = s.attn;
    if (dtype == BF16 || dtype == F16) {  // q/k/v in the caches' dtype, as the Python backend
        qs = s.qkv16;
        out = s.attn16;
        if (dtype == BF16) convert_rows(reinterpret_cast<bf16*>(s.qkv16), s.qkv, s.m, width);
        else convert_rows(reinterpret_cast<half_t*>(s.qkv16), s.qkv, s.m, width);
    } else if (dtype != F32) {
        return 1;
    }
    const int64_t elem = dtype == F32 ? 4 : 2;
    char* qb = static_cast<char*>(qs);
    status = f.attention(static_cast<int>(d.cache_dtype), qb, width, qb + (k - q) * elem, width,
                         qb + (v - q) * elem, width, l.k_cache, l.v_cache, g.slot_mapping, s.m,
                         s.query_start_loc, s.seq_lens, g.block_table, g.bt_stride, g.items,
                         g.num_items, out, nh, nkv, hd, static_cast<int>(d.block_size), d.scale,
                         TEAM, static_cast<int>(g.window));
    if (!status && dtype == BF16)
        convert_rows(s.attn, reinterpret_cast<const bf16*>(s.attn16), s.m, nh * hd);
    else if (!status && dtype == F16)
        convert_rows(s.attn, reinterpret_cast<const half_t*>(s.attn16), s.m, nh * hd);
    return status;
}

// Layer i up to its MLP: norm, q/k/v, attention, o (and its sum across ranks), the
// pre-MLP norm into h; `pending` holds the previous layer's MLP output (first: nothing). A
// MoE layer's router logits too (a dense product: shared by the team like the others).
int attention_half(const Kernels& f, const Model& d, const Layer& l, const Step& s,
                   int64_t i) {
    const int64_t hidden = d.hidden, m = s.m;
    const int64_t width = qkv_width(d);
    const int64_t attn_width = d.num_heads * d.head_dim;
    int status = add_and_norm(f, d, l, s, i == 0 ? nullptr : s.pending, l.input_norm);
    if (!status) status = linear(f, l.qkv, s.h, hidden, s.qkv, width, m);
    if (!status) lora_delta(s.lora, 4 * i, s.h, hidden, s.qkv, width, hidden, width);
    if (!status) status = attention(f, d, l, s);
    if (!status) status = linear(f, l.o, s.attn, attn_width, s.pending, hidden, m);
    if (!status) lora_delta(s.lora, 4 * i + 1, s.attn, attn_width, s.pending, hidden,
                            attn_width, hidden);
    if (!status) status = reduce_pending(d, s, 2 * i);
    if (!status && l.attn_out_norm) status = norm_in_place(f, d, s, s.pending, l.attn_out_norm);
    if (!status) status = add_and_norm(f, d, l, s, s.pending, l.post_norm);
    if (!status && l.moe)
        status = linear(f, l.router, s.h, hidden, s.logits, l.num_experts, m);
    return status;
}

// Layer i's dense MLP on h into pending (summed across ranks, normed if the layer says).
int dense_mlp(const Kernels& f, const Model& d, const Layer& l, const Step& s, int64_t i) {
    const int64_t hidden = d.hidden, inter = d.intermediate, m = s.m;
    int status = linear(f, l.gate_up, s.h, hidden, s.gate_up, 2 * inter, m);
    if (!status) lora_delta(s.lora, 4 * i + 2, s.h, hidden, s.gate_up, 2 * inter, hidden,
                            2 * inter);
    if (!status)
        status = (d.gelu ? f.gelu_tanh : f.silu)(F32, s.act, inter, s.gate_up, 2 * inter, m,
                                                  inter, TEAM);
    if (!status) status = linear(f, l.down, s.act, inter, s.pending, hidden, m);
    if (!status) lora_delta(s.lora, 4 * i + 3, s.act, inter, s.pending, hidden, inter, hidden);
    if (!status) status = reduce_pending(d, s, 2 * i + 1);
    if (!status && l.mlp_out_norm) status = norm_in_place(f, d, s, s.pending, l.mlp_out_norm);
    return status;
}

// Layer i's MoE feed-forward on h (its logits made) into pending, outside any parallel
// region: routing on this thread, the fused kernel in its own region of num_threads, the
// ranks' sum (sequence number 2 i + 1, as a dense MLP's down_proj).
int moe_mlp(const Kernels& f, const Model& d, const Layer& l, const Step& s, int64_t i,
            int num_threads) {
    if (!f.moe) return 1;
    if (route_experts(s.logits, s.m, l.num_experts, l.top_k, l.renormalize != 0, s.topk_ids,
                      s.topk_weights))
        return 1;
    int status = f.moe(l.moe, s.h, d.hidden, s.m, s.topk_ids, s.topk_weights, l.top_k,
                       s.pending, d.hidden, 0, num_threads);
    if (!status) status = reduce_pending(d, s, 2 * i + 1);
    return status;
}

}  // namespace

extern "C" {

// Runs layers [0, num_layers) over the step's rows; residual starts as the embeddings.
// One parallel region runs the layers up to the next MoE layer's experts (that layer's
// attention half included); the experts run between regions (moe_mlp), and the next region
// takes up from there. Status: 0, or the first failing kernel's (the same on every thread).
__attribute__((visibility("default")))
int cpu_decoder_forward(const Kernels* f, const Model* d, const Layer* layers, int num_layers,
                        const Step* s, int num_threads) {
    if (num_threads <= 0 || num_layers < 0 || s->m < 0) return 1;
    int status = 0;
    for (int first = 0; first < num_layers && !status;) {
        int stop = first;  // the next MoE layer (num_layers: none)
        while (stop < num_layers && !layers[stop].moe) ++stop;
#pragma omp parallel num_threads(num_threads)
        {
            int mine = 0;
            for (int i = first; i < stop && !mine; ++i) {
                mine = attention_half(*f, *d, layers[i], *s, i);
                if (!mine) mine = dense_mlp(*f, *d, layers[i], *s, i);
            }
            if (!mine && stop < num_layers) mine = attention_half(*f, *d, layers[stop], *s, stop);
            if (mine) {
#pragma omp atomic write
                status = mine;
            }
        }
        if (status || stop == num_layers) break;
        status = moe_mlp(*f, *d, layers[stop], *s, stop, num_threads);
        first = stop + 1;
    }
    return status;
}

// Top-k routing (moe_routing.h) of logits [tokens, num_experts] float32 into ids int32 and
// weights float32 [tokens, topk]: the Python layer loop's (worker/layers/fused_moe/router.py),
// the same function the native loop routes with. Status: 0, or 1 for bad sizes.
__attribute__((visibility("default")))
int cpu_decoder_route(const float* logits, int64_t tokens, int64_t num_experts, int64_t topk,
                      int renormalize, int32_t* ids, float* weights) {
    return route_experts(logits, tokens, num_experts, topk, renormalize != 0, ids, weights);
}

// The LoRA deltas of one linear outside the loop (the Python layer loop's, float32): the
// same lora_delta, in a parallel region of its own when they are big enough to share
// (LORA_SERIAL_MACS), else on the calling thread. Status: 0, or 1 for bad arguments.
__attribute__((visibility("default")))
int cpu_decoder_lora_delta(const LoRAStep* lora, int64_t target, const float* x,
                           int64_t x_stride, float* y, int64_t y_stride, int64_t k, int64_t n,
                           int num_threads) {
    if (num_threads <= 0 || !lora || target < 0 || k < 0 || n < 0) return 1;
    if (num_threads == 1 || lora_macs(lora, target, k, n) < LORA_SERIAL_MACS) {
        lora_delta(lora, target, x, x_stride, y, y_stride, k, n);  // its loops: this thread's
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    lora_delta(lora, target, x, x_stride, y, y_stride, k, n);
    return 0;
}

}  // extern "C"
