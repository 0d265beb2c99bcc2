// reshape_and_cache: write one step's new keys and values into their paged-cache slots.
//
// key/value: [num_tokens, num_kv_heads, head_dim], token stride `*_stride` elements (they may
//   be views into a fused qkv tensor), heads contiguous: a token's row is `row_chunks`
//   16-byte chunks.
// k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is row s of the
//   cache viewed as [num_blocks * block_size, num_kv_heads * head_dim].
// slot_mapping: [num_tokens] int64; a negative slot is padding and is skipped.
// Thread mapping: one thread per (token, chunk), flat over the grid; each copies one 16-byte
//   chunk of K and one of V. All offsets are 64-bit.
#ifndef DELTASERVE_KERNELS_COMMON_CUH
#include "common.cuh"
#endif

template <typename T>
__global__ void __launch_bounds__(ds::NUM_THREADS) reshape_and_cache(
    T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ key,
    const T* __restrict__ value, long long key_stride, long long value_stride,
    const long long* __restrict__ slot_mapping, int num_tokens, int row_chunks) {
  constexpr int VEC = ds::Pack<T>::VEC;
  const long long index = (long long)blockIdx.x * ds::NUM_THREADS + threadIdx.x;
  if (index >= (long long)num_tokens * row_chunks) return;  // no barrier follows
  const long long token = index / row_chunks;
  const long long chunk = index % row_chunks;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const long long dst = (slot * row_chunks + chunk) * VEC;
  ds::store16(k_cache + dst, ds::load16(key + token * key_stride + chunk * VEC));
  ds::store16(v_cache + dst, ds::load16(value + token * value_stride + chunk * VEC));
}
