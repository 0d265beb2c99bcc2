"""A model's layer loop as one native call (worker/native/cpu_decoder.py) for steps of up to 64
token rows (decode batches, short prefill chunks), where the Python loop's per-layer calls
weigh against the arithmetic. It runs the same kernels in the same order, so its outputs equal
the loop's bit for bit; the model falls back to the loop for anything it does not take.

A model is taken when every decoder layer has an entry in its layer table
(worker/models/native_layer_table.py: what a layer must be), its layers agree on their norms'
epsilon, attention scale and KV cache dtype, and this machine has the libraries it calls.

Tensor parallelism: a rank runs its own shards (its query and KV heads as the loader split
them, 3 KV heads over 2 ranks being 2 + 1, its share of the MLP), and the loop sums o_proj's
and down_proj's partial outputs through the shared-memory all-reduce from inside the native
call, with the sequence numbers the Python loop would use, so the sums are its bits. Taken
only where the ranks have that all-reduce (local CPU ranks; DELTASERVE_SHM_ALLREDUCE=0 keeps
the Python loop). The embedding and the vocabulary-parallel LM head stay in Python.

Steps with LoRA adapter rows are taken too: the loop adds each adapter's delta after its
projection (worker/lora/native.py; float32 sums in another order than torch's, so those steps
equal the Python loop's up to rounding). DELTASERVE_NATIVE_LAYERS=0 turns it off.
"""
from __future__ import annotations

import ctypes
import logging
import os

import torch
from torch import nn

from worker.attention.cpu_backend import cpu_plan
from worker.attention.kv_cache_spec import KVCache
from worker.attention.metadata import AttentionMetadata
from worker.distributed.shm_all_reduce import ShmAllReduce
from worker.distributed.tensor_parallel import TensorParallel
from worker.models.native_layer_table import layer_entry
from worker.native import cpu_decoder
from worker.native.cpu_decoder import (
    MAX_GROUPS,
    MAX_ROWS,
    AllReduce,
    Group,
    Layer,
    Model,
    NativeDecoder,
    Step,
)

ENABLED = os.environ.get("DELTASERVE_NATIVE_LAYERS", "1") != "0"
REDUCE_STATUS = 16  # cpu_decoder.cpp's: a failed all-reduce's status is this + its own
logger = logging.getLogger("deltaserve")


def _shm(tp: TensorParallel, hidden: int) -> ShmAllReduce | None | bool:
    """The all-reduce a tensor-parallel rank's loop sums through (None: one rank, nothing to
    sum; False: not taken, no shared-memory all-reduce or a step's sum would not fit it)."""
    if tp.world_size == 1:
        return None
    if tp.shm is None or not tp.shm.fits_bytes(MAX_ROWS * hidden * 4):
        return False
    return tp.shm


def _guards(model: nn.Module) -> list:
    return [guard for module in model.modules()
            if (guard := getattr(getattr(module, "quant_method", None), "native_guard", None))
            is not None]


