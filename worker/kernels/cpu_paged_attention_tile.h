// One work unit of cpu_paged_attention.cpp: a tile of query rows (tokens [j0, j1) of one
// request × the num_heads / num_kv_heads query heads of one KV head) against that request's
// keys [first, context_len + j1), read in place through the block table, KC key positions at
// a time (a chunk may span blocks, so any block size works); `first` is 0, or with a sliding
// window the first key of the tile's first row's window.
//
// Per chunk, every group of up to RG rows computes its scores register-blocked, updates its
// online softmax and adds p · V into its accumulator rows (each V vector loaded once per
// group). Scores: small tiles (decode with up to RG query heads per KV head) dot each query
// row with the K rows straight from the cache (key_dots); bigger ones (prefill, and decode
// with larger GQA groups) first transpose the chunk's K head slice into kt_ [head_dim][KC]
// fp32, so scores vectorize over keys and each kt_ vector feeds a whole row group
// (group_scores). With Dot (bf16 caches, AVX512-BF16, head_dim a multiple of 32)
// the direct scores and every p · V run on vdpbf16ps (cpu_paged_attention_bf16.h), the scores
// from the unscaled bf16 queries (qb_), scaled after. Included inside cpu_paged_attention.cpp's
// anonymous namespace, after cpu_paged_attention_simd.h, _rows.h and _bf16.h.
#pragma once

// FixedDim: head_dim known at compile time, or 0. Dot: the vdpbf16ps units (T = bf16 only).
template <typename T, int FixedDim, bool Dot = false>
class Tile {
    static_assert(!Dot || (kHasBf16Dot && std::is_same_v<T, bf16>));

public:
    explicit Tile(const Params& p)
        : p_(p), dim_(FixedDim ? FixedDim : p.head_dim), group_(p.num_heads / p.num_kv_heads),
          window_(p.sliding_window),
          kv_row_(static_cast<int64_t>(p.num_kv_heads) * dim_),
          k_cache_(static_cast<const T*>(p.k_cache)), v_cache_(static_cast<const T*>(p.v_cache)),
          kt_(static_cast<size_t>(dim_) * KC) {}

    // item = (request, j0, j1); kv_head in [0, num_kv_heads).
    void attend(const int32_t* item, int kv_head) {
        const int r = item[0], j0 = item[1], j1 = item[2];
        const int64_t start = p_.query_start_loc[r];
        const int context = p_.seq_lens[r] - (p_.query_start_loc[r + 1] - static_cast<int>(start));
        rows_ = (j1 - j0) * group_;
        first_limit_ = context + j0 + 1;  // keys row m may see: [0, first_limit_ + m / group_)
        state_.reset(rows_, dim());
        if constexpr (Dot) qb_.resize(static_cast<size_t>(rows_) * dim());
        load_queries(start + j0, kv_head);
        const int kv_end = context + j1;
        // With a window, row m sees keys from first_limit_ + m / group_ - window on.
        const int kv_begin = window_ ? std::max(0, first_limit_ - window_) : 0;
        KeyChunks chunks(p_.block_table + r * p_.bt_stride, p_.block_size, kv_row_,
                         static_cast<int64_t>(kv_head) * dim(), kv_begin);
        for (int t0 = kv_begin; t0 < kv_end; t0 += KC) {
            const int n = std::min(KC, kv_end - t0);
            chunks.next(n);
            if (t0 + KC < kv_end) prefetch(chunks.peek(std::min(KC, kv_end - t0 - KC)));
            attend_chunk(chunks.offsets, t0, n);
        }
        store(start + j0, kv_head);
    }

private:
    // Tiles of at most this many rows (one register group: decode with up to RG query heads
    // per KV head) take their scores straight from the cache rows (key_dots); bigger ones
    // transpose each chunk's K once (transpose_keys) and share it across their row groups
    // (group_scores). Decode with 8 query heads per KV head (Qwen3-MoE) is 13% faster
    // transposed (32 seqs, context 64..192, 2 threads): key_dots widens each K row once per
    // query row and reduces across lanes per key; the transposition widens it once per tile.
    static constexpr int kDirectRows = RG;

    int dim() const { return FixedDim ? FixedDim : dim_; }
    int visible(int m, int t0, int n) const {  // keys of the chunk row m attends: [0, result)
        return std::clamp(first_limit_ + m / group_ - t0, 0, n);
    }
    int hidden(int m, int t0, int n) const {  // chunk keys before row m's window: [0, result)
        return window_ ? std::clamp(first_limit_ + m / group_ - window_ - t0, 0, n) : 0;
    }

