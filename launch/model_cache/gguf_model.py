"""A GGUF file as a model directory: config.json, generation_config.json and the tokenizer
(with the chat template) read from the file, beside a config that names the file itself, so
the workers load its tensors as they are (`quantization_config: {quant_method: gguf,
gguf_file}`) and the front-end finds a tokenizer. No weights are written.

`--model PATH.gguf` gets such a directory in the cache ($DELTASERVE_CACHE/gguf/<name>-<key>,
the key a hash of the file's path, size and modification time), built once under a lock; the
file is checked first (architecture, tensor names and types, truncation), so a bad file fails
here, before any process starts."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from launch.model_cache.gguf import GGUFConversionError, save_tokenizer
from launch.model_cache.progress import progress_bar
from worker.models.gguf_checkpoint import GGUFCheckpoint, GGUFFileError

MARKER = "deltaserve-gguf.json"
FORMAT = 1  # bump when the directory's contents change: cached directories rebuild
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


def materialize_gguf(gguf_file: str, out_dir: str, gguf_name: str | None = None,
                     progress: bool = True) -> str:
    """Write the config and tokenizer of `gguf_file` into `out_dir` (created if needed);
    config.json names the file as `gguf_name` (a path relative to `out_dir`, e.g. when the
    file sits inside it) or its absolute path. GGUFFileError for a file that cannot run.
    A bar of its three steps on a terminal."""
    with progress_bar(progress, total=3, desc="converting", unit="step") as bar:
        bar.set_postfix_str("tensors")
        checkpoint = GGUFCheckpoint(gguf_file)  # checks the whole file's layout
        bar.update()
        bar.set_postfix_str("config")
        _write_config(gguf_file, checkpoint, out_dir, gguf_name)
        bar.update()
        bar.set_postfix_str("tokenizer")
        save_tokenizer(gguf_file, out_dir)
        bar.update()
    return out_dir


def _write_config(gguf_file: str, checkpoint: GGUFCheckpoint, out_dir: str,
                  gguf_name: str | None) -> None:
    """config.json and generation_config.json, from the file's metadata."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: nothing to ask a hub
    from transformers import AutoConfig, GenerationConfig
    directory, name = os.path.split(os.path.abspath(gguf_file))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except (ValueError, KeyError, RuntimeError) as e:
        raise GGUFFileError(f"{gguf_file}: transformers cannot read its config: {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    hf = _config_dict(config, checkpoint, gguf_name or os.path.abspath(gguf_file))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
        f.write("\n")
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def _config_dict(config: Any, checkpoint: GGUFCheckpoint, gguf_name: str) -> dict[str, Any]:
    hf: dict[str, Any] = config.to_diff_dict()
    hf.pop("_model_name_or_path", None)  # the GGUF's `general.name`, not a path
    hf.update(checkpoint.moe_config())
    if hf.get("model_type") not in _ARCHITECTURES:
        raise GGUFConversionError(f"{checkpoint.path} holds a {hf.get('model_type')!r} model; "
                                  f"supported: {', '.join(_ARCHITECTURES)}")
    hf["architectures"] = [_ARCHITECTURES[hf["model_type"]]]
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if checkpoint.rope_freqs and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise GGUFFileError(f"{checkpoint.path}: tensor 'rope_freqs.weight' (Llama 3 RoPE "
                            "factors) comes without a llama3 rope_scaling in its config; "
                            "run its Hugging Face directory instead")
    hf["tie_word_embeddings"] = "lm_head.weight" not in checkpoint.types
    hf["dtype"] = "float32"  # what dequantized tensors are
    hf["quantization_config"] = {"quant_method": "gguf", "gguf_file": gguf_name}
    return hf


def gguf_model_dir(gguf_file: str, cache_root: str) -> str:
    """The cached directory of a GGUF file given by path, built on first use."""
    path = os.path.abspath(gguf_file)
    stat = os.stat(path)
    key = hashlib.sha256(f"{FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    stem = os.path.splitext(os.path.basename(path))[0]
    final = os.path.join(cache_root, "gguf", f"{stem}-{key.hexdigest()[:16]}")
    if os.path.isfile(os.path.join(final, MARKER)):
        return final
    from filelock import FileLock
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with FileLock(final + ".lock"):
        if not os.path.isfile(os.path.join(final, MARKER)):
            work = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
            try:
                materialize_gguf(path, work)
                with open(os.path.join(work, MARKER), "w") as f:
                    json.dump({"format": FORMAT, "gguf_file": path}, f)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(work, final)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return final
