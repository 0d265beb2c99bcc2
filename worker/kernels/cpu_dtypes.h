// The 16-bit float types of the CPU libraries, widened to and rounded from float32.
// Dtype codes (worker/cpu_kernel_library.py DTYPE_CODES): 0 float32, 1 bfloat16, 2 float16.
#pragma once
#include <cstdint>

#if defined(__FLT16_MAX__)
using half_t = _Float16;
#else
#error "needs a compiler with _Float16 (GCC >= 12 or Clang >= 15 on x86-64)"
#endif

struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(half_t x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16);
}

template <class T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline half_t from_float<half_t>(float x) { return static_cast<half_t>(x); }
template <> inline bf16 from_float<bf16>(float x) {  // round to nearest even; NaN stays NaN
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return bf16{static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u
                                                                       : rounded)};
}