class NativeLayerLoop:
    """Bound to one model's weights (kept alive by the model) and, per KV cache, its layers'
    cache addresses. Scratch rows for `max_rows` tokens are allocated once."""

    def __init__(self, native: NativeDecoder, model: nn.Module, layers: list[Layer],
                 shm: ShmAllReduce | None = None, max_rows: int = MAX_ROWS) -> None:
        attn = model.layers[0].self_attn
        rotary, norm = model.rotary_of(0), model.layers[0].input_layernorm
        self._native, self.max_rows, self._num_layers = native, max_rows, len(layers)
        self._table = (Layer * len(layers))(*layers)
        self._group = attn.num_heads // attn.num_kv_heads
        dense = [layer.mlp.gate_up_proj for layer in model.layers
                 if hasattr(layer.mlp, "gate_up_proj")]
        hidden, inter = norm.weight.shape[0], dense[0].weight.shape[0] // 2 if dense else 0
        experts = max((x.num_experts for x in layers), default=0)
        top_k = max((x.top_k for x in layers), default=0)
        self._cache_dtype = attn.qkv_proj.cache_dtype
        self._model = Model(hidden, inter, attn.num_heads, attn.num_kv_heads, attn.head_dim, 0,
                            rotary.cos.shape[0], norm.eps, attn.scale,
                            int(model.activation == "gelu_tanh"),
                            attn.backend.dtype_code(self._cache_dtype))
        self._groups_key: tuple[int, ...] = ()
        widths = {"h": hidden, "qkv": (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim,
                  "attn": attn.num_heads * attn.head_dim, "gate_up": 2 * inter, "act": inter}
        # float32 [max_rows, width] each; a step uses its first m rows (cpu_decoder.cpp)
        self._scratch = {name: torch.empty(self.max_rows, w) for name, w in widths.items()}
        # 16-bit rows (bf16 norm outputs, q/k/v and attention in a 16-bit cache's dtype) and
        # the MoE routing's
        for name in ("h", "qkv", "attn"):
            self._scratch[name + "16"] = torch.empty(self.max_rows, widths[name],
                                                     dtype=torch.int16)
        self._scratch["logits"] = torch.empty(self.max_rows, max(experts, 1))
        self._scratch["topk_weights"] = torch.empty(self.max_rows, max(top_k, 1))
        self._scratch["topk_ids"] = torch.empty(self.max_rows, max(top_k, 1),
                                                dtype=torch.int32)
        self._pending = torch.empty(self.max_rows, hidden)
        self._caches_key: tuple[int, ...] = ()
        # A weight method's `native_guard` (LoRA's context) says per step what the loop must
        # add (`native_step()`: 0 nothing, an address, None: not taken).
        self._guards = list({id(g): g for g in _guards(model)}.values())
        self._lora = 0  # this step's LoRAStep address (set by takes)
        # Tensor parallel: the ranks' all-reduce, and its arguments (first_seq set per step).
        self._shm = shm
        self._reduce = None if shm is None else AllReduce(*shm.native_sum()[:5], 0,
                                                          shm.timeout_s, 0)
        self.steps = 0  # steps run (the first one is logged: which loop a rank runs)

    @classmethod
    def build(cls, model: nn.Module) -> NativeLayerLoop | None:
        """The loop for `model`, or None when the model (or this machine) is not taken."""
        native = cpu_decoder.load() if ENABLED else None
        if native is None or len(model.layers) == 0 or model.activation not in (
                "silu", "gelu_tanh"):
            return None
        if any(layer.dtype not in (torch.float32, torch.bfloat16)
               or layer.native_norms() is None for layer in model.layers):
            return None
        eps = {norm.eps for layer in model.layers for norm in layer.native_norms().all()}
        limits = [MAX_ROWS]
        layers = [layer_entry(layer, model.rotary_of(i), limits)
                  for i, layer in enumerate(model.layers)]
        scales = {layer.self_attn.scale for layer in model.layers}
        cache_dtypes = {layer.self_attn.qkv_proj.cache_dtype for layer in model.layers}
        shm = _shm(model.layers[0].self_attn.o_proj.tp, model.layers[0].input_layernorm.weight
                   .shape[0])
        if (len(eps) != 1 or len(scales) != 1 or None in layers or shm is False
                or len(cache_dtypes) != 1
                or not cache_dtypes <= {torch.float32, torch.bfloat16, torch.float16}
                or any(x.moe for x in layers) and not cpu_decoder.with_moe(native)):
            return None
        return cls(native, model, layers, shm, min(limits))

    def takes(self, num_tokens: int, kv_caches: list[KVCache]) -> bool:
        if not 0 < num_tokens <= self.max_rows or not self._bind_caches(kv_caches):
            return False
        lora = [g.native_step() for g in self._guards]
        if None in lora or len(lora) > 1 and any(lora):
            return False
        self._lora = lora[0] if lora else 0
        return True

    def _bind_caches(self, kv_caches: list[KVCache]) -> bool:
        """Writes the caches' addresses into the layer table (once per set of caches)."""
        first, last = kv_caches[0][0], kv_caches[-1][1]
        key = (id(kv_caches), first.data_ptr(), last.data_ptr(), first.shape[1])
        if key == self._caches_key:
            return True
        if len(kv_caches) != self._num_layers or not all(
                t.dtype == self._cache_dtype and t.is_cpu and t.is_contiguous() and t.dim() == 4
                for kv in kv_caches for t in kv):
            return False
        for i, (k, v) in enumerate(kv_caches):
            self._table[i].k_cache, self._table[i].v_cache = k.data_ptr(), v.data_ptr()
        self._model.block_size = first.shape[1]
        self._caches_key = key
        return True

    def _bind_groups(self, metadata: AttentionMetadata, groups: list[AttentionMetadata]) -> None:
        """Each layer's index into the step's groups (written when the mapping changes)."""
        index = {id(g): i for i, g in enumerate(groups)}
        key = tuple(index[id(metadata.for_layer(i))] for i in range(self._num_layers))
        if key != self._groups_key:
            for i, g in enumerate(key):
                self._table[i].group = g
            self._groups_key = key

    def __call__(self, positions: torch.Tensor, residual: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """residual [m, hidden] float32 (the embeddings; updated in place) -> the last layer's
        MLP output [m, hidden] float32, not yet added (a view of scratch, valid until the next
        call)."""
        m = residual.shape[0]
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        s = self._scratch
        groups = metadata.groups()
        if len(groups) > MAX_GROUPS:
            raise ValueError(f"{len(groups)} KV groups: the native loop takes {MAX_GROUPS}")
        self._bind_groups(metadata, groups)
        plans = [cpu_plan(g, self._group) for g in groups]
        step = Step(m, positions.data_ptr(), plans[0].query_start_loc.data_ptr(),
                    plans[0].seq_lens.data_ptr(), len(groups),
                    (Group * MAX_GROUPS)(*(
                        Group(p.slot_mapping.data_ptr(), p.block_table.data_ptr(),
                              p.block_table.stride(0), p.items.data_ptr(), p.items.shape[0],
                              g.sliding_window) for g, p in zip(groups, plans))),
                    residual.data_ptr(), self._pending.data_ptr(), s["h"].data_ptr(),
                    s["qkv"].data_ptr(), s["attn"].data_ptr(), s["gate_up"].data_ptr(),
                    s["act"].data_ptr(), self._lora,
                    None if self._reduce is None else ctypes.addressof(self._reduce),
                    *(s[name].data_ptr() for name in ("h16", "qkv16", "attn16", "logits",
                                                      "topk_ids", "topk_weights")))
        if self._reduce is not None:
            self._reduce.first_seq, self._reduce.calls = self._shm.next_seq, 0
        status = self._native.forward(ctypes.byref(self._native.kernels),
                                      ctypes.byref(self._model), self._table, self._num_layers,
                                      ctypes.byref(step), torch.get_num_threads())
        if self._reduce is not None:
            self._shm.advance(self._reduce.calls)
        self._count(m)
        if status == REDUCE_STATUS + 1:
            raise RuntimeError(f"cpu_decoder_forward: no tensor-parallel peer answer in "
                               f"{self._reduce.timeout_s:.0f} s (rank {self._reduce.rank} of "
                               f"{self._reduce.world})")
        if status == 2:
            raise IndexError("cpu_decoder_forward: a position is outside the rotary table")
        if status:
            raise RuntimeError(f"cpu_decoder_forward rejected its arguments (status {status})")
        return self._pending[:m]

    def _count(self, m: int) -> None:
        self.steps += 1
        if self.steps == 1:
            where = "" if self._reduce is None else (
                f", tensor-parallel rank {self._reduce.rank} of {self._reduce.world}")
            logger.info("native layer loop: first step, %d token rows, %d layers%s", m,
                        self._num_layers, where)
