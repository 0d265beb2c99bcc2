// Small kernels that exercise the emulator itself: correct collectives, and planted bugs the
// harness must report (tests/test_kernel_emulated.py). Launch with 64 threads per block.
#ifndef DYN_SMEM
#define DYN_SMEM(T, name) extern __shared__ __align__(16) T name[]
#endif

// out[block * 64 + tid]: the sum over its warp of (lane + 1) * (block + 1) via xor shuffles,
// then a block-wide sum through shared memory; checks shuffles, barriers, ids.
__global__ void selftest_reduce(float* out) {
  __shared__ float warp_sums[2];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float v = (lane + 1.0f) * (blockIdx.x + 1.0f);
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = v + warp_sums[1 - warp];
}

// out[i] = the first float of dynamic shared memory, never written: NaN under the emulator.
__global__ void selftest_read_unwritten_smem(float* out) {
  DYN_SMEM(float, scratch);
  out[threadIdx.x] = scratch[threadIdx.x];
}

// Planted bug: two different __syncthreads call sites.
__global__ void selftest_divergent_syncthreads(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Planted bug: half of a warp shuffles, the other half goes on to __syncwarp.
__global__ void selftest_divergent_shuffle(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  __syncwarp();
  out[threadIdx.x] = v;
}

// Planted bug: lanes 0-15 wait in a shuffle, everyone else in __syncthreads: a deadlock.
__global__ void selftest_deadlock(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else __syncthreads();
  out[threadIdx.x] = v;
}

// Planted bug: upper lanes return, then a full-mask shuffle names them.
__global__ void selftest_shuffle_after_exit(float* out) {
  if (threadIdx.x % 32 >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, float(threadIdx.x), 1);
}
