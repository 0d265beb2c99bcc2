// kemu.h: run CUDA C++ kernels on the CPU, for tests. Include it before the kernel sources.
//
// Execution model: every CUDA thread is a fiber with its own stack. A block's fibers run
// cooperatively on one OS thread (so `__shared__` = static thread_local is per block and
// needs no locking); blocks are spread over OS worker threads. `__syncthreads` is a block
// barrier and warp shuffles/`__syncwarp` are warp barriers: a fiber that arrives yields to
// the block's scheduler, which resumes fibers whose barrier has completed.
// Checks (reported as errors, never abort()): a barrier reached from two different source
// lines (divergence), a shuffle whose mask is not the warp's live lanes, a lane exiting while
// its warp waits in a shuffle, `__syncthreads` after some threads exited, no runnable fiber
// (deadlock: who waits where), too little dynamic shared memory for REQUIRE_SMEM. Dynamic
// shared memory is filled with 0xff bytes (NaN in fp32/fp16/bf16) before every block.
// Context switch: a 6-register x86-64 SysV switch (no signal-mask syscall), or ucontext
// with -DKEMU_UCONTEXT (portable; the only choice off x86-64).
#pragma once

#include <cuda_bf16.h>  // NVIDIA's headers carry host code for conversions and arithmetic,
#include <cuda_fp16.h>  // and bring vector_types.h (uint3, uint4, dim3, float2)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "kemu_fiber.h"

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(kemu::dynamic_smem())
#define REQUIRE_SMEM(bytes) kemu::require_smem((bytes), __FILE__, __LINE__)

namespace kemu {

// A counting barrier. `line`/`kind` record where the current phase's first arrival came from.
struct Barrier {
  int expected = 0, arrived = 0, line = 0;
  long generation = 0;
  const char* kind = "";
  const char* file = "";
};

inline const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

struct Thread {
  Fiber fiber;
  uint3 tid{};
  unsigned index = 0, lane = 0, warp = 0, parity = 0;
  Barrier* waiting = nullptr;  // the barrier this thread sleeps in, until its generation moves
  long wait_generation = 0;
  bool done = false;
};

struct Warp {
  Barrier barrier;
  unsigned full = 0;                          // lanes that exist in this (maybe partial) warp
  unsigned live = 0;                          // lanes that have not exited
  alignas(16) unsigned char slots[2][32][16];  // shuffle values, double-buffered by parity
};

// Per OS worker: the fibers of the block it runs, reused from block to block.
struct Worker {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  Barrier block;
  Context scheduler;
  Thread* current = nullptr;
  std::vector<unsigned char> smem;
  size_t smem_bytes = 0;
  int exited = 0;
  bool failed = false;
  std::string error;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
};

inline thread_local Worker* W = nullptr;

[[noreturn]] void fail(const char* fmt, ...);
void yield_to_scheduler();

inline void* dynamic_smem() { return W->smem.data(); }

inline void require_smem(size_t bytes, const char* file, int line) {
  if (W->smem_bytes < bytes)
    fail("%s:%d needs %zu bytes of dynamic shared memory, the launch gave %zu", file, line,
         bytes, W->smem_bytes);
}

inline void release(Barrier& b) {
  b.arrived = 0;
  ++b.generation;
}

// Arrive at `b` and sleep until every expected thread has arrived at the same source line.
inline void arrive(Barrier& b, const char* kind, const char* file, int line) {
  Thread* me = W->current;
  if (b.arrived == 0) {
    b.line = line;
    b.kind = kind;
    b.file = file;
  } else if (b.line != line || std::strcmp(b.kind, kind) != 0 || std::strcmp(b.file, file)) {
    fail("divergent barrier: thread %u reached %s at %s:%d while others wait at %s at %s:%d",
         me->index, kind, base_name(file), line, b.kind, base_name(b.file), b.line);
  }
  if (++b.arrived == b.expected) {
    release(b);
    return;
  }
  me->waiting = &b;
  me->wait_generation = b.generation;
  yield_to_scheduler();
}

inline Warp& my_warp() { return W->warps[W->current->warp]; }

inline void check_mask(unsigned mask, const char* kind, const char* file, int line) {
  const Warp& w = my_warp();
  if ((mask & w.full) != w.full || w.live != w.full)
    fail("%s at %s:%d: mask %08x but the warp's live lanes are %08x (only full warps are "
         "supported)", kind, base_name(file), line, mask, w.live);
}

// A warp collective: publish `value`, wait for the warp, read lane `source(lane)`'s value.
template <class T, class Source>
T exchange(unsigned mask, T value, Source source, const char* kind, const char* file, int line) {
  static_assert(sizeof(T) <= 16, "shuffle of a type wider than 16 bytes");
  check_mask(mask, kind, file, line);
  Thread* me = W->current;
  Warp& w = my_warp();
  unsigned char (*slots)[16] = w.slots[me->parity];
  me->parity ^= 1u;  // a lane reuses this buffer only after the next collective completes
  std::memcpy(slots[me->lane], &value, sizeof(T));
  arrive(w.barrier, kind, file, line);
  T result;
  std::memcpy(&result, slots[source(me->lane)], sizeof(T));
  return result;
}

}  // namespace kemu

inline thread_local uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
constexpr int warpSize = 32;

#define KEMU_LINE const char* file = __builtin_FILE(), int line = __builtin_LINE()
inline void __syncthreads(KEMU_LINE) {
  if (kemu::W->exited)
    kemu::fail("__syncthreads at %s:%d after %d threads of the block exited",
               kemu::base_name(file), line, kemu::W->exited);
  kemu::arrive(kemu::W->block, "__syncthreads", file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, KEMU_LINE) {
  kemu::check_mask(mask, "__syncwarp", file, line);
  kemu::arrive(kemu::my_warp().barrier, "__syncwarp", file, line);
}
template <class T> T __shfl_sync(unsigned mask, T v, int src, int width = 32, KEMU_LINE) {
  return kemu::exchange(
      mask, v, [=](unsigned l) { return l / width * width + unsigned(src) % width; },
      "__shfl_sync", file, line);
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                                     KEMU_LINE) {
  return kemu::exchange(
      mask, v,
      [=](unsigned l) {
        const unsigned s = l ^ unsigned(lane_mask);
        return s / width > l / width ? l : s;
      },
      "__shfl_xor_sync", file, line);
}
template <class T> T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                                      KEMU_LINE) {
  return kemu::exchange(
      mask, v, [=](unsigned l) { return l % width + delta < unsigned(width) ? l + delta : l; },
      "__shfl_down_sync", file, line);
}
template <class T> T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32,
                                    KEMU_LINE) {
  return kemu::exchange(
      mask, v, [=](unsigned l) { return l % width >= delta ? l - delta : l; }, "__shfl_up_sync",
      file, line);
}
inline unsigned __ballot_sync(unsigned mask, int predicate, KEMU_LINE) {
  unsigned bits = 0;
  for (unsigned i = 0; i < 32; i++)
    bits |= unsigned(kemu::exchange(mask, predicate ? 1 : 0, [=](unsigned) { return i; },
                                    "__ballot_sync", file, line)) << i;
  return bits & mask;
}
#undef KEMU_LINE

// Device intrinsics and builtins the kernels use, mapped to host code.
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <class T> T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// Blocks run in parallel OS threads, so atomics are real atomics.
template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }

#include "kemu_launch.h"
