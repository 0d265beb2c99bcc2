// paged_attention + attention_reduce: attention of one step's flat token batch over the paged
// KV cache (decode rows and causal prefill chunks), with optional split-KV (flash-decoding).
//
// Layouts (elements):
//   query      [num_tokens, num_heads, HEAD_DIM], token stride `query_stride`, heads contiguous
//   k/v_cache  [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM] ("NHD")
//   block_table[num_reqs, block_table_stride] int32; query_start_loc [num_reqs + 1];
//   seq_lens   [num_reqs]; out [num_tokens, num_heads, HEAD_DIM] contiguous.
//   work       [num_items, 3] int32 built by the host: (request, first query index within the
//              request, query count). Decode requests are items with one query token.
// Grid: x = work item, y = kv_head * head_chunks + head_chunk, z = KV split; 128 threads.
// A CTA owns `heads_per_cta` query heads of one KV head for all the item's query tokens:
//   "row" r is query token r / heads_per_cta and head head0 + r % heads_per_cta. Every K/V
//   tile is loaded from global memory once per KV head and shared by the GQA group.
// Keys: the item's rows see keys [kv_begin, kv_end), kv_end = context + q_first + q_count;
//   query token j of a request sits at position context + j and attends keys [0, context + j],
//   or with a sliding window w > 0 only [context + j - w + 1, context + j]; kv_begin is 0, or
//   the first key of the item's first row's window (blocks before it are never read: they
//   may be stale or the null block). Split z covers keys [kv_begin + z * split_tokens,
//   kv_begin + (z + 1) * split_tokens) of that range.
// Each tile of TILE keys takes four barriers:
//   1. K and V rows -> shared memory with 16-byte loads (64-bit offsets). Rows past the
//      range are zero-filled and never loaded: a partial last block's tail may hold NaN.
//   2. Scores: thread (t = tid % TILE, r0 = tid / TILE) scores key t against rows r0,
//      r0 + NT / TILE, ..., reusing each K chunk across rows; q is broadcast from smem.
//   3. Online softmax, fp32 in the log2 domain: TPR = NT / ROWS threads own one row.
//   4. P.V: a thread owns (row, 16-byte dim chunk) pairs and loops over the valid keys only;
//      with fewer pairs than threads, the tile's keys are cut into slices summed at the end.
// Output: without split, out = acc / l in T. With split, the unnormalized fp32 acc and (m, l)
//   go to part_acc/part_ml at slot ((x * gridDim.y + y) * gridDim.z + z) * ROWS + r, and
//   attention_reduce merges the splits of each row.
#ifndef DELTASERVE_KERNELS_COMMON_CUH
#include "common.cuh"
#endif

