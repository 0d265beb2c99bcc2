"""Build a model from a Hugging Face directory and load (and shard) its safetensors weights."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from worker.attention.backend import AttentionBackend
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.layernorm import RMSNorm
from worker.layers.quantization.registry import get_quantization_config
from worker.models.config import ModelConfig
from worker.models.registry import model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               tp: TensorParallel, backend: AttentionBackend,
               max_positions: int) -> nn.Module:
    """The architecture's class from the registry, built on `device` and loaded.

    Floating-point parameters take `dtype`, except RMSNorm weights, which stay float32 (the
    norms compute in float32); buffers (the RoPE tables) stay float32, as in Hugging Face. Once
    every weight is loaded, each layer's weight method finishes its weights (e.g. packs them)."""
    quant_config = get_quantization_config(config.quantization)
    with torch.device(device):
        model = model_class(config.architecture)(config, tp, backend, max_positions,
                                                 quant_config)
    keep_float32 = {id(p) for m in model.modules() if isinstance(m, RMSNorm)
                    for p in m.parameters()}
    for param in model.parameters():  # each shared (tied) parameter once
        if param.is_floating_point() and id(param) not in keep_float32:
            param.data = param.data.to(dtype)
    load_weights(model, model_dir)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model.eval()


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


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Copy each checkpoint tensor into its (possibly merged, possibly sharded) parameter."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(model_dir):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        name, part = _param_name(name, model.packed_modules)
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{model.config.architecture}")
        module_name, _, attr = name.rpartition(".")
        _load_one(modules[module_name], params[name], tensor, part)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} is missing weights: {missing[:8]}")


def _param_name(name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for hf_name, (merged, part) in packed.items():
        if f".{hf_name}." in name:
            return name.replace(f".{hf_name}.", f".{merged}."), part
    return name, None


def _load_one(module: nn.Module, param: nn.Parameter, tensor: torch.Tensor,
              part: object) -> None:
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
