"""A PEFT adapter directory checked against the base model before anything loads it: its
config, its tensors' names and shapes (read from the safetensors header, not the data), and a
digest of its files.

Tensors are named as PEFT saves them: `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]), `<module>` a decoder layer's q/k/v/o or gate/up/down
projection. An adapter of another base shows itself by its shapes or layer indices, and is
refused naming the first tensor that does not fit.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from worker.lora.gguf_adapter import MAX_SLACK_BYTES, GGUFAdapter, read_gguf_adapter
from worker.lora.peft_config import LoRAAdapterError, LoRAAdapterNotFoundError, PeftConfig
from worker.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 20
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
# The projections an adapter may target, and the decoder sublayer each belongs to.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SUBLAYER = {t: "self_attn" if i < 4 else "mlp" for i, t in enumerate(TARGETS)}
_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>model\.layers\.(?P<layer>\d+)\."
                   r"(?P<sublayer>self_attn|mlp)\.(?P<target>[a-z_]+))\.lora_(?P<ab>[AB])"
                   r"(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """One adapted projection: tensor names in the weights file, rank and scaling."""

    module: str  # e.g. model.layers.3.self_attn.q_proj
    layer: int
    target: str  # q_proj, ..., down_proj
    a_name: str
    b_name: str
    rank: int
    scale: float


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    path: str
    weights_file: str
    modules: tuple[ModuleSpec, ...]
    rank: int  # the largest of its modules'
    digest: str
    base_model_name_or_path: str | None
    gguf: GGUFAdapter | None = None  # a llama.cpp GGUF adapter's tensors (None: safetensors)


def inspect_adapter(name: str, path: str, model: ModelConfig, max_rank: int) -> AdapterSpec:
    """The adapter at `path` (a PEFT directory, or a llama.cpp `.gguf` adapter file),
    checked against `model`: LoRAAdapterNotFoundError without one, LoRAAdapterError naming the
    reason if it cannot be served."""
    if path.endswith(".gguf") and os.path.isfile(path):
        header, config, source = read_gguf_adapter(name, path, model)
        _check_rank(config, max_rank, name)
        modules = _modules(header, config, model, name)
        return AdapterSpec(path, path, modules, max(m.rank for m in modules),
                           _digest(b"", path), None, source)
    if not os.path.isdir(path):
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r} not found: {path!r} is neither "
                                       "a directory nor a .gguf adapter file")
    config_path = os.path.join(path, CONFIG_FILE)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path):
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r} not found: no {CONFIG_FILE} in "
                                       f"{path!r}")
    if not os.path.isfile(weights):
        other = "adapter_model.bin" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else None
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path!r}"
                               + (" (adapter_model.bin, a pickle, is not read: save the "
                                  "adapter with safe_serialization)" if other else ""))
    raw = _read_small(config_path, name)
    try:
        config = PeftConfig.parse(json.loads(raw), name)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON: {e}") from None
    _check_rank(config, max_rank, name)
    header = read_safetensors_header(weights, name)
    modules = _modules(header, config, model, name)
    return AdapterSpec(path, weights, modules, max(m.rank for m in modules),
                       _digest(raw, weights), config.base_model_name_or_path)


def _check_rank(config: PeftConfig, max_rank: int, name: str) -> None:
    if config.max_rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {config.max_rank}, more than "
                               f"--max-lora-rank {max_rank}")


def read_safetensors_header(path: str, name: str) -> dict[str, Any]:
    """The tensors' entries of a safetensors file (dtype, shape, data_offsets), checked to lie
    inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not safetensors")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} has a malformed "
                                   "header")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} has a malformed "
                                   "header") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} has a malformed header")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for tensor, entry in header.items():
        if not _valid_entry(entry, data):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {tensor!r} is malformed or "
                                   f"of an unsupported dtype (F32, F16 and BF16 are read)")
    used = max((e["data_offsets"][1] for e in header.values()), default=0)
    if data - used > MAX_SLACK_BYTES:  # everything is hashed: no room for a padded file
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds {data - used} "
                               "bytes past its tensors")
    return header