namespace ds {

// Keys per tile: a K tile of about 16 KiB; halved for the many-row (prefill) variant.
__host__ __device__ constexpr int attention_tile(int row_bytes, int rows) {
  const int fit = 16384 / row_bytes;
  const int tile = fit >= 64 ? 64 : fit >= 32 ? 32 : 16;
  return rows > 8 && tile > 16 ? tile / 2 : tile;
}

// Blocks per SM that ptxas must fit in registers: decode 4 (<= 128 registers: occupancy
// hides load latency), or 3 for rows over 512 bytes (fp32 d256: more in flight per thread);
// prefill 2 (<= 255: its many rows need the registers). Without a minimum, newer ptxas
// trades registers for occupancy by spilling.
__host__ __device__ constexpr int attention_min_blocks(int rows, int row_bytes) {
  return rows > 8 ? 2 : row_bytes > 512 ? 3 : 4;
}

// Shared-memory layout and thread-mapping constants (mirrored in worker/cuda_kernels.py).
template <typename T, int HEAD_DIM, int ROWS> struct AttentionLayout {
  static constexpr int NT = NUM_THREADS;
  static constexpr int VEC = Pack<T>::VEC;
  static constexpr int CHUNKS = HEAD_DIM / VEC;  // 16-byte chunks per K/V row
  static constexpr int TILE = attention_tile(HEAD_DIM * (int)sizeof(T), ROWS);
  static constexpr int KV_STRIDE = HEAD_DIM + VEC;  // +16 bytes per row: no bank conflicts
  static constexpr int P_STRIDE = TILE + 1;
  static constexpr int BT_CHUNK = 128;             // block-table entries staged at once
  static constexpr int TPR = NT / ROWS;            // softmax threads per row
  static constexpr int SCORES = ROWS * TILE / NT;  // scores per thread per tile
  static constexpr int PAIRS = (ROWS * CHUNKS + NT - 1) / NT;  // (row, chunk) pairs per thread
  static constexpr int LOADS = (TILE * CHUNKS + NT - 1) / NT;  // K (and V) chunks per thread
  static constexpr int Q_OFF = 0;                  // float [ROWS][HEAD_DIM], pre-scaled
  static constexpr int K_OFF = Q_OFF + ROWS * HEAD_DIM * 4;  // T [TILE][KV_STRIDE]
  static constexpr int V_OFF = K_OFF + TILE * KV_STRIDE * (int)sizeof(T);
  static constexpr int P_OFF = V_OFF + TILE * KV_STRIDE * (int)sizeof(T);  // float [ROWS][P_STRIDE]
  static constexpr int STAT_OFF = P_OFF + (ROWS * P_STRIDE * 4 + 15) / 16 * 16;  // alpha, m, l
  static constexpr int BT_OFF = STAT_OFF + 3 * ROWS * 4;  // int [BT_CHUNK]
  static constexpr int BYTES = BT_OFF + BT_CHUNK * 4;
  static_assert(HEAD_DIM % VEC == 0, "HEAD_DIM must fill whole 16-byte vectors");
  static_assert(NT % TILE == 0 && (ROWS * TILE) % NT == 0, "score mapping");
  static_assert(NT % ROWS == 0 && TPR <= 32 && TILE % TPR == 0, "softmax mapping");
  static_assert(TILE * KV_STRIDE * sizeof(T) >= NT * VEC * 4, "k_s holds the P.V slices");
};

// One CTA's share of a request: query tokens [q_first, q_first + q_count).
struct WorkItem {
  int request;
  int token0;   // flat-batch row of the first query token
  int q_count;  // query tokens in the item
  int q_pos0;   // absolute position of the first query token (context + q_first)
  int kv_begin;  // keys [kv_begin, kv_end) are visible to at least one row
  int kv_end;
};

__device__ __forceinline__ WorkItem load_work_item(const int* work, const int* query_start_loc,
                                                   const int* seq_lens, int index,
                                                   int sliding_window) {
  const int* w = work + 3LL * index;
  const int start = query_start_loc[w[0]];
  const int context = seq_lens[w[0]] - (query_start_loc[w[0] + 1] - start);
  WorkItem item;
  item.request = w[0];
  item.token0 = start + w[1];
  item.q_count = w[2];
  item.q_pos0 = context + w[1];
  item.kv_end = context + w[1] + w[2];
  item.kv_begin = sliding_window > 0 ? max(0, item.q_pos0 - sliding_window + 1) : 0;
  return item;
}

// The CTA's query heads: head0 .. head0 + heads_per_cta - 1, all reading KV head kv_head.
struct HeadGroup {
  int kv_head;
  int head0;
};

__device__ __forceinline__ HeadGroup cta_heads(int num_heads, int num_kv_heads,
                                               int heads_per_cta) {
  const int group = num_heads / num_kv_heads;
  const int chunks = group / heads_per_cta;
  HeadGroup g;
  g.kv_head = blockIdx.y / chunks;
  g.head0 = g.kv_head * group + (blockIdx.y % chunks) * heads_per_cta;
  return g;
}

template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS> struct AttentionCta {
  using L = AttentionLayout<T, HEAD_DIM, ROWS>;
  static constexpr int NT = L::NT, VEC = L::VEC, CHUNKS = L::CHUNKS, TILE = L::TILE;
  using Acc = float[L::PAIRS][VEC];  // a thread's P.V accumulators, one row per (row, chunk)

  float* q_s;
  T* k_s;
  T* v_s;
  float* p_s;
  float* alpha_s;
  float* m_s;
  float* l_s;
  int* bt_s;
  WorkItem item;
  HeadGroup heads;
  int heads_per_cta;
  int window;  // sliding window (0: full attention)
  int rows;  // active rows: q_count * heads_per_cta <= ROWS
  // P.V mapping: the `span` = rows * CHUNKS active (row, chunk) pairs. With span >= NT a
  // thread owns pairs tid, tid + NT, ...; with fewer, the keys are cut into `slices`
  // (NT / span) so that every thread works, and the slices are summed at the end.
  int span, slices, slice, pair0;

  __device__ AttentionCta(unsigned char* smem, const WorkItem& w, const HeadGroup& h, int hpc,
                          int sliding_window)
      : q_s(reinterpret_cast<float*>(smem + L::Q_OFF)),
        k_s(reinterpret_cast<T*>(smem + L::K_OFF)),
        v_s(reinterpret_cast<T*>(smem + L::V_OFF)),
        p_s(reinterpret_cast<float*>(smem + L::P_OFF)),
        alpha_s(reinterpret_cast<float*>(smem + L::STAT_OFF)),
        m_s(reinterpret_cast<float*>(smem + L::STAT_OFF) + ROWS),
        l_s(reinterpret_cast<float*>(smem + L::STAT_OFF) + 2 * ROWS),
        bt_s(reinterpret_cast<int*>(smem + L::BT_OFF)),
        item(w), heads(h), heads_per_cta(hpc), window(sliding_window),
        rows(w.q_count * hpc) {
    span = rows * CHUNKS;
    slices = span >= NT ? 1 : NT / span;
    slice = span >= NT ? 0 : threadIdx.x / span;
    pair0 = span >= NT ? threadIdx.x : threadIdx.x % span;
  }

  // The k-th (row, chunk) pair of this thread, or -1.
  __device__ int pair(int k) const {
    const int p = pair0 + k * NT;
    return slice < slices && p < span ? p : -1;
  }

  __device__ long long out_row(int r, int num_heads) const {
    return (long long)(item.token0 + r / heads_per_cta) * num_heads + heads.head0 +
           r % heads_per_cta;
  }

  // q rows -> q_s as fp32 times scale * log2(e); inactive rows are zero.
  __device__ void stage_query(const T* query, long long query_stride, float scale_log2) {
    for (int i = threadIdx.x; i < ROWS * CHUNKS; i += NT) {
      const int r = i / CHUNKS, c = i % CHUNKS;
      float f[VEC];
      if (r < rows) {
        const long long token = item.token0 + r / heads_per_cta;
        const int head = heads.head0 + r % heads_per_cta;
        Pack<T>::unpack(load16(query + token * query_stride + head * HEAD_DIM + c * VEC), f);
      }
#pragma unroll
      for (int e = 0; e < VEC; e++)
        q_s[r * HEAD_DIM + c * VEC + e] = r < rows ? f[e] * scale_log2 : 0.f;
    }
  }

  // Block-table entries [page_base, page_base + BT_CHUNK) of the request -> bt_s.
  __device__ void stage_block_table(const int* bt_row, int page_base, int num_pages) {
    for (int i = threadIdx.x; i < L::BT_CHUNK; i += NT)
      bt_s[i] = page_base + i < num_pages ? bt_row[page_base + i] : 0;
  }

  // Keys [tile_start, tile_start + n) -> k_s/v_s rows 0..n-1; rows n..TILE-1 are zeroed.
  // All global loads are issued before the shared-memory stores.
  __device__ void load_kv_tile(const T* k_cache, const T* v_cache, int num_kv_heads,
                               int tile_start, int n, int page_base) {
    uint4 kr[L::LOADS], vr[L::LOADS];
#pragma unroll
    for (int j = 0; j < L::LOADS; j++) {
      const int i = threadIdx.x + j * NT, t = i / CHUNKS, c = i % CHUNKS;
      kr[j] = vr[j] = zero16();
      if (i < TILE * CHUNKS && t < n) {
        const int key = tile_start + t;
        const long long page = bt_s[key / BLOCK_SIZE - page_base];
        const long long off =
            ((page * BLOCK_SIZE + key % BLOCK_SIZE) * num_kv_heads + heads.kv_head) * HEAD_DIM +
            c * VEC;
        kr[j] = load16(k_cache + off);
        vr[j] = load16(v_cache + off);
      }
    }
#pragma unroll
    for (int j = 0; j < L::LOADS; j++) {
      const int i = threadIdx.x + j * NT, t = i / CHUNKS, c = i % CHUNKS;
      if (i < TILE * CHUNKS) {
        store16(k_s + t * L::KV_STRIDE + c * VEC, kr[j]);
        store16(v_s + t * L::KV_STRIDE + c * VEC, vr[j]);
      }
    }
  }

  // p_s[r][t] = q_r . k_t (log2 units) where row r may see key tile_start + t (at or before
  // its position, and within its window), else -inf.
  // Rows past `rows` are skipped (r0 is warp-uniform for TILE >= 32).
  __device__ void tile_scores(int tile_start, int n) {
    const int t = threadIdx.x % TILE, r0 = threadIdx.x / TILE;
    constexpr int RSTEP = NT / TILE;
    float s[L::SCORES];
#pragma unroll
    for (int j = 0; j < L::SCORES; j++) s[j] = 0.f;
#pragma unroll 2
    for (int c = 0; c < CHUNKS; c++) {
      float k[VEC];
      Pack<T>::unpack(*reinterpret_cast<const uint4*>(k_s + t * L::KV_STRIDE + c * VEC), k);
#pragma unroll
      for (int j = 0; j < L::SCORES; j++) {
        if (r0 + j * RSTEP >= rows) continue;
        const float* q = q_s + (r0 + j * RSTEP) * HEAD_DIM + c * VEC;
#pragma unroll
        for (int e = 0; e < VEC; e++) s[j] += q[e] * k[e];
      }
    }
    const int key = tile_start + t;
#pragma unroll
    for (int j = 0; j < L::SCORES; j++) {
      const int r = r0 + j * RSTEP;
      const int pos = item.q_pos0 + r / heads_per_cta;
      const bool visible = r < rows && t < n && key <= pos && (window == 0 || key > pos - window);
      p_s[r * L::P_STRIDE + t] = visible ? s[j] : neg_inf();
    }
  }

  // Row tid / TPR: scores -> probabilities in p_s, alpha (rescale of old acc) in alpha_s.
  __device__ void tile_softmax(float& m, float& l) {
    constexpr int PER = TILE / L::TPR;
    const int r = threadIdx.x / L::TPR, part = threadIdx.x % L::TPR;
    float x[PER];
    float tile_max = neg_inf();
#pragma unroll
    for (int j = 0; j < PER; j++) {
      x[j] = p_s[r * L::P_STRIDE + part + j * L::TPR];
      tile_max = fmaxf(tile_max, x[j]);
    }
#pragma unroll
    for (int off = L::TPR / 2; off > 0; off >>= 1)
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
    const float m_new = fmaxf(m, tile_max);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;  // no visible key yet: avoid inf - inf
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const float p = exp2f(x[j] - m_use);  // exp2(-inf) = 0 for hidden keys
      p_s[r * L::P_STRIDE + part + j * L::TPR] = p;
      sum += p;
    }
#pragma unroll
    for (int off = L::TPR / 2; off > 0; off >>= 1)
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float alpha = exp2f(m - m_use);
    l = l * alpha + sum;
    m = m_new;
    if (part == 0) alpha_s[r] = alpha;
  }

