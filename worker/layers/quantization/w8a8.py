"""`--quantization w8a8`: a dense checkpoint quantized at load to int8 weights, one symmetric
scale per output channel (int8.quantize_rows: amax / 127, round half to even, [-127, 127]),
multiplied with activations quantized per token to int8 at run time (vLLM's CPU W8A8 with
dynamic per-token symmetric activations; worker/native/w8a8.py, worker/kernels/w8a8.h).
NOT exact: an opt-in trade of accuracy for int32 dot products (VNNI / AVX2), held to the
accuracy contract its tests check (perplexity, agreement with float32).

Tensor parallelism: each rank quantizes its own share after loading, so a column-parallel
layer's scales follow its rows and a row-parallel layer's rows get one scale per rank's part
of K (as its activations do: each rank quantizes the tokens' part it holds, as in vLLM).
Smoothing (smoothing.py, on unless --no-w8a8-smoothing): before quantization, SmoothQuant
factors calibrated on a built-in text are folded into the float weights (norms, v and up rows),
moving activation outliers into the weights; the run-time semantics stay vLLM's.
The embedding and the LM head stay exact (vLLM leaves lm_head unquantized); a MoE layer's
experts are weight-only int8 (Int8FusedMoEMethod: activations exact), there being no W8A8
expert kernel. A rank whose K is not a multiple of 32 runs the torch reference.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.quantization.base import LinearMethodBase
from worker.layers.quantization.int8 import (
    Int8Config,
    Int8LinearMethod,
    Int8Matrix,
)
from worker.layers.quantization.smoothing import smooth_model
from worker.layers.quantization.unquantized import UnquantizedLMHeadMethod
from worker.native import w8a8 as w8a8_ops


class W8A8Matrix(Int8Matrix):
    """Int8Matrix whose products quantize x per token to int8 (the I8 kernel with A8_FLAG);
    where K is not whole blocks of 32, the torch reference."""

    __slots__ = ()
    a8 = True

    def _unblocked(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_ops.matmul_reference(x, self.q, self.scale).float()


class W8A8LinearMethod(Int8LinearMethod):
    """Int8LinearMethod (int8 `weight`, float32 `weight_scale` [out_per_rank]) whose products
    quantize x per token."""

    matrix = W8A8Matrix


class W8A8Config(Int8Config):
    """Every linear layer W8A8; embedding and LM head dense; experts weight-only int8.
    `smoothing` (default on): SmoothQuant folded into the float weights at load
    (smoothing.py); off for a checkpoint that is smoothed already."""

    def __init__(self, smoothing: bool = True) -> None:
        self.smoothing = smoothing

    def process_model_after_loading(self, model: nn.Module, tp: TensorParallel,
                                    model_dir: str) -> None:
        if self.smoothing:
            smooth_model(model, tp, model_dir)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return W8A8LinearMethod()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return UnquantizedLMHeadMethod()
