// Small fused CPU ops of the decoder layers: RMSNorm (optionally with the residual add fused
// in, or over each head of q/k in place), silu_and_mul, gelu_tanh_and_mul and rotary
// embedding; and the sampler's greedy argmax over float32 logits rows (argmax.h). Called through ctypes (worker/cpu_ops.py)
// with raw pointers; each returns 0, or a nonzero status when it rejects its arguments.
//
// Dtype codes (worker/cpu_kernel_library.py DTYPE_CODES): 0 float32, 1 bfloat16, 2 float16.
// Layouts (row-major; a "row" is one token; strides in elements, last dim contiguous):
//   rms_norm      x [tokens, hidden] (x_stride), residual [tokens, hidden] float32
//                 (residual_stride, optional), weight [hidden] float32, out [tokens, hidden]
//                 (out_stride)
//   head_rms_norm x [tokens, heads, head_dim] (x_stride; heads contiguous), in place,
//                 weight [head_dim] float32
//   silu_and_mul  x [tokens, 2 * d] (x_stride) = [gate | up], out [tokens, d] (out_stride);
//                 gelu_tanh_and_mul likewise
//   rotary        q [tokens, num_heads, head_dim] (q_stride; heads contiguous), k likewise
//                 with num_kv_heads; positions [tokens] int64; cos/sin [max_position,
//                 head_dim] float32, contiguous
//   argmax        x [rows, cols] float32 (x_stride), out [rows] int64
// Math is float32 and rounds once to the output dtype, except rotary embedding, which rounds
// like the torch reference / Hugging Face (see rotate_row).
//
// Threads: an op runs on the caller's thread unless its work reaches PARALLEL_WORK, then in
// one OpenMP parallel region over tokens (torch's intra-op threads: the library links the
// OpenMP runtime torch has loaded); num_threads = 0 shares the tokens among the threads of
// an enclosing region (for_each_token). Built with -ffp-contract=off: no fused multiply-adds,
// so each product and sum rounds as the torch reference's does.
#include <cmath>
#include <cstdint>

#include "cpu_dtypes.h"
#include "cpu_exp.h"

namespace {

#include "argmax.h"

// x rounded to T and back (identity for float).
template <class T> inline float round_to(float x) { return to_float(from_float<T>(x)); }

// Below this many element-operations (~100 us of serial work) an op runs serially: a
// parallel region costs more than it saves on a decode batch, and far more when the cores
// are shared (a thread waits at the barrier for a descheduled peer). Prefill chunks of a few
// thousand tokens cross it.
constexpr int64_t PARALLEL_WORK = int64_t{1} << 20;

// num_threads = 0: the call is one step of an enclosing parallel region (cpu_decoder.cpp),
// made by every thread of its team with the same arguments; the tokens are shared among them
// (an orphaned worksharing loop, ending in its barrier).
template <class F>
void for_each_token(int64_t num_tokens, int64_t work, int num_threads, const F& body) {
    if (num_threads == 0) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) body(t);
    } else if (num_threads > 1 && num_tokens > 1 && work >= PARALLEL_WORK) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) body(t);
    } else {
        for (int64_t t = 0; t < num_tokens; ++t) body(t);
    }
}

// ---- RMSNorm -----------------------------------------------------------------------------

// out = round(x * rsqrt(mean(x^2) + eps) * weight); with a residual, residual += x first and
// the normalized row is the updated residual (x read in its dtype, added in float32).
template <class In, class Out, bool kAddResidual>
void rms_norm_row(const In* x, float* residual, const float* weight, Out* out, int64_t hidden,
                  float eps) {
    float sum = 0.0f;
    if constexpr (kAddResidual) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
            const float r = residual[i] + to_float(x[i]);
            residual[i] = r;
            sum += r * r;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) {
            const float v = to_float(x[i]);
            sum += v * v;
        }
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) {
        const float v = kAddResidual ? residual[i] : to_float(x[i]);
        out[i] = from_float<Out>(v * inv * weight[i]);
    }
}

struct NormArgs {
    void* out; int64_t out_stride;
    const void* x; int64_t x_stride;
    float* residual; int64_t residual_stride;
    const float* weight; int64_t num_tokens, hidden;
    float eps; int num_threads;
};

template <class In, class Out, bool kAddResidual>
void rms_norm(const NormArgs& a) {
    const auto* x = static_cast<const In*>(a.x);
    auto* out = static_cast<Out*>(a.out);
    for_each_token(a.num_tokens, a.num_tokens * a.hidden, a.num_threads, [&](int64_t t) {
        float* residual = kAddResidual ? a.residual + t * a.residual_stride : nullptr;
        rms_norm_row<In, Out, kAddResidual>(x + t * a.x_stride, residual, a.weight,
                                            out + t * a.out_stride, a.hidden, a.eps);
    });
}