  // acc = acc * alpha[row] + sum of p[row][t] * v[t][chunk] over this slice's valid keys
  // (t < n only: rows past n were never loaded).
  __device__ void tile_pv(Acc& acc, int n) {
#pragma unroll
    for (int k = 0; k < L::PAIRS; k++) {
      const int p = pair(k), r = p / CHUNKS, c = p % CHUNKS;
      if (p < 0) continue;
      const float alpha = alpha_s[r];
      float a[VEC];
#pragma unroll
      for (int e = 0; e < VEC; e++) a[e] = acc[k][e] * alpha;
      for (int t = slice; t < n; t += slices) {
        const float w = p_s[r * L::P_STRIDE + t];
        float v[VEC];
        Pack<T>::unpack(*reinterpret_cast<const uint4*>(v_s + t * L::KV_STRIDE + c * VEC), v);
#pragma unroll
        for (int e = 0; e < VEC; e++) a[e] += w * v[e];
      }
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[k][e] = a[e];
    }
  }

  // With several key slices, every slice's acc -> k_s (free after the tile loop); called
  // before the final barrier, `gather_slices` after it.
  __device__ void stash_slices(const Acc& acc) {
    if (slices == 1 || pair(0) < 0) return;
    float* dst = reinterpret_cast<float*>(k_s) + (slice * span + pair(0)) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; e++) dst[e] = acc[0][e];
  }
  __device__ void gather_slices(Acc& acc) const {
    if (slices == 1 || slice != 0 || pair(0) < 0) return;
    const float* src = reinterpret_cast<const float*>(k_s);
    for (int s = 1; s < slices; s++)
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[0][e] += src[(s * span + pair(0)) * VEC + e];
  }

  // Final rows: normalized into `out`, or unnormalized with (m, l) into the split partials.
  __device__ void store(const Acc& acc, T* out, float* part_acc, float* part_ml,
                        int num_heads) {
    const long long slot0 =
        ((long long)(blockIdx.x * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z) * ROWS;
#pragma unroll
    for (int k = 0; k < L::PAIRS; k++) {
      const int p = slice == 0 ? pair(k) : -1, r = p / CHUNKS, c = p % CHUNKS;
      if (p < 0) continue;
      if (part_acc == nullptr) {
        const float inv = __fdividef(1.f, l_s[r]);  // l >= 1: the range holds the row's key
        float o[VEC];
#pragma unroll
        for (int e = 0; e < VEC; e++) o[e] = acc[k][e] * inv;
        store16(out + out_row(r, num_heads) * HEAD_DIM + c * VEC, Pack<T>::pack(o));
      } else {
        float* dst = part_acc + (slot0 + r) * HEAD_DIM + c * VEC;
#pragma unroll
        for (int e = 0; e < VEC; e += 4) store16(dst + e, Pack<float>::pack(&acc[k][e]));
        if (c == 0) {
          part_ml[2 * (slot0 + r)] = m_s[r];
          part_ml[2 * (slot0 + r) + 1] = l_s[r];
        }
      }
    }
  }
};

}  // namespace ds