    void load_queries(int64_t token, int kv_head) {
        const T* q = static_cast<const T*>(p_.q);
        for (int m = 0; m < rows_; ++m) {
            const T* src = q + (token + m / group_) * p_.q_stride
                           + static_cast<int64_t>(kv_head * group_ + m % group_) * dim();
            float* dst = state_.q.data() + static_cast<size_t>(m) * dim();
            for (int d = 0; d < dim(); ++d) dst[d] = to_float(src[d]) * p_.scale;
            if constexpr (Dot) std::memcpy(qb_.data() + static_cast<size_t>(m) * dim(), src,
                                           dim() * sizeof(T));
        }
    }

    // The next chunk's K and V rows (n rows of one head) towards the cache.
    void prefetch(const KeyChunks::Peek& next) const {
        const int row_bytes = dim() * static_cast<int>(sizeof(T));
        for (int t = 0; t < next.n; ++t) {
            const char* k = reinterpret_cast<const char*>(k_cache_ + next.offsets[t]);
            const char* v = reinterpret_cast<const char*>(v_cache_ + next.offsets[t]);
            for (int off = 0; off < row_bytes; off += 64) {
                __builtin_prefetch(k + off);
                __builtin_prefetch(v + off);
            }
        }
    }

    // Keys t0 + [0, n) at element offsets off[t] of both caches (n <= KC, all < kv_end).
    void attend_chunk(const int64_t* off, int t0, int n) {
        if (rows_ > kDirectRows) transpose_keys(k_cache_, off, n, dim(), kt_.data());
        for (int m0 = 0; m0 < rows_; m0 += RG) {
            switch (std::min(RG, rows_ - m0)) {
                case 1: group<1>(off, m0, t0, n); break;
                case 2: group<2>(off, m0, t0, n); break;
                case 3: group<3>(off, m0, t0, n); break;
                default: group<RG>(off, m0, t0, n); break;
            }
        }
    }

    // Rows [m0, m0 + R) against the chunk. Visibility grows with m, so the group's last row
    // sees the most keys; V rows past it are never read.
    template <int R>
    void group(const int64_t* off, int m0, int t0, int n) {
        int vis[R];
        for (int r = 0; r < R; ++r) vis[r] = visible(m0 + r, t0, n);
        if (vis[R - 1] == 0) return;  // the whole group is causally before this chunk
        Vec s[R][NK];
        const float* q = state_.q.data() + static_cast<size_t>(m0) * dim();
        if (rows_ > kDirectRows) {
            group_scores<R>(q, dim(), kt_.data(), s);
        } else {
            direct_scores<R>(q, m0, off, n, s);
        }
        float alpha[R];
        for (int r = 0; r < R; ++r)
            alpha[r] = state_.update(m0 + r, s[r], hidden(m0 + r, t0, n), vis[r]);
#if defined(__AVX512BF16__)
        if constexpr (Dot) {
            accumulate_bf16<R>(v_cache_, off, vis, state_.p_rows(m0), alpha, dim(),
                               state_.acc_rows(m0), state_.acc_stride);
            return;
        }
#endif
        accumulate<T, R>(v_cache_, off, vis, state_.p_rows(m0), alpha, dim(),
                         state_.acc_rows(m0), state_.acc_stride);
    }

    // Scores of rows [m0, m0 + R) straight from the cache's K rows: the prescaled float32
    // queries q, or (Dot) the bf16 ones, scaled after the sum.
    template <int R>
    void direct_scores(const float* q, [[maybe_unused]] int m0, const int64_t* off, int n, Vec (&s)[R][NK]) {
#if defined(__AVX512BF16__)
        if constexpr (Dot) {
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < NK; ++j)
                    s[r][j] = key_dots_bf16(qb_.data() + static_cast<size_t>(m0 + r) * dim(),
                                            k_cache_, off + j * W, n - j * W, dim())
                              * p_.scale;
            return;
        }
#endif
        for (int r = 0; r < R; ++r)
            for (int j = 0; j < NK; ++j)
                s[r][j] = key_dots(q + r * dim(), k_cache_, off + j * W, n - j * W, dim());
    }

    void store(int64_t token, int kv_head) const {
        T* out = static_cast<T*>(p_.out);
        for (int m = 0; m < rows_; ++m) {
            T* dst = out + ((token + m / group_) * p_.num_heads + kv_head * group_ + m % group_)
                               * static_cast<int64_t>(dim());
            const float* a = state_.acc_rows(m);
            const float inv = 1.0f / hsum(load(state_.sum.data() + static_cast<size_t>(m) * W));
            for (int d = 0; d < dim(); ++d) dst[d] = from_float<T>(a[d] * inv);
        }
    }

    const Params& p_;
    const int dim_, group_, window_;
    const int64_t kv_row_;
    const T* const k_cache_;
    const T* const v_cache_;
    std::vector<float> kt_;  // [head_dim][KC]: the chunk's keys, transposed, zeros past n
    std::vector<T> qb_;      // Dot: [rows][head_dim] the queries as stored (unscaled)
    SoftmaxState state_;
    int rows_ = 0, first_limit_ = 0;
};
