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
// (group_scores). bf16 caches on the widened path with a fixed head_dim that is a multiple
// of 2W (kSplit) read K and V by parity (load_words: the pairs of a row transposed as dwords,
// V accumulated into even/odd columns, put back in order by store), and with AVX-512 their
// transposed tiles run p . V 8 rows at a time (RW), their softmax update in vectors
// (SoftmaxState::update8). The next chunk's K rows are prefetched
// when a chunk starts, its V rows after the chunk's K transposition. With Dot (bf16 caches,
// AVX512-BF16, head_dim a multiple of 32) the direct scores and every p · V run on vdpbf16ps
// (cpu_paged_attention_bf16.h), the scores from the unscaled bf16 queries (qb_), scaled
// after. Included inside cpu_paged_attention.cpp's anonymous namespace, after
// cpu_paged_attention_simd.h, _rows.h, _split.h and _bf16.h.
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
            next_.n = 0;  // the next chunk's K rows now, its V rows after this chunk's K
            if (t0 + KC < kv_end) {
                next_ = chunks.peek(std::min(KC, kv_end - t0 - KC));
                prefetch(next_, k_cache_);
            }
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
    // bf16 rows of a fixed head_dim that is a multiple of 2W, widened path: K transposed and
    // V accumulated by parity (load_words); the accumulator rows hold each 2W-column block as
    // its even columns, then its odd ones.
    static constexpr bool kSplit =
        std::is_same_v<T, bf16> && !Dot && FixedDim > 0 && FixedDim % (2 * W) == 0;
    // Rows per group in transposed tiles: with AVX-512 and the split layout, 8 rows x 2
    // vectors, so p . V widens each V row once per 8 rows (the scores still go 4 rows at a
    // time, P = 2 partial sums, as with RG).
    static constexpr int RW = kSplit && W >= 16 ? 2 * RG : RG;

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

    // The next chunk's rows of one cache (n rows of one head) towards L1.
    void prefetch(const KeyChunks::Peek& next, const T* cache) const {
        const int row_bytes = dim() * static_cast<int>(sizeof(T));
        for (int t = 0; t < next.n; ++t) {
            const char* k = reinterpret_cast<const char*>(cache + next.offsets[t]);
            for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(k + off);
        }
    }

    // Keys t0 + [0, n) at element offsets off[t] of both caches (n <= KC, all < kv_end).
    void attend_chunk(const int64_t* off, int t0, int n) {
        int m0 = 0;
        if (rows_ > kDirectRows) {
            if constexpr (kSplit) {
                transpose_keys_split(k_cache_, off, n, dim(), kt_.data());
            } else {
                transpose_keys(k_cache_, off, n, dim(), kt_.data());
            }
        }
        prefetch(next_, v_cache_);
        if (rows_ > kDirectRows) {
            if constexpr (RW > RG)
                for (; m0 + RW <= rows_; m0 += RW) group<RW>(off, m0, t0, n);
        }
        for (; m0 < rows_; m0 += RG) {
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
            constexpr int SR = R < RG ? R : RG;  // rows per score block
            for (int h = 0; h < R; h += SR)
                group_scores<SR>(q + h * dim(), dim(), kt_.data(), s + h);
        } else {
            direct_scores<R>(q, m0, off, n, s);
        }
        float alpha[R];
#if defined(__AVX512F__)
        if constexpr (R == 8) {  // RW: all 8 rows' softmax bookkeeping in vectors
            int hid[R];
            for (int r = 0; r < R; ++r) hid[r] = hidden(m0 + r, t0, n);
            state_.update8(m0, s, hid, vis, alpha);
        } else
#endif
        for (int r = 0; r < R; ++r)
            alpha[r] = state_.update(m0 + r, s[r], hidden(m0 + r, t0, n), vis[r]);
#if defined(__AVX512BF16__)
        if constexpr (Dot) {
            accumulate_bf16<R>(v_cache_, off, vis, state_.p_rows(m0), alpha, dim(),
                               state_.acc_rows(m0), state_.acc_stride);
            return;
        }
#endif
        if constexpr (kSplit) {
            accumulate_split<R>(v_cache_, off, vis, state_.p_rows(m0), alpha, dim(),
                                state_.acc_rows(m0), state_.acc_stride);
        } else {
            accumulate<T, R>(v_cache_, off, vis, state_.p_rows(m0), alpha, dim(),
                             state_.acc_rows(m0), state_.acc_stride);
        }
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
            if constexpr (kSplit) {
                for (int c = 0; c < dim(); c += 2 * W) {  // even, odd columns -> pairs
                    const VecU32 pairs = bf16_bits(load(a + c) * inv)
                                         | bf16_bits(load(a + c + W) * inv) << 16;
                    std::memcpy(dst + c, &pairs, sizeof pairs);
                }
            } else {
                for (int d = 0; d < dim(); ++d) dst[d] = from_float<T>(a[d] * inv);
            }
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
    KeyChunks::Peek next_{};  // the chunk after the current one (n = 0: none)
    int rows_ = 0, first_limit_ = 0;
};