template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS>
__global__ void __launch_bounds__(ds::NUM_THREADS,
                                  ds::attention_min_blocks(ROWS, HEAD_DIM * sizeof(T)))
    paged_attention(
    T* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
    const T* __restrict__ query, long long query_stride, const T* __restrict__ k_cache,
    const T* __restrict__ v_cache, const int* __restrict__ block_table, int block_table_stride,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ work, int num_heads, int num_kv_heads, int heads_per_cta,
    int split_tokens, float scale_log2, int sliding_window) {
  using Cta = ds::AttentionCta<T, HEAD_DIM, BLOCK_SIZE, ROWS>;
  using L = typename Cta::L;
  REQUIRE_SMEM(L::BYTES);
  DYN_SMEM(unsigned char, smem);
  const ds::WorkItem item =
      ds::load_work_item(work, query_start_loc, seq_lens, blockIdx.x, sliding_window);
  const int key_begin = item.kv_begin + blockIdx.z * split_tokens;
  const int key_end = min(item.kv_end, key_begin + split_tokens);
  if (key_begin >= key_end) return;  // an empty split: uniform over the CTA, before any barrier
  Cta cta(smem, item, ds::cta_heads(num_heads, num_kv_heads, heads_per_cta), heads_per_cta,
          sliding_window);
  cta.stage_query(query, query_stride, scale_log2);

  const int* bt_row = block_table + (long long)item.request * block_table_stride;
  const int num_pages = ds::ceil_div(key_end, BLOCK_SIZE);
  float acc[L::PAIRS][L::VEC];
#pragma unroll
  for (int k = 0; k < L::PAIRS; k++)
#pragma unroll
    for (int e = 0; e < L::VEC; e++) acc[k][e] = 0.f;
  float m = ds::neg_inf(), l = 0.f;  // softmax state of row threadIdx.x / TPR
  int page_base = -L::BT_CHUNK;
  for (int tile_start = key_begin; tile_start < key_end; tile_start += L::TILE) {
    const int n = min(L::TILE, key_end - tile_start);
    if ((tile_start + n - 1) / BLOCK_SIZE >= page_base + L::BT_CHUNK) {  // uniform branch
      page_base = tile_start / BLOCK_SIZE;
      cta.stage_block_table(bt_row, page_base, num_pages);
      __syncthreads();
    }
    cta.load_kv_tile(k_cache, v_cache, num_kv_heads, tile_start, n, page_base);
    __syncthreads();
    cta.tile_scores(tile_start, n);
    __syncthreads();
    cta.tile_softmax(m, l);
    __syncthreads();
    cta.tile_pv(acc, n);
    __syncthreads();  // the next tile overwrites k_s, v_s and p_s
  }
  if (threadIdx.x % L::TPR == 0) {
    cta.m_s[threadIdx.x / L::TPR] = m;
    cta.l_s[threadIdx.x / L::TPR] = l;
  }
  cta.stash_slices(acc);
  __syncthreads();
  cta.gather_slices(acc);
  cta.store(acc, out, part_acc, part_ml, num_heads);
}

