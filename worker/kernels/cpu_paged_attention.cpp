// Paged attention on the CPU, reading K/V in place through the block table.
//
// Layouts (all row-major; strides in elements):
//   query  [num_tokens, num_heads, head_dim]     row stride q_stride, heads contiguous
//   key/value (new) [num_tokens, num_kv_heads, head_dim]   row strides k_stride / v_stride
//   k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]   contiguous
//   out    [num_tokens, num_heads, head_dim]     contiguous
//   slot_mapping [num_tokens] int64 (< 0: skip); query_start_loc [num_reqs + 1] int32;
//   seq_lens [num_reqs] int32; block_table [num_reqs, bt_stride] int32
//   items [num_items, 3] int32: (request, first query token, end query token), relative to
//   the request's rows; work unit = (item, kv head), so a K/V row is read once per group of
//   num_heads / num_kv_heads query heads (GQA) and query tile.
// Query token j of a request with seq_len s and query_len n attends keys [0, s - n + j]
// (causal, bottom-right aligned), or with a sliding window w > 0 only the last w of them,
// [s - n + j - w + 1, s - n + j]. Keys at or past a tile's limit (its last row's) and before
// its first row's window are never read, so slots past seq_len (stale or poisoned) and blocks
// that left the window (stale, reused or the null block) never reach the arithmetic; within
// a tile, a key outside a row's own range never reaches that row (its score is replaced by
// -inf with a select; a V row it does not see is not added, or added with weight 0 when it
// lies in the tile's range, where every value is a computed one). Accumulation is fp32 with an online softmax over chunks
// of 16 key positions (cpu_paged_attention_tile.h).
//
// Threads: one OpenMP parallel region per call (or, with num_threads = 0, a step of the
// caller's: see run); built against the OpenMP runtime torch has
// already loaded (same soname), so these are torch's intra-op threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>  // cpu_simd.h: 16-bit loads
#endif

#include <omp.h>

#include "cpu_dtypes.h"
#include "cpu_exp.h"

namespace {

struct Params {
    const void* q; int64_t q_stride;
    const void* k; int64_t k_stride;
    const void* v; int64_t v_stride;
    void* k_cache; void* v_cache;
    const int64_t* slot_mapping; int64_t num_tokens;
    const int32_t* query_start_loc; const int32_t* seq_lens;
    const int32_t* block_table; int64_t bt_stride;
    const int32_t* items; int64_t num_items;
    void* out;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int sliding_window;  // 0: full attention
};

#include "cpu_paged_attention_simd.h"
#include "cpu_paged_attention_rows.h"
#include "cpu_paged_attention_split.h"
#include "cpu_paged_attention_bf16.h"
#include "cpu_paged_attention_tile.h"

template <typename T>
void write_kv(const Params& p) {
    const int64_t row = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
    const size_t bytes = row * sizeof(T);
    T* kc = static_cast<T*>(p.k_cache);
    T* vc = static_cast<T*>(p.v_cache);
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.num_tokens; ++t) {
        const int64_t slot = p.slot_mapping[t];
        if (slot < 0) continue;
        std::memcpy(kc + slot * row, k + t * p.k_stride, bytes);
        std::memcpy(vc + slot * row, v + t * p.v_stride, bytes);
    }
}

// Called by every thread of a parallel region (or by one thread outside any).
template <typename T, int D, bool Dot>
void write_and_attend(const Params& p) {
    write_kv<T>(p);  // ends in an implicit barrier: every slot is written before any read
    Tile<T, D, Dot> tile(p);
    const int64_t units = p.num_items * p.num_kv_heads;
    // With many items, a thread takes all KV heads of one item in turn (dynamic chunks of
    // num_kv_heads units): the cache blocks' rows hold every head, so the core that reads one
    // head's half of a block (whose lines the L2 streamer fetches around it) reads the rest.
    // Few items: one unit at a time, so a single long request still spreads over the team.
    const int chunk = p.num_items >= 4 * omp_get_num_threads() ? p.num_kv_heads : 1;
#pragma omp for schedule(dynamic, chunk)
    for (int64_t u = 0; u < units; ++u)
        tile.attend(p.items + 3 * (u / p.num_kv_heads), static_cast<int>(u % p.num_kv_heads));
}

// num_threads = 0: the call is one step of an enclosing parallel region (cpu_decoder.cpp),
// made by every thread of its team with the same arguments.
template <typename T, int D, bool Dot = false>
void run(const Params& p, int num_threads) {
    if (num_threads == 0) {
        write_and_attend<T, D, Dot>(p);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    write_and_attend<T, D, Dot>(p);
}

template <typename T>
int dispatch_dim(const Params& p, int num_threads) {
    switch (p.head_dim) {
        case 64: run<T, 64>(p, num_threads); return 0;
        case 128: run<T, 128>(p, num_threads); return 0;
        case 256: run<T, 256>(p, num_threads); return 0;
        default: run<T, 0>(p, num_threads); return 0;
    }
}

// bf16 with the vdpbf16ps units where this build has them and head_dim allows (the fixed
// head dims are all multiples of 32); the widened path otherwise.
int dispatch_bf16(const Params& p, int num_threads, bool dot) {
    if constexpr (kHasBf16Dot) {
        if (dot && p.head_dim % kBf16DotDims == 0) {
            switch (p.head_dim) {
                case 64: run<bf16, 64, kHasBf16Dot>(p, num_threads); return 0;
                case 128: run<bf16, 128, kHasBf16Dot>(p, num_threads); return 0;
                case 256: run<bf16, 256, kHasBf16Dot>(p, num_threads); return 0;
                default: run<bf16, 0, kHasBf16Dot>(p, num_threads); return 0;
            }
        }
    }
    return dispatch_dim<bf16>(p, num_threads);
}

}  // namespace

// dtype: a cpu_dtypes.h code; bf16 | BF16_DOT asks for the vdpbf16ps units, taken where the
// build has AVX512-BF16 (cpu_paged_attention_bf16_dot()) and head_dim % 32 == 0.
constexpr int BF16_DOT = 0x10;

extern "C" __attribute__((visibility("default")))
int cpu_paged_attention(int dtype, const void* q, int64_t q_stride, const void* k,
                        int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                        void* v_cache, const int64_t* slot_mapping, int64_t num_tokens,
                        const int32_t* query_start_loc, const int32_t* seq_lens,
                        const int32_t* block_table, int64_t bt_stride, const int32_t* items,
                        int64_t num_items, void* out, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int num_threads,
                        int sliding_window) {
    if (num_heads % num_kv_heads || block_size <= 0 || head_dim <= 0 || num_threads < 0
        || sliding_window < 0)
        return 1;
    Params p{q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens,
             query_start_loc, seq_lens, block_table, bt_stride, items, num_items, out,
             num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window};
    switch (dtype) {  // worker/native/library.py DTYPE_CODES, | BF16_DOT for bf16
        case 0: return dispatch_dim<float>(p, num_threads);
        case 1: return dispatch_bf16(p, num_threads, false);
        case 1 | BF16_DOT: return dispatch_bf16(p, num_threads, true);
        case 2: return dispatch_dim<half_t>(p, num_threads);
        default: return 2;
    }
}

// Whether this build has the vdpbf16ps units (BF16_DOT is honoured, not ignored).
extern "C" __attribute__((visibility("default"))) int cpu_paged_attention_bf16_dot() {
    return kHasBf16Dot;
}

// Floats per SIMD vector this build uses (16: AVX-512, 8: AVX2, 4: baseline); for tests.
extern "C" __attribute__((visibility("default"))) int cpu_paged_attention_simd_width() {
    return W;
}
