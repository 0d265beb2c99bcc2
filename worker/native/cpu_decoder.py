"""The native decoder loop (worker/kernels/cpu_decoder.cpp): a Llama, Gemma 3 or MoE model's
layers over a few token rows in one ctypes call, calling the kernels of the cpu-ops, GGUF,
attention and fused-MoE libraries (and, at tensor parallel > 1, the shm all-reduce's). The
ctypes Structures here mirror the C++ structs field by field. `route()` is its MoE routing
entry point, which the Python layer loop routes with too (worker/layers/fused_moe/router.py).

`load()` is the bound library, or None where it or one of the cpu-ops, GGUF and attention
libraries cannot be built here (callers keep the Python layer loop); `with_moe()` adds the
fused-MoE kernel for a model with experts. `lora_delta()` is its entry point applying one
linear's LoRA deltas (worker/lora/native_delta.py), or None where this library cannot be
built.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

from worker.native import cpu_attention, fused_moe, gguf_ops
from worker.native.cpu_ops import native_ops
from worker.native.library import I32, I64, PTR, UNAVAILABLE, NativeLibrary, entry_point

logger = logging.getLogger("deltaserve")

LIBRARY = NativeLibrary("cpu-decoder", "cpu_decoder.cpp")
MAX_SEGMENTS = 4  # cpu_decoder.cpp's
MAX_GROUPS = 8  # likewise: KV layer groups
MAX_EXPERTS = 1024  # moe_routing.h's: the most experts a layer routes natively
# The most token rows a call takes (the scratch rows a loop allocates): decode batches and
# short prefill chunks, where the Python loop's per-layer calls weigh; above it the
# arithmetic dwarfs them.
MAX_ROWS = 64
_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Kernels(ctypes.Structure):
    _fields_ = [("matmul", _P), ("norm", _P), ("silu", _P), ("rope", _P), ("attention", _P),
                ("gelu_tanh", _P), ("head_norm", _P), ("moe", _P)]


class Segment(ctypes.Structure):
    _fields_ = [("qtype", _I64), ("w", _P), ("w_stride", _I64), ("start", _I64),
                ("stop", _I64)]


class Linear(ctypes.Structure):
    _fields_ = [("k", _I64), ("scale", _P), ("num_segments", _I64),
                ("segments", Segment * MAX_SEGMENTS)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear), ("k_cache", _P), ("v_cache", _P),
                ("q_norm", _P), ("k_norm", _P), ("attn_out_norm", _P), ("mlp_out_norm", _P),
                ("cos", _P), ("sin", _P), ("group", _I64), ("norm_dtype", _I64), ("moe", _P),
                ("router", Linear), ("num_experts", _I64), ("top_k", _I64),
                ("renormalize", _I64)]


class Model(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("intermediate", _I64), ("num_heads", _I64),
                ("num_kv_heads", _I64), ("head_dim", _I64), ("block_size", _I64),
                ("max_position", _I64), ("eps", _F32), ("scale", _F32), ("gelu", _I64),
                ("cache_dtype", _I64)]


class Group(ctypes.Structure):
    _fields_ = [("slot_mapping", _P), ("block_table", _P), ("bt_stride", _I64),
                ("items", _P), ("num_items", _I64), ("window", _I64)]


class LoRAFactors(ctypes.Structure):
    # spans: [rank, 2] int64, b's row j is zero outside columns [spans[j, 0], spans[j, 1]);
    # null: none known
    _fields_ = [("rank", _I64), ("a", _P), ("b", _P), ("spans", _P)]


class LoRAStep(ctypes.Structure):
    _fields_ = [("num_adapters", _I64), ("tables", _P), ("bounds", _P), ("rows", _P),
                ("t", _P)]


class AllReduce(ctypes.Structure):
    # sum: shm_all_reduce's address; calls (out): the sums the step made, sequence numbers
    # first_seq, first_seq + 1, ...
    _fields_ = [("sum", _P), ("base", _P), ("slot_bytes", _I64), ("rank", _I64),
                ("world", _I64), ("first_seq", ctypes.c_uint64), ("timeout_s", ctypes.c_double),
                ("calls", _I64)]


class Step(ctypes.Structure):
    _fields_ = [("m", _I64), ("positions", _P), ("query_start_loc", _P), ("seq_lens", _P),
                ("num_groups", _I64), ("groups", Group * MAX_GROUPS), ("residual", _P),
                ("pending", _P), ("h", _P), ("qkv", _P), ("attn", _P), ("gate_up", _P),
                ("act", _P), ("lora", _P), ("reduce", _P), ("h16", _P), ("qkv16", _P),
                ("attn16", _P), ("logits", _P), ("topk_ids", _P), ("topk_weights", _P)]


@dataclass(frozen=True, slots=True)
class NativeDecoder:
    """The entry point and the kernels' addresses."""

    forward: ctypes._CFuncPtr
    kernels: Kernels  # moe: fused_moe_forward once `with_moe` found it built, else None


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


@functools.cache
def load() -> NativeDecoder | None:
    ops, gguf = native_ops(), gguf_ops.native()
    if ops is None or gguf is None:
        return None
    try:
        library = LIBRARY.path()
        attention = cpu_attention.load()
    except UNAVAILABLE as e:
        logger.warning("native decoder loop unavailable, using the Python layer loop: %s", e)
        return None
    forward = entry_point(library, "cpu_decoder_forward",
                          [PTR, PTR, PTR, I32, PTR, I32])
    kernels = Kernels(_address(gguf._matmul), _address(ops._norm), _address(ops._silu),
                      _address(ops._rope), _address(attention), _address(ops._gelu),
                      _address(ops._head_norm), None)
    return NativeDecoder(forward, kernels)


def with_moe(native: NativeDecoder) -> bool:
    """Whether `native` calls the fused-MoE kernel, its address filled in on first asking (a
    model with experts asks: a dense one never loads, nor compiles, that library)."""
    if not native.kernels.moe:
        moe = fused_moe.native()
        native.kernels.moe = None if moe is None else _address(moe)
    return bool(native.kernels.moe)


# logits, tokens, num_experts, topk, renormalize, ids, weights
_ROUTE_ARGS = [PTR, I64, I64, I64, I32, PTR, PTR]


def _optional_entry(name: str, args: list, what: str) -> ctypes._CFuncPtr | None:
    """An entry point of this library, or None (logged) where it cannot be built."""
    try:
        library = LIBRARY.path()
    except UNAVAILABLE as e:
        logger.warning("native %s unavailable, using torch: %s", what, e)
        return None
    return entry_point(library, name, args)


@functools.cache
def route() -> ctypes._CFuncPtr | None:
    """cpu_decoder_route (worker/kernels/moe_routing.h), or None where this library cannot be
    built (routing then stays in torch)."""
    return _optional_entry("cpu_decoder_route", _ROUTE_ARGS, "MoE routing")


# lora, target, x, x_stride, y, y_stride, k, n, num_threads
_LORA_DELTA_ARGS = [PTR, I64, PTR, I64, PTR, I64, I64, I64, I32]


@functools.cache
def lora_delta() -> ctypes._CFuncPtr | None:
    return _optional_entry("cpu_decoder_lora_delta", _LORA_DELTA_ARGS, "LoRA delta")
