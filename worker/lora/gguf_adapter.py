"""llama.cpp's LoRA adapters: a GGUF file (`general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha`) holding `blk.N.<tensor>.weight.lora_a` [rank, in] and `.lora_b`
[out, rank] beside a base model's tensor names, as `convert_lora_to_gguf.py` writes them.

Each module's scaling is llama.cpp's: alpha / rank (1 without an alpha). The converter stores
query and key rows rotary-interleaved like the base weights, so lora_b of q/k is read back
into Hugging Face's row order (lora_a is not permuted). Tensors may be F32, F16, BF16 or any
type gguf can dequantize (Q8_0, ...); they are used in float32.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from worker.lora.peft_config import LoRAAdapterError, PeftConfig
from worker.models.config import ModelConfig
from worker.models.gguf_checkpoint import _dequantizable, hf_name, rope_unpermute

_SUFFIX = {"lora_a": "lora_A", "lora_b": "lora_B"}
# general.architecture of the adapters read -> the bases they fit (q/k rows stored permuted)
_BASES = {"llama": ("LlamaForCausalLM", "MistralForCausalLM")}
MAX_SLACK_BYTES = 1 << 20  # bytes a weights file may hold past its tensors' data (hashed whole)


@dataclass(frozen=True)
class GGUFAdapter:
    """Where a checked GGUF adapter's tensors are: PEFT-style name -> GGUF tensor name."""

    path: str
    names: dict[str, str]
    heads: tuple[int, int]  # (query heads, KV heads) of the base, for q/k lora_b rows

    def read(self) -> _Reader:
        return _Reader(self)


class _Reader:
    def __init__(self, adapter: GGUFAdapter) -> None:
        import gguf
        self.adapter = adapter
        self.tensors = {t.name: t for t in gguf.GGUFReader(adapter.path).tensors}

    def get_tensor(self, name: str) -> torch.Tensor:
        """A PEFT-named tensor as float32, q/k lora_b rows in Hugging Face's order."""
        import gguf.quants
        t = self.tensors[self.adapter.names[name]]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.array(t.data, dtype=np.float32).reshape(shape)
        elif t.tensor_type == gguf.GGMLQuantizationType.BF16:
            bits = np.array(t.data).view(np.int16).reshape(shape)
            data = torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
        else:
            data = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(shape)
        tensor = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        projection = name.split(".")[-3]
        if name.endswith("lora_B.weight") and projection in ("q_proj", "k_proj"):
            heads = self.adapter.heads[projection == "k_proj"]
            tensor = tensor[rope_unpermute(tensor.shape[0], heads)]
        return tensor


def read_gguf_adapter(name: str, path: str, model: ModelConfig,
                      ) -> tuple[dict[str, dict], PeftConfig, GGUFAdapter]:
    """(header as safetensors' {PEFT name: {"shape"}}, the ranks and scalings as a PEFT
    config, where its tensors are); LoRAAdapterError naming what is wrong."""
    import gguf
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any malformed file is refused by name
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is truncated or not a GGUF "
                               f"file ({e})") from None
    kind = _field(reader, "general.type"), _field(reader, "adapter.type")
    if kind != ("adapter", "lora"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {os.path.basename(path)} is not a "
                               f"llama.cpp LoRA adapter (general.type, adapter.type: {kind})")
    arch = _field(reader, "general.architecture")
    if arch not in _BASES:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: GGUF adapters of architecture "
                               f"{arch!r} are not read (llama only)")
    if model.architecture not in _BASES[arch]:
        raise LoRAAdapterError(f"LoRA adapter {name!r} was made for another base model: a "
                               f"{arch} GGUF adapter, the base is {model.architecture}")
    header, names, size = {}, {}, os.path.getsize(path)
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        module = hf_name(base)
        if len(t.shape) != 2 or not _readable(t.tensor_type):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: GGUF tensor {t.name!r} is not a "
                                   f"matrix of a type deltaserve reads ({t.tensor_type!r})")
        if suffix not in _SUFFIX or module is None or not module.endswith(".weight"):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot apply GGUF tensor "
                                   f"{t.name!r}")
        if t.data_offset + t.n_bytes > size:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is truncated")
        peft = f"{module.removesuffix('.weight')}.{_SUFFIX[suffix]}.weight"
        header[peft] = {"shape": [int(d) for d in reversed(t.shape.tolist())]}
        names[peft] = t.name
    used = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if size - used > MAX_SLACK_BYTES:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {os.path.basename(path)} holds "
                               f"{size - used} bytes past its tensors")
    return header, _config(header, _field(reader, "adapter.lora.alpha"), name), \
        GGUFAdapter(path, names, (model.num_attention_heads, model.num_key_value_heads))


def _config(header: dict[str, dict], alpha: object, name: str) -> PeftConfig:
    """Each module's rank from its lora_a, its scaling alpha / rank (1 without alpha)."""
    ranks = {n.removesuffix(".lora_A.weight"): e["shape"][0] for n, e in header.items()
             if n.endswith(".lora_A.weight") and len(e["shape"]) == 2}
    if not ranks:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: a GGUF adapter without lora_a "
                               "tensors")
    alpha = float(alpha) if isinstance(alpha, (int, float)) and alpha and \
        math.isfinite(alpha) else None
    pattern = {re.escape(m): r for m, r in ranks.items()}
    alphas = {re.escape(m): (alpha if alpha is not None else float(r)) for m, r in ranks.items()}
    return PeftConfig(max(ranks.values()), alpha or 1.0, rank_pattern=pattern,
                      alpha_pattern=alphas)


def _readable(code: int) -> bool:
    """F32, F16, BF16, or a type gguf.quants dequantizes."""
    return int(code) in (0, 1, 30) or _dequantizable(int(code))


def _field(reader, key: str) -> object:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
