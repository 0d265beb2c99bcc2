"""GGUF weights kept in their blocks: linear layers, the embedding and the LM head multiply
through the native GGUF kernels (worker/native/gguf_ops.py), float32 in and out.

Which tensors stay quantized is decided once, from the file's tensor types: a layer keeps its
blocks when every checkpoint tensor it holds has a kernel (a merged layer's parts may differ in
type); anything else (float tensors, types without a kernel) is loaded as dense float32 through
the unquantized methods.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from worker.layers.quantization.base import (
    EmbeddingMethodBase,
    FusedMoEMethodBase,
    LinearMethodBase,
    NativeWeights,
    QuantizationConfig,
    ShardDims,
    parameter,
)
from worker.layers.quantization.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
    UnquantizedLMHeadMethod,
)
from worker.native import gguf_ops
from worker.native.fused_moe import bind_stacked
from worker.native.gguf_matrix import GgufMatrix
from worker.native.gguf_ops import GgufType


@dataclass(frozen=True, slots=True)
class Segment:
    """Output rows [start, stop) of a layer, all of one GGUF type."""

    start: int
    stop: int
    qtype: GgufType


def segments(part_sizes: list[int], types: list[GgufType]) -> list[Segment]:
    """Consecutive parts of the same type joined into one segment (one kernel call)."""
    out: list[Segment] = []
    start = 0
    for size, qtype in zip(part_sizes, types, strict=True):
        if out and out[-1].qtype == qtype:
            out[-1] = Segment(out[-1].start, start + size, qtype)
        else:
            out.append(Segment(start, start + size, qtype))
        start += size
    return out


def _check_blocks(layer: nn.Module, prefix: str, qtype: GgufType, in_per_rank: int) -> None:
    """A rank's input features must be whole blocks (a tensor-parallel cut inside a block
    cannot be multiplied)."""
    start = getattr(layer, "in_start", 0)
    if in_per_rank % qtype.block_elems or start % qtype.block_elems:
        raise ValueError(
            f"{prefix}: this tensor-parallel split gives a rank input features "
            f"[{start}, {start + in_per_rank}), which cut {qtype.name}'s blocks of "
            f"{qtype.block_elems}; use another tensor_parallel_size or --quantization none")


def _byte_rows(layer: nn.Module, rows: int, width: int, qtype: GgufType) -> None:
    """`weight` uint8 [rows, width]: GGUF rows as stored (a row-parallel rank's rows are the
    byte ranges of its blocks)."""
    layer.weight = _blocks_parameter((rows, width), qtype)


def _blocks_parameter(shape: tuple[int, ...], qtype: GgufType) -> nn.Parameter:
    dims = ShardDims(input_block=qtype.block_elems, input_block_stored=qtype.block_bytes)
    return parameter(torch.zeros(shape, dtype=torch.uint8), dims)


class GGUFLinearMethod(LinearMethodBase):
    """`weight` uint8 [out_per_rank, row bytes]: this rank's rows of the checkpoint tensor(s)
    in their GGUF blocks, parts in `output_part_sizes` order. Parts of different types are
    separate segments; a row narrower than the widest type's is zero-padded at its end (the
    padding is never read). `apply` takes float32 x and returns float32. `a8`: the products
    quantize x to 8 bits per block (gguf_a8.py; every type must have such a kernel)."""

    def __init__(self, prefix: str, types: list[GgufType], a8: bool = False) -> None:
        self.prefix = prefix
        self.types = types
        self.a8 = a8

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        for qtype in self.types:
            _check_blocks(layer, self.prefix, qtype, in_per_rank)
        layer.gguf_segments = segments(layer.output_part_sizes, self.types)
        width = max(t.row_bytes(in_per_rank) for t in self.types)
        _byte_rows(layer, out_per_rank, width, self.types[0])
        layer.in_per_rank = in_per_rank

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Each segment's rows bound for the kernels (views of `weight`)."""
        k = layer.in_per_rank
        layer.gguf_matrices = [
            (GgufMatrix(layer.weight.data[s.start:s.stop, :s.qtype.row_bytes(k)], s.qtype.code,
                        s.stop - s.start, k, a8=self.a8), s.start, s.stop)
            for s in layer.gguf_segments]

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return torch.float32

    def native_weights(self, layer: nn.Module) -> NativeWeights:
        return NativeWeights(tuple(layer.gguf_matrices))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [tokens, in_per_rank] float32 -> [tokens, out_per_rank] float32."""
        matrices = layer.gguf_matrices
        if len(matrices) == 1:
            y = matrices[0][0](x)
        else:
            y = x.new_empty((x.shape[0], layer.weight.shape[0]))
            for matrix, start, stop in matrices:
                matrix(x, out=y[:, start:stop])
        return y if bias is None else y.add_(bias)


class _GgufTable:
    """A vocabulary table kept in its GGUF blocks: `weight` uint8 [rows_per_rank, row bytes],
    one row per token (the embedding's, or the LM head's, shared when tied); `a8` as
    GGUFLinearMethod's (the LM head's products)."""

    def __init__(self, qtype: GgufType, a8: bool = False) -> None:
        self.qtype = qtype
        self.a8 = a8

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int) -> None:
        _byte_rows(layer, out_per_rank, self.qtype.row_bytes(in_per_rank), self.qtype)
        layer.hidden_size = in_per_rank


class GGUFEmbeddingMethod(_GgufTable, EmbeddingMethodBase):
    """A lookup decodes the rows of the ids."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The blocks are final as loaded (a tied LM head shares them)."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.index_select(0, ids.reshape(-1))
        out = gguf_ops.dequantize(rows, self.qtype.code, rows.shape[0], layer.hidden_size)
        return out.view(*ids.shape, layer.hidden_size)


