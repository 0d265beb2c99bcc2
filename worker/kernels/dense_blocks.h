// Dense weight rows read as if they were GGUF blocks of 32 elements (gguf_blocks.h's
// interface: kElems, kBytes, kChunks, chunk(), at()), so gguf_drive.h's drivers multiply
// float32, bfloat16 and float16 matrices too: each weight widened to float32 in registers,
// float32 accumulation. A row of K elements (K a multiple of 32) is K * sizeof(T) bytes.
// Codes are GGML's (F32 0, F16 1, BF16 30). Included inside a .cpp's anonymous namespace,
// after gguf_blocks.h.
#pragma once

template <class T>
struct Dense {
    static constexpr int kElems = 32, kBytes = 32 * static_cast<int>(sizeof(T)), kChunks = 1;
    struct Chunk { const T* p; };
    static Chunk chunk(const uint8_t* b, int) { return {reinterpret_cast<const T*>(b)}; }
    static Vec at(const Chunk& k, int v) { return load(k.p + v * W); }
};

// with_type (gguf_blocks.h) extended by the dense types.
template <class F>
bool with_weight_type(int qtype, F&& f) {
    switch (qtype) {
        case 0: f.template operator()<Dense<float>>(); return true;
        case 1: f.template operator()<Dense<half_t>>(); return true;
        case 30: f.template operator()<Dense<bf16>>(); return true;
        default: return with_type(qtype, f);
    }
}