// Merges the KV splits of paged_attention: grid (work item, kv_head * head_chunks), same
// work items as the split launch. Row r of CTA (x, y) has its split z partial at slot
// ((x * gridDim.y + y) * num_splits + z) * rows_per_cta + r. Thread mapping: one
// (row, 16-byte chunk) pair per thread and loop step.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(ds::NUM_THREADS) attention_reduce(
    T* __restrict__ out, const float* __restrict__ part_acc, const float* __restrict__ part_ml,
    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
    const int* __restrict__ work, int num_heads, int num_kv_heads, int heads_per_cta,
    int rows_per_cta, int split_tokens, int num_splits, int sliding_window) {
  constexpr int VEC = ds::Pack<T>::VEC, CHUNKS = HEAD_DIM / VEC;
  const ds::WorkItem item =
      ds::load_work_item(work, query_start_loc, seq_lens, blockIdx.x, sliding_window);
  const ds::HeadGroup heads = ds::cta_heads(num_heads, num_kv_heads, heads_per_cta);
  // later splits were empty
  const int splits = ds::ceil_div(item.kv_end - item.kv_begin, split_tokens);
  const long long slot0 =
      (long long)(blockIdx.x * gridDim.y + blockIdx.y) * num_splits * rows_per_cta;
  for (int i = threadIdx.x; i < item.q_count * heads_per_cta * CHUNKS; i += ds::NUM_THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    float m_max = ds::neg_inf();
    for (int z = 0; z < splits; z++)
      m_max = fmaxf(m_max, part_ml[2 * (slot0 + (long long)z * rows_per_cta + r)]);
    float l_sum = 0.f, o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; e++) o[e] = 0.f;
    for (int z = 0; z < splits; z++) {  // a split holds the row's own key: m_max is finite
      const long long slot = slot0 + (long long)z * rows_per_cta + r;
      const float w = exp2f(part_ml[2 * slot] - m_max);  // 0 for a split this row can't see
      l_sum += w * part_ml[2 * slot + 1];
      const float* src = part_acc + slot * HEAD_DIM + c * VEC;
#pragma unroll
      for (int e = 0; e < VEC; e += 4) {
        float a[4];
        ds::Pack<float>::unpack(*reinterpret_cast<const uint4*>(src + e), a);
#pragma unroll
        for (int u = 0; u < 4; u++) o[e + u] += w * a[u];
      }
    }
    const float inv = __fdividef(1.f, l_sum);  // l_sum >= 1 (the max split has p = 1)
#pragma unroll
    for (int e = 0; e < VEC; e++) o[e] *= inv;
    const long long row = (long long)(item.token0 + r / heads_per_cta) * num_heads +
                          heads.head0 + r % heads_per_cta;
    ds::store16(out + row * HEAD_DIM + c * VEC, ds::Pack<T>::pack(o));
  }
}