template <class In, class Out>
void rms_norm_dispatch_residual(const NormArgs& a) {
    if (a.residual) rms_norm<In, Out, true>(a);
    else rms_norm<In, Out, false>(a);
}

template <class In>
int rms_norm_dispatch_out(int out_dtype, const NormArgs& a) {
    switch (out_dtype) {
        case 0: rms_norm_dispatch_residual<In, float>(a); return 0;
        case 1: rms_norm_dispatch_residual<In, bf16>(a); return 0;
        case 2: rms_norm_dispatch_residual<In, half_t>(a); return 0;
        default: return 1;
    }
}

// Every head of every token normalized in place (q/k norms).
template <class T>
void head_rms_norm(T* x, int64_t x_stride, int heads, int64_t head_dim, const float* weight,
                   int64_t num_tokens, float eps, int num_threads) {
    for_each_token(num_tokens, num_tokens * heads * head_dim, num_threads, [&](int64_t t) {
        for (int h = 0; h < heads; ++h) {
            T* row = x + t * x_stride + h * head_dim;
            rms_norm_row<T, T, false>(row, nullptr, weight, row, head_dim, eps);
        }
    });
}

// ---- silu_and_mul, gelu_tanh_and_mul -----------------------------------------------------

template <class T, float (*Act)(float)>
void act_and_mul_row(const T* gate, const T* up, T* out, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = from_float<T>(Act(to_float(gate[i]))
                                                           * to_float(up[i]));
}

template <float (*Act)(float), class T>
void act_and_mul(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t num_tokens,
                 int64_t d, int num_threads) {
    // ~4 element-operations per output: the exponential dominates
    for_each_token(num_tokens, 4 * num_tokens * d, num_threads, [&](int64_t t) {
        const T* gate = x + t * x_stride;
        act_and_mul_row<T, Act>(gate, gate + d, out + t * out_stride, d);
    });
}

template <float (*Act)(float)>
int act_and_mul_dispatch(int dtype, void* out, int64_t out_stride, const void* x,
                         int64_t x_stride, int64_t num_tokens, int64_t d, int num_threads) {
    if (d <= 0 || num_tokens < 0 || num_threads < 0) return 1;
    switch (dtype) {
        case 0: act_and_mul<Act>(static_cast<float*>(out), out_stride,
                                 static_cast<const float*>(x), x_stride, num_tokens, d,
                                 num_threads); return 0;
        case 1: act_and_mul<Act>(static_cast<bf16*>(out), out_stride,
                                 static_cast<const bf16*>(x), x_stride, num_tokens, d,
                                 num_threads); return 0;
        case 2: act_and_mul<Act>(static_cast<half_t*>(out), out_stride,
                                 static_cast<const half_t*>(x), x_stride, num_tokens, d,
                                 num_threads); return 0;
        default: return 1;
    }
}

// ---- rotary embedding --------------------------------------------------------------------

// One head rotated in place: x' = x * cos + rotate_half(x) * sin, rotate_half(x) =
// cat(-x[half:], x[:half]). Rounds as the torch reference (worker/rotary_embedding.py) and
// Hugging Face do: cos/sin rounded to T, each product rounded to T, then the sum rounded to
// T. A product of two values of T is exact in float32 for bfloat16/float16, so rounding it
// once reproduces torch's per-op result bit for bit (and float32 rounds each op natively).
template <class T>
void rotate_row(T* x, const float* cos, const float* sin, int half) {
#pragma omp simd
    for (int i = 0; i < half; ++i) {
        const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
        const float c1 = round_to<T>(cos[i]), s1 = round_to<T>(sin[i]);
        const float c2 = round_to<T>(cos[i + half]), s2 = round_to<T>(sin[i + half]);
        const float y1 = round_to<T>(x1 * c1) + round_to<T>(-x2 * s1);
        const float y2 = round_to<T>(x2 * c2) + round_to<T>(x1 * s2);
        x[i] = from_float<T>(y1);
        x[i + half] = from_float<T>(y2);
    }
}

struct RotaryArgs {
    const int64_t* positions;
    void* q; int64_t q_stride; int num_heads;
    void* k; int64_t k_stride; int num_kv_heads;
    int64_t num_tokens; int head_dim;
    const float* cos; const float* sin; int64_t max_position;
    int num_threads;
};

