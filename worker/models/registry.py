"""Supported architectures: a name in config.json's `architectures` -> its model class
(imported on first use) and its config adapter. A new architecture is a model file and a line.

A model class is built as `cls(config, tp, backend, max_positions, quant_config)` and has
`config`, `packed_modules` (checkpoint name -> (merged parameter, part)), `forward(input_ids,
positions, kv_caches, metadata)`, `compute_logits(hidden)` and `kv_cache_spec()`.
"""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from worker.models.adapters import (
    GEMMA3,
    LLAMA,
    MISTRAL,
    MIXTRAL,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    ConfigAdapter,
    Gemma3Adapter,
)
from worker.models.config import ModelConfig, UnsupportedModelError, read_config_json

# architecture -> (module under worker.models, class, config adapter)
_MODELS: dict[str, tuple[str, str, ConfigAdapter | Gemma3Adapter]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM", LLAMA),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM", MISTRAL),  # without sliding window
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM", QWEN2),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM", QWEN3),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM", GEMMA3),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", QWEN3_MOE),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM", QWEN2_MOE),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM", MIXTRAL),  # without sliding window
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)
# A pooling checkpoint of a supported family runs on its generating class's decoder
# (worker/models/pooling_adapter.py), e.g. Qwen3ForSequenceClassification, Qwen3Model.
_POOLING_SUFFIXES = ("ForSequenceClassification", "Model")
_BY_MODEL_TYPE = {adapter.model_type: arch for arch, (_, _, adapter) in _MODELS.items()}


def load_model_config(model_dir: str) -> ModelConfig:
    """A checkpoint directory's config.json, read by its architecture's adapter."""
    return model_config(read_config_json(model_dir))


def model_config(hf: dict[str, Any]) -> ModelConfig:
    architecture = _architecture(hf)
    return _MODELS[architecture][2].model_config(architecture, hf)


def model_class(architecture: str) -> type[nn.Module]:
    module, name, _ = _MODELS[architecture]
    return getattr(importlib.import_module(f"worker.models.{module}"), name)


def _architecture(hf: dict[str, Any]) -> str:
    """The first supported name in `architectures` (a pooling checkpoint's
    `*ForSequenceClassification` or `*Model` names its generating architecture's decoder);
    without any, the one of `model_type`."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
        for suffix in _POOLING_SUFFIXES:
            if arch.endswith(suffix) and (base := arch[:-len(suffix)] + "ForCausalLM") in _MODELS:
                return base
    if not archs and hf.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[hf["model_type"]]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or hf.get('model_type')!r}; deltaserve supports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
