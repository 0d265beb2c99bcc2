// Top-k routing of a mixture-of-experts layer, as Hugging Face's Qwen2-MoE, Qwen3-MoE and
// Mixtral routers compute it: a softmax over all experts in float32, the k most probable
// (most probable first; equal probabilities: the lower expert id first), optionally
// renormalized to sum 1. One function serves both layer loops (the Python one through
// cpu_decoder_route, the native one inside its call), so both route alike to the bit.
//
// Layouts: logits [tokens, num_experts] float32 (rows contiguous); ids int32 and weights
// float32 [tokens, topk], contiguous. Serial: a decode step's routing is a few hundred
// exponentials.
#pragma once

#include <cmath>
#include <cstdint>

// Status 1 for bad sizes (topk outside [1, num_experts]).
inline int route_experts(const float* logits, int64_t tokens, int64_t num_experts, int64_t topk,
                         bool renormalize, int32_t* ids, float* weights) {
    if (tokens < 0 || num_experts <= 0 || topk <= 0 || topk > num_experts) return 1;
    constexpr int64_t MAX_EXPERTS = 1024;
    if (num_experts > MAX_EXPERTS) return 1;
    float probs[MAX_EXPERTS];
    bool taken[MAX_EXPERTS];
    for (int64_t t = 0; t < tokens; ++t) {
        const float* x = logits + t * num_experts;
        float top = x[0];
        for (int64_t e = 1; e < num_experts; ++e) top = x[e] > top ? x[e] : top;
        float sum = 0.0f;
        for (int64_t e = 0; e < num_experts; ++e) {
            probs[e] = std::exp(x[e] - top);
            sum += probs[e];
            taken[e] = false;
        }
        for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
        int32_t* id = ids + t * topk;
        float* w = weights + t * topk;
        float chosen = 0.0f;
        for (int64_t j = 0; j < topk; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; ++e)
                if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
            taken[best] = true;
            id[j] = static_cast<int32_t>(best);
            w[j] = probs[best];
            chosen += probs[best];
        }
        if (renormalize)
            for (int64_t j = 0; j < topk; ++j) w[j] /= chosen;
    }
    return 0;
}
