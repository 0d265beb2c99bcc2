// e^x for x <= 0 on the CPU libraries' hot paths (softmax, SiLU), Cephes-style:
// e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln2/2, and a degree-6 polynomial for e^r.
// The reduction and the polynomial are templates shared by the scalar version here and the
// vector version in cpu_paged_attention_simd.h (V: float or a GCC float vector).
#pragma once
#include <cstdint>

// r = c - n ln2, with ln 2 split in a part exact in float and a small correction.
template <class V> inline V exp_remainder(V c, V n) {
    return c - n * 0.693359375f + n * 2.12194440e-4f;
}

// e^r for |r| <= ln2/2.
template <class V> inline V exp_polynomial(V r) {
    V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

// Exactly 0 below -87 (that also covers -inf). Branch-free, so it vectorizes in simd loops
// (with -fno-trapping-math, which lets floor vectorize).
inline float exp_nonpositive(float x) {
    const float c = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(c * 1.44269504088896341f + 0.5f);
    const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
    return x < -87.0f ? 0.0f : exp_polynomial(exp_remainder(c, n)) * two_n;
}

// silu(x) = x * sigmoid(x), the exponent never positive (no overflow for any x):
// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, with e = exp(-|x|).
inline float silu(float x) {
    const float e = exp_nonpositive(x < 0.0f ? x : -x);
    return x * ((x < 0.0f ? e : 1.0f) / (1.0f + e));
}

// gelu with the tanh approximation (torch's approximate="tanh"):
// 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3), computed as x sigmoid(2y) =
// x / (1 + e) for y >= 0 and x e / (1 + e) for y < 0, e = exp(-2|y|): no overflow and no
// cancellation in 1 + tanh(y) (torch's form loses bits there, so ours is the closer one).
inline float gelu_tanh(float x) {
    const float y = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    const float e = exp_nonpositive(-2.0f * (y < 0.0f ? -y : y));
    return x * ((y < 0.0f ? e : 1.0f) / (1.0f + e));
}
