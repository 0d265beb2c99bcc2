// Vector exponential for cpu_paged_attention.cpp, on the portable vectors of cpu_simd.h.
// Included inside the .cpp's anonymous namespace (after cpu_dtypes.h and cpu_exp.h; the
// standard headers and <immintrin.h> are included there).
#pragma once

#include "cpu_simd.h"

// e^x for x <= 0, lane-wise: the vector twin of exp_nonpositive (cpu_exp.h; n rounded to
// nearest by the 1.5 * 2^23 trick instead of floor(x + 0.5)); exactly 0 below -87 and for
// -inf.
using ::exp_nonpositive;  // the scalar one stays visible next to this overload
inline Vec exp_nonpositive(Vec x) {
    const Vec lo = splat(-87.0f), magic = splat(12582912.0f);  // 1.5 * 2^23
    const Vec c = x < lo ? lo : x;
    const Vec n = (c * 1.44269504088896341f + magic) - magic;
    const Vec two_n = reinterpret_cast<Vec>((__builtin_convertvector(n, VecI) + 127) << 23);
    return x < lo ? Vec{} : exp_polynomial(exp_remainder(c, n)) * two_n;
}
