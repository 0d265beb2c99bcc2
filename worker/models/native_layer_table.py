"""A model's layer table for the native layer loop (worker/models/native_layer_loop.py): one
`cpu_decoder.Layer` entry per decoder layer, with the addresses of its norms, linears, rotary
table and MoE block, or None where the layer is not taken (the model then keeps the Python
loop).

A layer is taken when it says what its norms are (`native_norms()`: Llama's two, or Gemma 3's
six with q/k head norms), its model names its rotary table (`rotary_of(i)`) and its MLP
activation (`activation`, silu or gelu_tanh), and: the CPU, float32 or bfloat16 layers, the
native attention backend (a float32 or 16-bit KV cache), every linear layer with native
weights (`native_weights()`: GGUF, int8, or a bf16 weight's plain rows where its method
multiplies them by the dense driver into float32, for the row counts it does so:
`max_rows`), no biases, and MLPs that are dense or a mixture-of-experts block that says how it
runs natively (`native_moe()`: router, bound fused experts, top-k; Qwen3-MoE and Mixtral; a
shared expert, as Qwen2-MoE's, is not taken). A bf16 layer's norms round to bf16 as the
Python layer's do. Each layer attends through its own KV group (block table, slots, sliding
window).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.attention.cpu_backend import CpuAttentionBackend
from worker.layers.layernorm import RMSNorm
from worker.layers.linear import LinearBase
from worker.native.cpu_decoder import MAX_EXPERTS, MAX_SEGMENTS, Layer, Linear
from worker.native.fused_moe import FusedExperts
from worker.native.library import DTYPE_CODES


def _linear(layer: LinearBase, limits: list[int]) -> Linear | None:
    """The layer's table entry, or None when it is not taken; appends the most rows it
    takes to `limits` where that is bounded."""
    weights = layer.quant_method.native_weights(layer)
    if weights is None or layer.bias is not None or len(weights.segments) > MAX_SEGMENTS:
        return None
    if weights.max_rows is not None:
        limits.append(weights.max_rows)
    out = Linear(k=weights.segments[0][0].k, num_segments=len(weights.segments),
                 scale=None if weights.scale is None else weights.scale.data_ptr())
    for i, (matrix, start, stop) in enumerate(weights.segments):
        out.segments[i].qtype, out.segments[i].w = matrix.code, matrix.qweight.data_ptr()
        out.segments[i].w_stride = matrix.qweight.stride(0)
        out.segments[i].start, out.segments[i].stop = start, stop
    return out


@dataclass(frozen=True, slots=True)
class LayerNorms:
    """A decoder layer's norms as the native loop runs them: `input` and `pre_mlp` add the
    pending output to the stream first; the optional ones are q/k head norms and norms of the
    attention and MLP outputs before they are added (Gemma's)."""

    input: RMSNorm
    pre_mlp: RMSNorm
    q: RMSNorm | None = None
    k: RMSNorm | None = None
    attn_out: RMSNorm | None = None
    mlp_out: RMSNorm | None = None

    def all(self) -> list[RMSNorm]:
        return [n for n in (self.input, self.pre_mlp, self.q, self.k, self.attn_out,
                            self.mlp_out) if n is not None]


def _pointer(norm: RMSNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


@dataclass(frozen=True, slots=True)
class NativeMoe:
    """A mixture-of-experts feed-forward as the native loop runs it (a block's `native_moe()`):
    `router` (a linear [num_experts, hidden]) gives the logits, the top `top_k` experts
    (renormalized or not) go through `experts`' bound fused kernel, and the partial sums are
    reduced across ranks once."""

    router: LinearBase
    experts: FusedExperts
    top_k: int
    renormalize: bool


def _mlp(mlp: nn.Module, limits: list[int]) -> tuple[list, NativeMoe | None] | None:
    """(gate_up and down entries, the MoE block or None) of a layer's MLP: a dense one's
    linears, or a MoE block's router (the table's gate_up and down stay empty)."""
    native_moe = getattr(mlp, "native_moe", None)
    if native_moe is not None:
        moe = native_moe()
        if (moe is None or moe.experts.num_experts > MAX_EXPERTS
                or (router := _linear(moe.router, limits)) is None):
            return None
        return [Linear(), Linear(), router], moe
    if not hasattr(mlp, "gate_up_proj") or not mlp.down_proj.reduce_results:
        return None
    linears = [_linear(m, limits) for m in (mlp.gate_up_proj, mlp.down_proj)]
    return None if None in linears else ([*linears, Linear()], None)


def layer_entry(layer: nn.Module, rotary: nn.Module, limits: list[int]) -> Layer | None:
    """A decoder layer's table entry, or None when it is not taken."""
    attn, norms = layer.self_attn, layer.native_norms()
    rounded = layer.dtype == torch.bfloat16  # its norms' outputs (Gemma's extra ones: not taken)
    if (not attn.o_proj.reduce_results or not isinstance(attn.backend, CpuAttentionBackend)
            or not _float_rows(rotary.cos)
            or rounded and (norms.attn_out is not None or norms.mlp_out is not None)):
        return None
    linears = [_linear(m, limits) for m in (attn.qkv_proj, attn.o_proj)]
    mlp = _mlp(layer.mlp, limits)
    if (None in linears or mlp is None
            or any(not _float_rows(n.weight) for n in norms.all())):
        return None
    (gate_up, down, router), moe = mlp
    routing = (0, 0, 0) if moe is None else (moe.experts.num_experts, moe.top_k,
                                             int(moe.renormalize))
    return Layer(norms.input.weight.data_ptr(), norms.pre_mlp.weight.data_ptr(), *linears,
                 gate_up, down, None, None, _pointer(norms.q), _pointer(norms.k),
                 _pointer(norms.attn_out), _pointer(norms.mlp_out), rotary.cos.data_ptr(),
                 rotary.sin.data_ptr(), 0, DTYPE_CODES[layer.dtype],
                 None if moe is None else moe.experts.native_layer, router, *routing)


def _float_rows(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()
