"""A Llama model's layer loop as one native call (worker/native/cpu_decoder.py) for steps of up
to 64 token rows (decode batches, short prefill chunks), where the Python loop's per-layer
calls weigh against the arithmetic. It runs the same kernels in the same order, so its outputs equal the loop's bit
for bit; LlamaModel falls back to the loop for anything it does not take.

Taken: tensor parallelism 1 on the CPU, float32 compute, the native attention backend with a
float32 cache, every linear layer with native weights (GGUF, int8), no biases, no per-head
q/k norms. DELTASERVE_NATIVE_LAYERS=0 turns it off.
"""
from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from worker.attention.cpu_backend import CpuAttentionBackend, cpu_plan
from worker.attention.kv_cache_spec import KVCache
from worker.attention.metadata import AttentionMetadata
from worker.layers.linear import LinearBase
from worker.native import cpu_decoder
from worker.native.cpu_decoder import (
    MAX_ROWS,
    MAX_SEGMENTS,
    Layer,
    Linear,
    Model,
    NativeDecoder,
    Step,
)

ENABLED = os.environ.get("DELTASERVE_NATIVE_LAYERS", "1") != "0"


def _linear(layer: LinearBase) -> Linear | None:
    weights = layer.quant_method.native_weights(layer)
    if weights is None or layer.bias is not None or len(weights.segments) > MAX_SEGMENTS:
        return None
    out = Linear(k=weights.segments[0][0].k, num_segments=len(weights.segments),
                 scale=None if weights.scale is None else weights.scale.data_ptr())
    for i, (matrix, start, stop) in enumerate(weights.segments):
        out.segments[i].qtype, out.segments[i].w = matrix.code, matrix.qweight.data_ptr()
        out.segments[i].w_stride = matrix.qweight.stride(0)
        out.segments[i].start, out.segments[i].stop = start, stop
    return out


def _layer(layer: nn.Module) -> Layer | None:
    """A LlamaDecoderLayer's table entry, or None when it is not taken."""
    attn, mlp = layer.self_attn, layer.mlp
    if (hasattr(attn, "q_norm") or attn.o_proj.tp.world_size != 1
            or not isinstance(attn.backend, CpuAttentionBackend)):
        return None
    linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(x is None for x in linears) or any(not _float_rows(w) for w in norms):
        return None
    return Layer(norms[0].data_ptr(), norms[1].data_ptr(), *linears)


def _float_rows(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


class NativeLayerLoop:
    """Bound to one model's weights (kept alive by the model) and, per KV cache, its layers'
    cache addresses. Scratch rows for `max_rows` tokens are allocated once."""

    def __init__(self, native: NativeDecoder, model: nn.Module, layers: list[Layer]) -> None:
        attn, gate_up = model.layers[0].self_attn, model.layers[0].mlp.gate_up_proj
        rotary, norm = model.rotary_emb, model.layers[0].input_layernorm
        self._native, self.max_rows, self._num_layers = native, MAX_ROWS, len(layers)
        self._table = (Layer * len(layers))(*layers)
        self._group = attn.num_heads // attn.num_kv_heads
        hidden, inter = norm.weight.shape[0], gate_up.weight.shape[0] // 2
        self._model = Model(hidden, inter, attn.num_heads, attn.num_kv_heads, attn.head_dim, 0,
                            rotary.cos.shape[0], norm.eps, attn.scale, rotary.cos.data_ptr(),
                            rotary.sin.data_ptr())
        widths = {"h": hidden, "qkv": (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim,
                  "attn": attn.num_heads * attn.head_dim, "gate_up": 2 * inter, "act": inter}
        # float32 [max_rows, width] each; a step uses its first m rows (cpu_decoder.cpp)
        self._scratch = {name: torch.empty(self.max_rows, w) for name, w in widths.items()}
        self._pending = torch.empty(self.max_rows, hidden)
        self._caches_key: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: nn.Module) -> NativeLayerLoop | None:
        """The loop for `model`, or None when the model (or this machine) is not taken."""
        native = cpu_decoder.load() if ENABLED else None
        if native is None or len(model.layers) == 0 or not _float_rows(model.rotary_emb.cos):
            return None
        if any(layer.dtype != torch.float32 for layer in model.layers):
            return None
        eps = {(layer.input_layernorm.eps, layer.post_attention_layernorm.eps)
               for layer in model.layers}
        layers = [_layer(layer) for layer in model.layers]
        if len(eps) != 1 or len(set(next(iter(eps)))) != 1 or None in layers:
            return None
        return cls(native, model, layers)

    def takes(self, num_tokens: int, kv_caches: list[KVCache]) -> bool:
        return 0 < num_tokens <= self.max_rows and self._bind_caches(kv_caches)

    def _bind_caches(self, kv_caches: list[KVCache]) -> bool:
        """Writes the caches' addresses into the layer table (once per set of caches)."""
        first, last = kv_caches[0][0], kv_caches[-1][1]
        key = (id(kv_caches), first.data_ptr(), last.data_ptr(), first.shape[1])
        if key == self._caches_key:
            return True
        if len(kv_caches) != self._num_layers or not all(
                _float_rows(t) and t.dim() == 4 for kv in kv_caches for t in kv):
            return False
        for i, (k, v) in enumerate(kv_caches):
            self._table[i].k_cache, self._table[i].v_cache = k.data_ptr(), v.data_ptr()
        self._model.block_size = first.shape[1]
        self._caches_key = key
        return True

    def __call__(self, positions: torch.Tensor, residual: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """residual [m, hidden] float32 (the embeddings; updated in place) -> the last layer's
        MLP output [m, hidden] float32, not yet added (a view of scratch, valid until the next
        call)."""
        m = residual.shape[0]
        plan = cpu_plan(metadata, self._group)
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        s = self._scratch
        step = Step(m, positions.data_ptr(), plan.slot_mapping.data_ptr(),
                    plan.query_start_loc.data_ptr(), plan.seq_lens.data_ptr(),
                    plan.block_table.data_ptr(), plan.block_table.stride(0),
                    plan.items.data_ptr(), plan.items.shape[0], residual.data_ptr(),
                    self._pending.data_ptr(), s["h"].data_ptr(), s["qkv"].data_ptr(),
                    s["attn"].data_ptr(), s["gate_up"].data_ptr(), s["act"].data_ptr())
        status = self._native.forward(ctypes.byref(self._native.kernels),
                                      ctypes.byref(self._model), self._table, self._num_layers,
                                      ctypes.byref(step), torch.get_num_threads())
        if status == 2:
            raise IndexError("cpu_decoder_forward: a position is outside the rotary table")
        if status:
            raise RuntimeError(f"cpu_decoder_forward rejected its arguments (status {status})")
        return self._pending[:m]