template <class T>
int rotary_embedding(const RotaryArgs& a) {
    for (int64_t t = 0; t < a.num_tokens; ++t)
        if (a.positions[t] < 0 || a.positions[t] >= a.max_position) return 2;
    auto* q = static_cast<T*>(a.q);
    auto* k = static_cast<T*>(a.k);
    const int half = a.head_dim / 2;
    const int64_t work = a.num_tokens * (a.num_heads + a.num_kv_heads) * a.head_dim;
    for_each_token(a.num_tokens, work, a.num_threads, [&](int64_t t) {
        const float* cos = a.cos + a.positions[t] * a.head_dim;
        const float* sin = a.sin + a.positions[t] * a.head_dim;
        for (int h = 0; h < a.num_heads; ++h)
            rotate_row(q + t * a.q_stride + h * a.head_dim, cos, sin, half);
        for (int h = 0; h < a.num_kv_heads; ++h)
            rotate_row(k + t * a.k_stride + h * a.head_dim, cos, sin, half);
    });
    return 0;
}

}  // namespace

extern "C" {

// residual may be null (plain RMSNorm of x); with it, x and residual must not overlap.
__attribute__((visibility("default")))
int cpu_rms_norm(int in_dtype, int out_dtype, void* out, int64_t out_stride, const void* x,
                 int64_t x_stride, float* residual, int64_t residual_stride,
                 const float* weight, int64_t num_tokens, int64_t hidden, float eps,
                 int num_threads) {
    if (hidden <= 0 || num_tokens < 0 || num_threads < 0) return 1;
    const NormArgs a{out, out_stride, x, x_stride, residual, residual_stride, weight,
                     num_tokens, hidden, eps, num_threads};
    switch (in_dtype) {
        case 0: return rms_norm_dispatch_out<float>(out_dtype, a);
        case 1: return rms_norm_dispatch_out<bf16>(out_dtype, a);
        case 2: return rms_norm_dispatch_out<half_t>(out_dtype, a);
        default: return 1;
    }
}

__attribute__((visibility("default")))
int cpu_silu_and_mul(int dtype, void* out, int64_t out_stride, const void* x, int64_t x_stride,
                     int64_t num_tokens, int64_t d, int num_threads) {
    return act_and_mul_dispatch<silu>(dtype, out, out_stride, x, x_stride, num_tokens, d,
                                      num_threads);
}

__attribute__((visibility("default")))
int cpu_gelu_tanh_and_mul(int dtype, void* out, int64_t out_stride, const void* x,
                          int64_t x_stride, int64_t num_tokens, int64_t d, int num_threads) {
    return act_and_mul_dispatch<gelu_tanh>(dtype, out, out_stride, x, x_stride, num_tokens, d,
                                           num_threads);
}

// x [tokens, heads, head_dim] (token stride x_stride, heads contiguous) normalized in place.
__attribute__((visibility("default")))
int cpu_head_rms_norm(int dtype, void* x, int64_t x_stride, int heads, int64_t head_dim,
                      const float* weight, int64_t num_tokens, float eps, int num_threads) {
    if (head_dim <= 0 || heads < 0 || num_tokens < 0 || num_threads < 0) return 1;
    switch (dtype) {
        case 0: head_rms_norm(static_cast<float*>(x), x_stride, heads, head_dim, weight,
                              num_tokens, eps, num_threads); return 0;
        case 1: head_rms_norm(static_cast<bf16*>(x), x_stride, heads, head_dim, weight,
                              num_tokens, eps, num_threads); return 0;
        case 2: head_rms_norm(static_cast<half_t*>(x), x_stride, heads, head_dim, weight,
                              num_tokens, eps, num_threads); return 0;
        default: return 1;
    }
}

// Rotates q and k in place; status 2 when a position is outside [0, max_position).
__attribute__((visibility("default")))
int cpu_rotary_embedding(int dtype, const int64_t* positions, void* q, int64_t q_stride,
                         int num_heads, void* k, int64_t k_stride, int num_kv_heads,
                         int64_t num_tokens, int head_dim, const float* cos, const float* sin,
                         int64_t max_position, int num_threads) {
    if (head_dim <= 0 || head_dim % 2 || num_tokens < 0 || num_threads < 0) return 1;
    const RotaryArgs a{positions, q, q_stride, num_heads, k, k_stride, num_kv_heads,
                       num_tokens, head_dim, cos, sin, max_position, num_threads};
    switch (dtype) {
        case 0: return rotary_embedding<float>(a);
        case 1: return rotary_embedding<bf16>(a);
        case 2: return rotary_embedding<half_t>(a);
        default: return 1;
    }
}

// out[r] = torch.argmax(x[r]) for each of `rows` float32 rows of `cols` (argmax.h).
__attribute__((visibility("default")))
int cpu_argmax(const float* x, int64_t x_stride, int64_t rows, int64_t cols, int64_t* out,
               int num_threads) {
    if (cols <= 0 || rows < 0 || num_threads < 0) return 1;
    argmax_rows(x, x_stride, rows, cols, out, num_threads);
    return 0;
}

}  // extern "C"