class GGUFLMHeadMethod(_GgufTable, LinearMethodBase):
    """Logits from the table's blocks, float32 accumulation."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The blocks bound for the kernels (a tied head's are the embedding's, tied by now)."""
        w = layer.weight.data
        layer.gguf_matrix = GgufMatrix(w, self.qtype.code, w.shape[0], layer.hidden_size,
                                       a8=self.a8)

    def compute_dtype(self, layer: nn.Module) -> torch.dtype:
        return torch.float32

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, hidden] -> [n, rows_per_rank] float32."""
        y = layer.gguf_matrix(x.float())
        return y if bias is None else y.add_(bias)


class GGUFFusedMoEMethod(FusedMoEMethodBase):
    """Stacked experts kept in their GGUF blocks (llama.cpp's `ffn_{gate,up,down}_exps`):
    `w13_weight` uint8 [E, 2 * inter_per_rank, row bytes] (gate rows, then up rows; a row
    narrower than the wider type's is zero-padded at its end, never read), `w2_weight` uint8
    [E, hidden, row bytes of inter_per_rank] (a rank's block-aligned byte range of each row).
    `types`: gate's, up's and down's."""

    def __init__(self, prefix: str, types: list[GgufType]) -> None:
        self.prefix = prefix
        self.types = types

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int,  # type: ignore[override]
                       inter_per_rank: int) -> None:
        gate, up, down = self.types
        _check_blocks(layer, f"{self.prefix}.down_proj", down, inter_per_rank)
        width = max(gate.row_bytes(hidden), up.row_bytes(hidden))
        layer.w13_weight = _blocks_parameter((num_experts, 2 * inter_per_rank, width), gate)
        layer.w2_weight = _blocks_parameter((num_experts, hidden, down.row_bytes(inter_per_rank)),
                                            down)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fused_experts = bind_stacked(layer.w13_weight.data, layer.w2_weight.data,
                                           layer.w2_weight.shape[1],
                                           tuple(t.code for t in self.types))


class GGUFConfig(QuantizationConfig):
    """`kept`: checkpoint tensor name -> its GGUF type, for the tensors that stay in their
    blocks (see kept_tensors); `packed`: the model's merged layers (checkpoint projection ->
    (merged name, part)), whose parts are looked up in that order; `tied`: the LM head is the
    embedding's table."""

    def __init__(self, kept: Mapping[str, GgufType], packed: Mapping[str, tuple[str, object]],
                 tied: bool = False) -> None:
        self.kept = dict(kept)
        self.packed = dict(packed)
        self.tied = tied

    def _part_names(self, prefix: str) -> list[str]:
        parent, _, leaf = prefix.rpartition(".")
        parts = [name for name, (merged, _) in self.packed.items() if merged == leaf]
        return [f"{parent}.{p}.weight" for p in parts] if parts else [f"{prefix}.weight"]

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        names = self._part_names(prefix)
        if all(name in self.kept for name in names):
            return GGUFLinearMethod(prefix, [self.kept[name] for name in names])
        return UnquantizedLinearMethod()

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase:
        qtype = self.kept.get(f"{prefix}.weight")
        return GGUFEmbeddingMethod(qtype) if qtype else UnquantizedEmbeddingMethod()

    def get_lm_head_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """A tied head (no tensor of its own) multiplies the embedding's blocks."""
        qtype = self.kept.get("model.embed_tokens.weight" if self.tied else f"{prefix}.weight")
        return GGUFLMHeadMethod(qtype) if qtype else UnquantizedLMHeadMethod()


    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethodBase:
        """Blocks kept when gate, up and down all have kernels; else dense float32."""
        names = [f"{prefix}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        if all(name in self.kept for name in names):
            return GGUFFusedMoEMethod(prefix, [self.kept[name] for name in names])
        return UnquantizedFusedMoEMethod()


def kept_tensors(types: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]],
                 packed: Mapping[str, tuple[str, object]]) -> dict[str, GgufType]:
    """The 2-D tensors (by checkpoint name), and 3-D stacked experts, that stay in their
    blocks: those with a kernel whose merged layer's other parts have kernels too. `types`:
    name -> GGML type code."""
    groups: dict[str, list[str]] = {}
    for name in types:
        merged = name
        for projection, (target, _) in packed.items():
            merged = merged.replace(f".{projection}.", f".{target}.")
        if len(shapes[name]) == 3:  # a layer's stacked experts: one method for all three
            merged = name.rsplit(".", 2)[0]
        groups.setdefault(merged, []).append(name)
    return {name: gguf_ops.gguf_type(types[name]) for group in groups.values()
            if all(gguf_ops.supported(types[n]) and len(shapes[n]) in (2, 3) for n in group)
            for name in group}
