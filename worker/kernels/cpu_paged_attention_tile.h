// One work unit of cpu_paged_attention.cpp: a tile of query rows (tokens [j0, j1) of one
// request × the num_heads / num_kv_heads query heads of one KV head) against that request's
// keys [0, context_len + j1), one KV block at a time, read in place through the block table.
// Included inside cpu_paged_attention.cpp's anonymous namespace (needs Params, to_float,
// from_float, exp_nonpositive; the standard headers are included there, outside the namespace).
#pragma once

template <typename T, int FixedDim>  // FixedDim: head_dim known at compile time, or 0
class Tile {
public:
    explicit Tile(const Params& p)
        : p_(p), dim_(FixedDim ? FixedDim : p.head_dim), group_(p.num_heads / p.num_kv_heads),
          block_(p.block_size), kv_row_(static_cast<int64_t>(p.num_kv_heads) * dim_),
          kbuf_(static_cast<size_t>(block_) * dim_), vbuf_(kbuf_.size()) {}

    // item = (request, j0, j1); kv_head in [0, num_kv_heads).
    void attend(const int32_t* item, int kv_head) {
        const int r = item[0], j0 = item[1], j1 = item[2];
        const int64_t start = p_.query_start_loc[r];
        const int context = p_.seq_lens[r] - (p_.query_start_loc[r + 1] - static_cast<int>(start));
        rows_ = (j1 - j0) * group_;
        first_limit_ = context + j0 + 1;  // keys row m may see: first_limit_ + m / group_
        load_queries(start + j0, kv_head);
        const int kv_end = context + j1;
        const int32_t* table = p_.block_table + r * p_.bt_stride;
        const int64_t head_offset = static_cast<int64_t>(kv_head) * dim();
        for (int b = 0, t0 = 0; t0 < kv_end; ++b, t0 += block_) {
            const int n = std::min(block_, kv_end - t0);
            const int64_t base = static_cast<int64_t>(table[b]) * block_ * kv_row_ + head_offset;
            if (t0 + block_ < kv_end)  // blocks are scattered: hide the next one's latency
                prefetch(static_cast<int64_t>(table[b + 1]) * block_ * kv_row_ + head_offset,
                         std::min(block_, kv_end - t0 - block_));
            int64_t stride;
            const float* k = rows_of(static_cast<const T*>(p_.k_cache) + base, n, kbuf_, stride);
            scores(k, stride, t0, n);
            const float* v = rows_of(static_cast<const T*>(p_.v_cache) + base, n, vbuf_, stride);
            accumulate(v, stride, t0, n);
        }
        store(start + j0, kv_head);
    }

private:
    int visible(int m, int t0, int n) const {  // keys of this block row m attends: [0, result)
        return std::clamp(first_limit_ + m / group_ - t0, 0, n);
    }

    // The first n rows of one head of a block, K and V, towards the cache.
    void prefetch(int64_t base, int n) const {
        const char* k = reinterpret_cast<const char*>(static_cast<const T*>(p_.k_cache) + base);
        const char* v = reinterpret_cast<const char*>(static_cast<const T*>(p_.v_cache) + base);
        const int64_t row_bytes = kv_row_ * static_cast<int64_t>(sizeof(T));
        const int row_len = dim() * static_cast<int>(sizeof(T));
        for (int t = 0; t < n; ++t)
            for (int off = 0; off < row_len; off += 64) {
                __builtin_prefetch(k + t * row_bytes + off);
                __builtin_prefetch(v + t * row_bytes + off);
            }
    }

    void load_queries(int64_t token, int kv_head) {
        q_.resize(static_cast<size_t>(rows_) * dim());
        acc_.assign(q_.size(), 0.0f);
        max_.assign(rows_, -std::numeric_limits<float>::infinity());
        sum_.assign(rows_, 0.0f);
        s_.resize(static_cast<size_t>(rows_) * block_);
        const T* q = static_cast<const T*>(p_.q);
        for (int m = 0; m < rows_; ++m) {
            const T* src = q + (token + m / group_) * p_.q_stride
                           + static_cast<int64_t>(kv_head * group_ + m % group_) * dim();
            float* dst = q_.data() + static_cast<size_t>(m) * dim();
#pragma omp simd
            for (int d = 0; d < dim(); ++d) dst[d] = to_float(src[d]) * p_.scale;
        }
    }

