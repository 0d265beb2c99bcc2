// The products of fused_moe.cpp's "large" experts (more rows than the decode tiles take:
// prefill) as one grouped product per phase: every expert's product is gguf_gemm.h's strips
// driver on that expert's matrix, and all of them share two worksharing loops, one packing
// each expert's rows transposed into tiles of MV = NVM * W rows (pack_xt), one over units of
// (block of tiles, strip of RN weight rows) (strip_unit), which threads take as they come
// free. A phase passes two barriers however many experts it holds, so a thread the OS takes
// away for a while costs one wait, not one per expert.
// Included inside fused_moe.cpp's anonymous namespace, after gguf_drive.h and dense_blocks.h.
#pragma once

// y[m, n] = x[m, k] · (matrix e of w)ᵀ, x rows contiguous with row stride x_stride.
struct GroupedProduct {
    const ExpertWeights* w; int64_t e, m, n, k;
    const float* x; int64_t x_stride;
    float* xt;   // this product's xᵀ tiles [tiles][k][MV]
    bool pack;   // false: xt is the previous product's (gate and up of one expert)
    float* y; int64_t y_stride;
    // set by lay_out:
    int nvm = 1; int64_t tiles = 0, block = 0, strips = 0;
    int64_t first_pack = 0, first_unit = 0;  // this product's first index in each loop
};

// Lays out a product (MV, tiles, units) and its xt at `xt` (a new one or, with pack false,
// the previous product's); returns the floats of xt it took.
int64_t lay_out(GroupedProduct& p, float* xt, int64_t& packs, int64_t& units) {
    p.nvm = p.m <= W ? 1 : 2;
    const int64_t mv = p.nvm * W, rn = ACC / p.nvm;
    p.tiles = (p.m + mv - 1) / mv;
    p.block = std::max<int64_t>(1, X_BLOCK_BYTES / (mv * p.k * 4));
    p.strips = (p.n + rn - 1) / rn;
    p.xt = xt;
    p.first_pack = packs;
    p.first_unit = units;
    packs += p.pack ? p.tiles : 0;
    units += (p.tiles + p.block - 1) / p.block * p.strips;
    return p.pack ? p.tiles * mv * p.k : 0;
}

// The product holding index i of a loop whose products start at first(p), ascending.
template <class First>
const GroupedProduct& holding(const std::vector<GroupedProduct>& ps, int64_t i, First first) {
    const auto it = std::upper_bound(ps.begin(), ps.end(), i, [&](int64_t v,
                                                                 const GroupedProduct& p) {
        return v < first(p);
    });
    return *(it - 1);
}

// Every product of `ps` (laid out, `packs` and `units` the loops' sizes), by every thread.
void grouped_products(const std::vector<GroupedProduct>& ps, int64_t packs, int64_t units) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < packs; ++i) {
        const GroupedProduct& p = holding(ps, i, [](const GroupedProduct& q) {
            return q.first_pack;
        });
        const int64_t t = i - p.first_pack, mv = p.nvm * W;
        if (p.nvm == 1) pack_xt<W>(p.x, p.x_stride, p.m, t * mv, p.k, p.xt + t * mv * p.k);
        else pack_xt<2 * W>(p.x, p.x_stride, p.m, t * mv, p.k, p.xt + t * mv * p.k);
    }
    float* const stage = thread_buffer(1, ACC * KC);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
        const GroupedProduct& p = holding(ps, u, [](const GroupedProduct& q) {
            return q.first_unit;
        });
        const int64_t v = u - p.first_unit, t0 = v / p.strips * p.block;
        const int64_t rn = ACC / p.nvm, n0 = v % p.strips * rn;
        const Args a{static_cast<const uint8_t*>(p.w->w) + p.e * p.w->expert_stride,
                     p.w->row_stride, p.x, p.x_stride, p.y, p.y_stride, p.m, p.n, p.k, false};
        with_weight_type(static_cast<int>(p.w->qtype), [&]<class Q>() {
            if (p.nvm == 1) strip_unit<Q, 1>(a, n0, t0, std::min(p.tiles, t0 + p.block), p.xt,
                                             stage);
            else strip_unit<Q, 2>(a, n0, t0, std::min(p.tiles, t0 + p.block), p.xt, stage);
        });
    }
}
