"""What a worker needs from a Hugging Face `config.json`: the generic fields, validated. The
architecture's own reading (worker/models/adapters.py) supplies the rest."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.layers.quantization.registry import CHECKPOINT_METHODS

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or a config value this engine does not implement."""


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts model's routing and expert shapes (its adapter reads them)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each routed expert's
    norm_topk_prob: bool  # the top-k probabilities renormalized to sum 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_step: int = 1  # every sparse_step-th layer is sparse (decoder_sparse_step) ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which stay dense

    def is_sparse(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.sparse_step == 0)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (set by the architecture's adapter)
    qk_norm: bool  # RMSNorm on each query and key head before RoPE (likewise)
    dtype: torch.dtype
    eos_token_id: int | None
    quantization: str  # the checkpoint's: quantization_config's quant_method (gguf), or none
    hf: dict[str, Any] = field(repr=False, compare=False)
    moe: MoEConfig | None = None  # set by a mixture-of-experts architecture's adapter

    @staticmethod
    def from_dict(hf: dict[str, Any], architecture: str, *, attention_bias: bool,
                  qk_norm: bool) -> ModelConfig:
        """The generic fields of `hf`; the architecture's adapter gives the rest."""
        _check_heads(hf)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return ModelConfig(
            architecture=architecture, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias, qk_norm=qk_norm,
            dtype=_DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
                              torch.float32),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            quantization=_quantization(hf), hf=hf)

    def resolve_dtype(self, dtype: str) -> torch.dtype:
        """`auto` means the checkpoint's dtype; otherwise one of float32/bfloat16/float16."""
        if dtype == "auto":
            return self.dtype
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        return _DTYPES[dtype]


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    with open(path) as f:
        return json.load(f)


def _check_heads(hf: dict[str, Any]) -> None:
    if hf["num_attention_heads"] % (hf.get("num_key_value_heads") or hf["num_attention_heads"]):
        raise UnsupportedModelError("num_attention_heads must be a multiple of "
                                    "num_key_value_heads")


def _quantization(hf: dict[str, Any]) -> str:
    name = (hf.get("quantization_config") or {}).get("quant_method", "none")
    if name not in CHECKPOINT_METHODS:
        raise UnsupportedModelError(f"unsupported quantization {name!r}; supported: "
                                    f"{', '.join(CHECKPOINT_METHODS)}")
    return name


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}; supported: "
                                    f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return None if rope_type == "default" else {**scaling, "rope_type": rope_type}


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