    // The block's first n rows of one head as fp32: in place for float, else converted.
    const float* rows_of(const T* src, int n, std::vector<float>& buf, int64_t& stride) const {
        if constexpr (std::is_same_v<T, float>) {
            stride = kv_row_;
            return src;
        } else {
            stride = dim();
            for (int t = 0; t < n; ++t) {
                const T* row = src + t * kv_row_;
                float* dst = buf.data() + static_cast<size_t>(t) * dim();
#pragma omp simd
                for (int d = 0; d < dim(); ++d) dst[d] = to_float(row[d]);
            }
            return buf.data();
        }
    }

    // Scores of the visible keys, then the online-softmax update: s_ holds p = e^(s - max).
    void scores(const float* k, int64_t stride, int t0, int n) {
        for (int m = 0; m < rows_; ++m) {
            const int nm = visible(m, t0, n);
            if (nm == 0) continue;
            float* s = s_.data() + static_cast<size_t>(m) * block_;
            dots(q_.data() + static_cast<size_t>(m) * dim(), k, stride, nm, s);
            float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
            for (int t = 0; t < nm; ++t) block_max = s[t] > block_max ? s[t] : block_max;
            const float new_max = std::max(max_[m], block_max);
            const float alpha = exp_nonpositive(max_[m] - new_max);
            sum_[m] = sum_[m] * alpha + exponentiate(s, nm, new_max);
            max_[m] = new_max;
            if (alpha != 1.0f) scale_row(acc_.data() + static_cast<size_t>(m) * dim(), alpha);
        }
    }

    // s[t] = q . k_t for t < n (four keys at a time, for independent FMA chains).
    void dots(const float* __restrict__ q, const float* __restrict__ k, int64_t stride, int n,
              float* __restrict__ s) const {
        const int D = dim();
        int t = 0;
        for (; t + 4 <= n; t += 4) {
            const float *k0 = k + t * stride, *k1 = k0 + stride, *k2 = k1 + stride,
                        *k3 = k2 + stride;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int d = 0; d < D; ++d) {
                a0 += q[d] * k0[d];
                a1 += q[d] * k1[d];
                a2 += q[d] * k2[d];
                a3 += q[d] * k3[d];
            }
            s[t] = a0, s[t + 1] = a1, s[t + 2] = a2, s[t + 3] = a3;
        }
        for (; t < n; ++t) {
            const float* kt = k + t * stride;
            float a = 0.0f;
#pragma omp simd reduction(+ : a)
            for (int d = 0; d < D; ++d) a += q[d] * kt[d];
            s[t] = a;
        }
    }

    static float exponentiate(float* __restrict__ s, int n, float max) {  // returns the sum
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int t = 0; t < n; ++t) {
            s[t] = exp_nonpositive(s[t] - max);
            total += s[t];
        }
        return total;
    }

    void scale_row(float* __restrict__ a, float alpha) const {
        const int D = dim();
#pragma omp simd
        for (int d = 0; d < D; ++d) a[d] *= alpha;
    }

    void accumulate(const float* v, int64_t stride, int t0, int n) {
        for (int m = 0; m < rows_; ++m)
            weighted_sum(s_.data() + static_cast<size_t>(m) * block_, v, stride,
                         visible(m, t0, n), acc_.data() + static_cast<size_t>(m) * dim());
    }

    // a += sum_t w[t] v_t over t < n.
    void weighted_sum(const float* __restrict__ w, const float* __restrict__ v, int64_t stride,
                      int n, float* __restrict__ a) const {
        const int D = dim();
        for (int t = 0; t < n; ++t) {
            const float* __restrict__ vt = v + t * stride;
            const float wt = w[t];
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] += wt * vt[d];
        }
    }

    void store(int64_t token, int kv_head) const {
        T* out = static_cast<T*>(p_.out);
        for (int m = 0; m < rows_; ++m) {
            T* dst = out + ((token + m / group_) * p_.num_heads + kv_head * group_ + m % group_)
                               * static_cast<int64_t>(dim());
            const float* a = acc_.data() + static_cast<size_t>(m) * dim();
            const float inv = 1.0f / sum_[m];
            for (int d = 0; d < dim(); ++d) from_float(a[d] * inv, dst + d);
        }
    }

    const Params& p_;
    int dim() const { return FixedDim ? FixedDim : dim_; }

    const int dim_, group_, block_;
    const int64_t kv_row_;
    std::vector<float> kbuf_, vbuf_;  // [block_size, head_dim] converted K/V rows (16-bit types)
    std::vector<float> q_, acc_;      // [rows, head_dim]: scaled queries, unnormalized outputs
    std::vector<float> s_;            // [rows, block_size]: scores, then probabilities
    std::vector<float> max_, sum_;    // [rows]: running max and sum of e^(s - max)
    int rows_ = 0, first_limit_ = 0;
};
