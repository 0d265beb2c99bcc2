"""GGUF file -> Hugging Face model directory (config, safetensors, tokenizer), through
`transformers`' own GGUF reader and dequantizer."""
from __future__ import annotations

import json
import os
from typing import Any

WEIGHTS_FILE = "model.safetensors"
# transformers model types we convert; llama.cpp stores Mistral as "llama" too, and
# transformers names it back from the file's `general.name`.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "gemma3_text")
# float32 holds every dequantized GGUF value exactly (a block scale times a small integer,
# plus an offset, all computed in float32); bfloat16 would round them a second time. The
# engine casts on load when asked for `dtype="bfloat16"`.
DEFAULT_DTYPE = "float32"


class GGUFConversionError(ValueError):
    """The GGUF file is missing or holds a model we do not convert."""


def convert_gguf(gguf_file: str, out_dir: str, dtype: str = DEFAULT_DTYPE) -> str:
    """Write `out_dir` (created if needed) as a Hugging Face directory of the GGUF model:
    config.json, model.safetensors, generation_config.json and the tokenizer. The same file
    gives byte-identical safetensors. Returns `out_dir`."""
    if not os.path.isfile(gguf_file):
        raise GGUFConversionError(f"no GGUF file at {gguf_file!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: nothing to ask a hub
    model = _load_model(gguf_file)
    os.makedirs(out_dir, exist_ok=True)
    _save_weights(model, os.path.join(out_dir, WEIGHTS_FILE), dtype)
    _save_config(model, out_dir, dtype)
    model.generation_config.save_pretrained(out_dir)
    save_tokenizer(gguf_file, out_dir)
    return out_dir


def _load_model(gguf_file: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    directory, name = os.path.split(os.path.abspath(gguf_file))
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise GGUFConversionError(f"{gguf_file!r} holds a {config.model_type!r} model; "
                                  f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                dtype=torch.float32).eval()


def _save_weights(model: Any, path: str, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    target = getattr(torch, dtype)
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # one storage under two names; loaders re-tie it
        state.pop("lm_head.weight", None)
    from launch.model_cache.progress import progress_bar
    with progress_bar(total=len(state), desc="converting", unit="tensor") as bar:
        tensors = {}
        for name, t in state.items():
            tensors[name] = t.detach().to(target).contiguous()
            bar.update()
    # save_file orders tensors itself and writes no timestamp: the bytes depend only on
    # names, shapes and values.
    save_file(tensors, path, metadata={"format": "pt"})


def _save_config(model: Any, out_dir: str, dtype: str) -> None:
    config: dict[str, Any] = model.config.to_diff_dict()  # what save_pretrained writes
    config.pop("quantization_config", None)  # the weights are dequantized
    config.pop("_model_name_or_path", None)  # the GGUF's `general.name`, not a path
    config["architectures"] = [type(model).__name__]
    config["dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def save_tokenizer(gguf_file: str, out_dir: str) -> None:
    """tokenizer.json and a tokenizer_config.json that carries the chat template (if the
    GGUF has one), as older Hugging Face directories do and our front-end reads."""
    from transformers import AutoTokenizer
    directory, name = os.path.split(os.path.abspath(gguf_file))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
