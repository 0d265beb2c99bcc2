"""A GGUF file read as a checkpoint: its tensors under Hugging Face names, either kept in their
GGUF blocks (uint8 [rows, row bytes], as the quantized methods load them) or dequantized to
float32.

llama.cpp's converter stores each query and key head's rows of a Llama (and Mixtral) model
with the two rotary halves interleaved (row 2j + i of a head holds half i, row j); reading
undoes that by reordering whole rows, so blocks stay intact (Qwen's and Gemma's converters do
not permute). It stores Gemma's (1 + w) norm weights as 1 + w; reading subtracts 1 in float32,
as transformers does, so both read the same w. Tensor shapes in a GGUF file are listed
innermost first; `shapes` gives them as Hugging Face does ([out_features, in_features];
stacked experts [experts, out, in]).

Mixture-of-experts files keep each layer's experts stacked (`ffn_{gate,up,down}_exps`); they
are named `model.layers.N.mlp.experts.{gate,up,down}_proj.weight` here, the router
`mlp.gate`, a shared expert `mlp.shared_expert.*` and its gate `mlp.shared_expert_gate`.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from collections import Counter
from collections.abc import Container, Iterator

import numpy as np
import torch

from worker.native import gguf_ops

logger = logging.getLogger("deltaserve")

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# A mixture-of-experts layer's router, stacked experts and shared expert.
_MOE_LAYER = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
              "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_HEAD_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# general.architecture -> its layer tensors' Hugging Face names (Mistral and Mixtral are
# stored as llama).
LAYER_NAMES = {
    "llama": {**_LAYER, **_MOE_LAYER},
    "qwen2moe": {**_LAYER, **_MOE_LAYER},
    "qwen3moe": {**_LAYER, **_MOE_LAYER, **_HEAD_NORMS},
    "gemma3": {**_LAYER, **_HEAD_NORMS, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
SUPPORTED_ARCHITECTURES = tuple(LAYER_NAMES)
_ROPE_PERMUTED = ("llama",)  # q/k rows interleaved by llama.cpp's converter
_NORMS_PLUS_ONE = ("gemma3",)  # (1 + w) norm weights stored as 1 + w
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE factors: config.json must carry the scaling
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16


class GGUFFileError(ValueError):
    """The GGUF file cannot be run: truncated, another architecture, an unknown tensor or
    tensor type. The message names the file and the field or tensor."""


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    base, dot, suffix = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}{dot}{suffix}"
    layer = LAYER_NAMES[architecture]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in layer:
        return f"model.layers.{match.group(1)}.{layer[match.group(2)]}{dot}{suffix}"
    return None


def rope_unpermute(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: new row (h, i, j) = stored row
    (h, j, i), for head h, rotary half i, index j within the half."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


@functools.cache
def _dequantizable(code: int) -> bool:
    """gguf.quants has a decoder for this GGML type (tried on one zero block)."""
    import gguf.quants
    try:
        qtype = gguf.GGMLQuantizationType(code)
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


class GGUFCheckpoint:
    """Opens and checks the whole file up front (every error before any weight is read)."""

    def __init__(self, path: str) -> None:
        import gguf
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError) as e:
            raise GGUFFileError(f"{path}: truncated or not a GGUF file ({e})") from None
        self.architecture = self._field("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFFileError(f"{path}: general.architecture is {self.architecture!r}; "
                                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.tensors = self._named_tensors()
        self.types = {name: int(t.tensor_type) for name, t in self.tensors.items()}
        self.shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist()))
                       for name, t in self.tensors.items()}
        self._check_types()

    def _field(self, key: str) -> object:
        field = self.reader.fields.get(key)
        if field is None:
            raise GGUFFileError(f"{self.path}: no {key} field")
        return field.contents()

    def _named_tensors(self) -> dict[str, object]:
        named, size = {}, os.path.getsize(self.path)
        self.rope_freqs = False
        for t in self.reader.tensors:
            if t.name == ROPE_FREQS:
                self.rope_freqs = True
                continue
            name = hf_name(t.name, self.architecture)
            if name is None:
                raise GGUFFileError(f"{self.path}: tensor {t.name!r} has no place in a "
                                    f"{self.architecture} model")
            if t.data_offset + t.n_bytes > size:
                raise GGUFFileError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                    f"{t.data_offset + t.n_bytes} of {size}")
            named[name] = t
        return named

    def _check_types(self) -> None:
        for name, code in self.types.items():
            if code in _FLOAT_TYPES or gguf_ops.supported(code) or _dequantizable(code):
                continue
            t = self.tensors[name]
            raise GGUFFileError(f"{self.path}: tensor {t.name!r} has type "
                                f"{t.tensor_type.name}, which deltaserve cannot read")

    def moe_config(self) -> dict[str, object]:
        """config.json fields of a mixture-of-experts file that transformers' GGUF reader
        leaves out (none for a dense file): expert sizes, the dense layers (those without a
        router), and what llama.cpp fixes per architecture (Qwen3-MoE and Mixtral renormalize
        the top-k weights, Qwen2-MoE does not; a llama file with experts is Mixtral)."""
        arch, fields = self.architecture, self.reader.fields
        experts = fields.get(f"{arch}.expert_count")
        if experts is None or int(experts.contents()) == 0:
            return {}
        layers = int(self._field(f"{arch}.block_count"))
        sparse = {int(n.split(".")[2]) for n in self.tensors if n.endswith(".mlp.gate.weight")}
        out: dict[str, object] = {
            "num_experts_per_tok": int(self._field(f"{arch}.expert_used_count")),
            "mlp_only_layers": [i for i in range(layers) if i not in sparse],
            "decoder_sparse_step": 1}
        norm = fields.get(f"{arch}.expert_weights_norm")
        if arch == "llama":
            out.update(model_type="mixtral", num_local_experts=int(experts.contents()))
        else:
            out.update(num_experts=int(experts.contents()), norm_topk_prob=bool(
                norm.contents() if norm is not None else arch == "qwen3moe"),
                moe_intermediate_size=int(self._field(f"{arch}.expert_feed_forward_length")))
            shared = fields.get(f"{arch}.expert_shared_feed_forward_length")
            if shared is not None:
                out["shared_expert_intermediate_size"] = int(shared.contents())
        return out

    def heads(self) -> tuple[int, int]:
        """(query heads, KV heads) as the file stores them."""
        heads = int(self._field(f"{self.architecture}.attention.head_count"))
        kv = self.reader.fields.get(f"{self.architecture}.attention.head_count_kv")
        return heads, int(kv.contents()) if kv is not None else heads

    def log_dequantized(self, kept: Container[str]) -> None:
        """One line naming the quantized types that have no kernel (dequantized at load)."""
        dense = Counter(self.tensors[n].tensor_type.name for n, code in self.types.items()
                        if n not in kept and code not in _FLOAT_TYPES)
        if dense:
            listed = ", ".join(f"{name} ({count} tensors)" for name, count in dense.items())
            logger.info("GGUF types without a kernel, dequantized to float32 at load: %s",
                        listed)

    def weights(self, kept: Container[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor): names in `kept` as uint8 [rows, row bytes] blocks,
        the others as float32; q/k rows in Hugging Face's order."""
        heads = (dict(zip(("q_proj", "k_proj"), self.heads()))
                 if self.architecture in _ROPE_PERMUTED else {})
        plus_one = self.architecture in _NORMS_PLUS_ONE
        for name, t in self.tensors.items():
            tensor = self._blocks(name, t) if name in kept else self._dense(name, t)
            projection = name.rsplit(".", 2)[-2]
            if projection in heads and len(self.shapes[name]) == 2:
                tensor = tensor[rope_unpermute(tensor.shape[0], heads[projection])]
            if plus_one and name.endswith("norm.weight"):
                tensor = tensor - 1.0
            yield name, tensor

    def _blocks(self, name: str, t) -> torch.Tensor:
        """uint8 [rows, row bytes], or [experts, rows, row bytes] for stacked experts."""
        shape = self.shapes[name]
        rows = shape[:-1] if len(shape) == 3 else (int(np.prod(shape[:-1])),)  # (1,): a vector
        return torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(*rows, -1))

    def _dense(self, name: str, t) -> torch.Tensor:
        code, shape = self.types[name], self.shapes[name]
        if code in _FLOAT_TYPES:
            data = np.array(t.data).reshape(shape)
            if code == 30:  # bfloat16 arrives as uint16 bits
                return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).float()
            return torch.from_numpy(data).float()
        blocks = self._blocks(name, t).flatten(0, -2)
        if gguf_ops.supported(code):
            return gguf_ops.dequantize(blocks, code, blocks.shape[0], shape[-1]).view(shape)
        import gguf.quants
        dense = gguf.quants.dequantize(blocks.numpy(), t.tensor_type)
        return torch.from_numpy(dense).view(shape)


def gguf_file_of(model_dir: str, quantization_config: dict) -> str:
    """The GGUF file a model directory's config names (relative paths: to the directory)."""
    name = quantization_config.get("gguf_file")
    if not name:
        raise GGUFFileError(f"{model_dir}: config.json's quantization_config names no "
                            "gguf_file")
    return os.path.join(model_dir, os.path.expanduser(name))