def _valid_entry(entry: Any, data_bytes: int) -> bool:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) == 2 and all(
            type(d) is int and d > 0 for d in shape)):
        return False
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            type(o) is int for o in offsets)):
        return False
    begin, end = offsets
    return 0 <= begin <= end <= data_bytes and end - begin == \
        shape[0] * shape[1] * _DTYPES[entry["dtype"]]


def expected_shape(model: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a decoder layer's projection in the base model."""
    h, d, inter = model.hidden_size, model.head_dim, model.intermediate_size
    return {"q_proj": (h, model.num_attention_heads * d), "k_proj": (h, model.num_key_value_heads * d),
            "v_proj": (h, model.num_key_value_heads * d), "o_proj": (model.num_attention_heads * d, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[target]


def _modules(header: dict[str, Any], config: PeftConfig, model: ModelConfig,
             name: str) -> tuple[ModuleSpec, ...]:
    pairs: dict[str, dict[str, str]] = {}
    for tensor in header:
        match = _NAME.match(tensor)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot apply tensor {tensor!r} "
                                   f"(deltaserve applies LoRA to {', '.join(TARGETS)} of the "
                                   "decoder layers)")
        target, layer = match["target"], int(match["layer"])
        if _SUBLAYER.get(target) != match["sublayer"] or (target in TARGETS[4:]
                                                          and _moe(model)):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot apply target module "
                                   f"{match['module']!r} (deltaserve applies LoRA to "
                                   f"{', '.join(TARGETS)} of dense decoder layers)")
        if layer >= model.num_hidden_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r} was made for another base model: "
                                   f"{tensor!r} is in layer {layer}, the base has "
                                   f"{model.num_hidden_layers} layers")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = []
    for module, ab in sorted(pairs.items(), key=lambda kv: _order(kv[0])):
        if len(ab) != 2:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module!r} has lora_"
                                   f"{next(iter(ab))} but not its other half")
        modules.append(_module(module, ab["A"], ab["B"], header, config, model, name))
    return tuple(modules)


def _module(module: str, a_name: str, b_name: str, header: dict[str, Any], config: PeftConfig,
            model: ModelConfig, name: str) -> ModuleSpec:
    target = module.rsplit(".", 1)[1]
    rank, scale = config.rank_and_scale(module)
    (a_rank, a_in), (b_out, b_rank) = header[a_name]["shape"], header[b_name]["shape"]
    want_in, want_out = expected_shape(model, target)
    if (a_in, b_out) != (want_in, want_out):
        raise LoRAAdapterError(f"LoRA adapter {name!r} was made for another base model: "
                               f"{module!r} maps {a_in} -> {b_out} features, the base's "
                               f"{target} maps {want_in} -> {want_out}")
    if a_rank != rank or b_rank != rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {module!r} has rank {a_rank}/{b_rank} "
                               f"in its weights, {rank} in {CONFIG_FILE}")
    return ModuleSpec(module, int(module.split(".")[2]), target, a_name, b_name, rank, scale)


def _order(module: str) -> tuple[int, int]:
    parts = module.split(".")
    return int(parts[2]), TARGETS.index(parts[-1]) if parts[-1] in TARGETS else len(TARGETS)


def _moe(model: ModelConfig) -> bool:
    return getattr(model, "moe", None) is not None


def _read_small(path: str, name: str) -> bytes:
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is over "
                               f"{MAX_CONFIG_BYTES >> 20} MiB")
    with open(path, "rb") as f:
        return f.read()


def _digest(config: bytes, weights: str) -> str:
    """blake2b-128 of the config and the weights file, in hex."""
    h = hashlib.blake2b(config, digest_size=16)
    with open(weights, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
