"""Build a model from a Hugging Face directory and load (and shard) its weights: safetensors,
or the GGUF file its config names (kept in blocks or dequantized, per the quantization)."""
from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from worker.attention.backend import AttentionBackend
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.layernorm import RMSNorm
from worker.layers.quantization.base import QuantizationConfig
from worker.layers.quantization.gguf import (
    GGUFConfig,
    GGUFEmbeddingMethod,
    GGUFFusedMoEMethod,
    GGUFLinearMethod,
    GGUFLMHeadMethod,
    kept_tensors,
)
from worker.layers.quantization.gguf_a8 import GGUFA8Config
from worker.layers.quantization.int8 import (
    Int8Config,
    Int8FusedMoEMethod,
    Int8LinearMethod,
    Int8LMHeadMethod,
)
from worker.layers.quantization.unquantized import UnquantizedConfig
from worker.layers.quantization.w8a8 import W8A8Config, W8A8LinearMethod
from worker.models.config import ModelConfig
from worker.models.gguf_checkpoint import GGUFCheckpoint, gguf_file_of
from worker.models.pooling_adapter import PoolingModel
from worker.models.registry import model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An expert's tensor: `<experts module>.<e>.<projection>.weight` (one expert), or without the
# index (all experts stacked), `.weight` optional (transformers 5's fused parameters).
_EXPERT_TENSOR = re.compile(r"(?P<module>.+\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>\w+?)"
                            r"(?:\.weight)?")
GGUF_METHODS = ("gguf", "gguf_a8")  # the methods that keep a GGUF file's blocks


def load_model(model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               tp: TensorParallel, backend: AttentionBackend, max_positions: int,
               quantization: str = "none", convert: str = "none",
               w8a8_smoothing: bool = True) -> nn.Module:
    """The architecture's class from the registry, built on `device` and loaded, its weights
    as `quantization` (resolved: gguf, gguf_a8, int8, w8a8 or none) says.

    Floating-point parameters take `dtype`, except RMSNorm weights, which stay float32 (the
    norms compute in float32); buffers (the RoPE tables) stay float32, as in Hugging Face. Once
    every weight is loaded, each layer's weight method finishes its weights (e.g. packs them).
    `convert` (embed, classify) makes it a pooling model (worker/models/pooling_adapter.py);
    `w8a8_smoothing`: w8a8 folds SmoothQuant factors into the weights before quantizing."""
    cls = model_class(config.architecture)
    gguf_file = (GGUFCheckpoint(gguf_file_of(model_dir, config.hf["quantization_config"]))
                 if config.quantization == "gguf" else None)
    kept = (kept_tensors(gguf_file.types, gguf_file.shapes, cls.packed_modules)
            if gguf_file is not None and quantization in GGUF_METHODS else {})
    quant_config = _quant_config(quantization, kept, cls.packed_modules,
                                 config.tie_word_embeddings, w8a8_smoothing)
    with torch.device(device):
        model = cls(config, tp, backend, max_positions, quant_config)
        if convert != "none":
            model = PoolingModel(model, convert)
    keep_float32 = {id(p) for m in model.modules()
                    if isinstance(m, RMSNorm) or getattr(m, "keep_float32", False)
                    for p in m.parameters()}
    for param in model.parameters():  # each shared (tied) parameter once
        if param.is_floating_point() and id(param) not in keep_float32:
            param.data = param.data.to(dtype)
    if gguf_file is None:
        load_weights(model, iter_checkpoint(model_dir), model_dir)
    else:
        if quantization in GGUF_METHODS:
            gguf_file.log_dequantized(kept)
        load_weights(model, gguf_file.weights(kept), gguf_file.path)
    quant_config.process_model_after_loading(model, tp, model_dir)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


def weights_summary(model: nn.Module, quantization: str) -> str:
    """The method and what this rank holds, e.g. `gguf (Q4_1 x210, Q8_0 x1; 90.1 MiB)`:
    checkpoint tensors kept in GGUF blocks by type, or int8 layers, and the weights' bytes."""
    kept: Counter[str] = Counter()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (GGUFLinearMethod, GGUFFusedMoEMethod)):
            suffix = "/a8" if getattr(method, "a8", False) else ""
            kept.update(t.name + suffix for t in method.types)
        elif isinstance(method, (GGUFEmbeddingMethod, GGUFLMHeadMethod)) and not (
                module is model.lm_head and model.config.tie_word_embeddings):
            kept[method.qtype.name + ("/a8" if getattr(method, "a8", False) else "")] += 1
        elif isinstance(method, W8A8LinearMethod):
            kept["int8/a8"] += 1
        elif isinstance(method, (Int8LinearMethod, Int8LMHeadMethod, Int8FusedMoEMethod)):
            kept["int8"] += 1
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    listed = ", ".join(f"{name} x{count}" for name, count in kept.items())
    return f"{quantization} ({listed + '; ' if listed else ''}{size / 2**20:.1f} MiB)"


def _quant_config(quantization: str, kept: dict, packed: dict[str, tuple[str, object]],
                  tied: bool, w8a8_smoothing: bool = True) -> QuantizationConfig:
    if quantization == "gguf":
        return GGUFConfig(kept, packed, tied)
    if quantization == "gguf_a8":
        return GGUFA8Config(kept, packed, tied)
    if quantization == "w8a8":
        return W8A8Config(smoothing=w8a8_smoothing)
    return Int8Config() if quantization == "int8" else UnquantizedConfig()


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}")
    return files


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]],
                 source: str) -> None:
    """Copy each checkpoint tensor into its (possibly merged, possibly sharded) parameter."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    rename = getattr(model, "checkpoint_name", None)  # a model that places names itself
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if rename is not None and (name := rename(name)) is None:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for old, new in getattr(model, "checkpoint_renames", {}).items():
            name = name.replace(old, new)
        name, part = _expert_param(name, modules) or _param_name(name, model.packed_modules)
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{model.config.architecture}")
        module_name, _, attr = name.rpartition(".")
        _load_one(modules[module_name], params[name], tensor, part)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {source!r} is missing weights: {missing[:8]}")


def _expert_param(name: str, modules: dict[str, nn.Module]) -> tuple[str, object] | None:
    """An experts module's parameter and (expert or None, shard) for an expert's tensor."""
    match = _EXPERT_TENSOR.fullmatch(name)
    module = modules.get(match["module"]) if match else None
    target = getattr(module, "expert_weights", {}).get(match["proj"]) if match else None
    if target is None:
        return None
    param, shard = target
    expert = None if match["expert"] is None else int(match["expert"])
    return f"{match['module']}.{param}", (expert, shard)


def _param_name(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for hf_name, (merged, part) in packed.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{merged}."), part
    return name, None


def _load_one(module: nn.Module, param: nn.Parameter, tensor: torch.Tensor,
              part: object) -> None:
    if tensor.dtype == torch.uint8 and tensor.shape[-1] < param.shape[-1]:
        # GGUF rows of a merged layer whose widest part has a wider type: pad (never read)
        tensor = torch.nn.functional.pad(tensor, (0, param.shape[-1] - tensor.shape[-1]))
    loader = getattr(module, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                             f"checkpoint {tuple(tensor.shape)}")
        param.data.copy_(tensor)
    elif part is None:
        loader(param, tensor)
    else:
        loader(param, tensor, part)
