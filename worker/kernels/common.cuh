// Device helpers shared by deltaserve's CUDA kernels.
//
// NVRTC-safe: only <cuda_fp16.h> and <cuda_bf16.h> are included (no <cmath>, no INFINITY,
// no FLT_MAX). The same text is compiled by NVRTC (through CuPy), by nvcc (resource checks)
// and by g++ on the CPU through worker/emulator/kemu.h, which predefines DYN_SMEM and
// REQUIRE_SMEM before including the kernels.
#ifndef DELTASERVE_KERNELS_COMMON_CUH
#define DELTASERVE_KERNELS_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Dynamic shared memory. The emulator maps it onto a per-block buffer poisoned with NaN.
#ifndef DYN_SMEM
#define DYN_SMEM(T, name) extern __shared__ __align__(16) T name[]
#endif
// The emulator checks that a launch gave at least `bytes` of dynamic shared memory.
#ifndef REQUIRE_SMEM
#define REQUIRE_SMEM(bytes)
#endif

namespace ds {

constexpr int NUM_THREADS = 128;  // every kernel here runs 4 warps per block
constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Two lanes of a 16-bit float type, converted to/from fp32.
template <typename T> struct Lanes2;
template <> struct Lanes2<__half> {
  using type = __half2;
  __device__ __forceinline__ static float2 to_float2(type h) { return __half22float2(h); }
  __device__ __forceinline__ static type from_floats(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};
template <> struct Lanes2<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ __forceinline__ static float2 to_float2(type h) { return __bfloat1622float2(h); }
  __device__ __forceinline__ static type from_floats(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

// Packs: VEC elements of T in one 16-byte vector, converted to/from fp32. The 16-bit types
// (half, bfloat16) hold 8 and convert two lanes at a time.
template <typename T> struct Pack {
  static constexpr int VEC = 8;
  using L2 = Lanes2<T>;
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    const typename L2::type* h = reinterpret_cast<const typename L2::type*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 x = L2::to_float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  __device__ __forceinline__ static uint4 pack(const float* f) {
    uint4 u;
    typename L2::type* h = reinterpret_cast<typename L2::type*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = L2::from_floats(f[2 * i], f[2 * i + 1]);
    return u;
  }
};

template <> struct Pack<float> {
  static constexpr int VEC = 4;
  __device__ __forceinline__ static void unpack(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
  __device__ __forceinline__ static uint4 pack(const float* f) {
    uint4 u;
    u.x = __float_as_uint(f[0]);
    u.y = __float_as_uint(f[1]);
    u.z = __float_as_uint(f[2]);
    u.w = __float_as_uint(f[3]);
    return u;
  }
};

// 16-byte loads/stores; `p` must be 16-byte aligned (the host checks base pointers/strides).
template <typename T> __device__ __forceinline__ uint4 load16(const T* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
template <typename T> __device__ __forceinline__ void store16(T* p, const uint4& u) {
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ uint4 zero16() {
  uint4 u;
  u.x = u.y = u.z = u.w = 0u;
  return u;
}

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace ds

#endif  // DELTASERVE_KERNELS_COMMON_CUH
