"""`--quantization gguf_a8`: a GGUF file's blocks multiplied with activations quantized to 8
bits per block of 32, llama.cpp's arithmetic (worker/native/gguf_a8.py, gguf_a8.h). NOT exact:
an opt-in trade of accuracy for integer dot products (VNNI / AVX2), held to the accuracy
contract its tests check (perplexity, greedy agreement with float32).

The layers are GGUFConfig's; the linear layers whose every block type has an 8-bit-activation
kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K, whose activations are
quantized per 32 elements too, not per 256 as llama.cpp's Q8_K) take it; the others (float
tensors) run exactly as under `gguf`. The LM head and the embedding stay exact: on
SmolLM2 an 8-bit LM head took next-token agreement with float32 from 98 % to 96 % and the
perplexity gap from +0.13 % to +0.54 % (held-out English), for no speed at one row (one
product per token, as fast either way).
"""
from __future__ import annotations

from torch import nn

from worker.layers.quantization.base import LinearMethodBase
from worker.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
from worker.native import gguf_a8


class GGUFA8Config(GGUFConfig):
    """GGUFConfig with 8-bit activations wherever the block types allow."""

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        method = super().get_linear_method(layer, prefix)
        if isinstance(method, GGUFLinearMethod) and all(
                gguf_a8.supported(t.code) for t in method.types):
            method.a8 = True
        return method
