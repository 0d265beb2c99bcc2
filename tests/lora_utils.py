"""Random PEFT LoRA adapters for a Hugging Face model directory, and Hugging Face + PEFT's
greedy tokens with an adapter applied: the reference deltaserve's adapters are held to."""
from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, path: str, seed: int, targets: list[str] | None = None,
                 r: int = 8, alpha: float = 16, rslora: bool = False, std: float = 0.2,
                 **config: object) -> str:
    """A PEFT adapter of `model_dir` saved at `path` (adapter_config.json +
    adapter_model.safetensors), its A and B random normal(0, std) so that it changes what the
    model writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora,
                                            target_modules=targets or ALL_TARGETS,
                                            init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, std)
    model.save_pretrained(path)
    return path


def peft_greedy(model_dir: str, adapters: list[str | None], prompts: list[list[int]],
                max_new_tokens: int, gguf_file: str | None = None) -> list[list[int]]:
    """Hugging Face `generate` (float32, greedy, one prompt at a time) with PEFT applying
    `adapters[i]` (None: the base model) to `prompts[i]`; the base is loaded once (from
    `gguf_file` in `model_dir`, dequantized, when given)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                gguf_file=gguf_file).eval()
    names = {path: f"adapter{i}" for i, path in enumerate(dict.fromkeys(a for a in adapters if a))}
    model = None
    for path, name in names.items():
        if model is None:
            model = PeftModel.from_pretrained(base, path, adapter_name=name).eval()
        else:
            model.load_adapter(path, adapter_name=name)
    out = []
    for adapter, prompt in zip(adapters, prompts):
        ids = torch.tensor([prompt])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                      eos_token_id=None)
        with torch.no_grad():
            if adapter is None:
                if model is None:
                    seq = base.generate(ids, **kwargs)
                else:
                    with model.disable_adapter():
                        seq = model.generate(input_ids=ids, **kwargs)
            else:
                model.set_adapter(names[adapter])
                seq = model.generate(input_ids=ids, **kwargs)
        out.append(seq[0, len(prompt):].tolist())
    return out


def write_random_adapter(hf_config: dict, path: str, seed: int, targets: list[str],
                         r: int = 8, alpha: float = 16, std: float = 0.05,
                         base_model: str = "") -> str:
    """A PEFT adapter directory written directly (no model loaded): random normal(0, std) A
    and B for `targets` of every layer of a model with `hf_config`'s shapes."""
    import json
    import os

    from safetensors.torch import save_file
    h, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    kv = hf_config.get("num_key_value_heads") or heads
    d = hf_config.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d),
              "o_proj": (heads * d, h), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for target in targets:
            sub = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{sub}.{target}"
            n_in, n_out = shapes[target]
            tensors[f"{name}.lora_A.weight"] = torch.randn(r, n_in, generator=generator) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, r, generator=generator) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
                   "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
                   "base_model_name_or_path": base_model, "inference_mode": True}, f)
    return path


def write_gguf_adapter(peft_dir: str, path: str, base_config: dict,
                       f16: bool = False) -> str:
    """The PEFT adapter in `peft_dir` as llama.cpp's convert_lora_to_gguf.py writes it: GGUF
    names `blk.N.<tensor>.weight.lora_a/.lora_b`, q/k lora_b rows rotary-permuted like the
    base weights, `adapter.lora.alpha`."""
    import json
    import os

    import gguf
    import numpy as np
    from gguf_utils import _llama_cpp_permute
    from safetensors.numpy import load_file
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        alpha = json.load(f)["lora_alpha"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, base_config["num_hidden_layers"])
    heads = {"q_proj": base_config["num_attention_heads"],
             "k_proj": base_config["num_key_value_heads"]}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    for name, tensor in sorted(load_file(os.path.join(peft_dir,
                                                      "adapter_model.safetensors")).items()):
        module, _, half = name.removeprefix("base_model.model.").rpartition(".lora_")
        stored = tensor.astype(np.float32)
        if half.startswith("B") and module.rsplit(".", 1)[1] in heads:
            stored = _llama_cpp_permute(stored, heads[module.rsplit(".", 1)[1]])
        suffix = ".lora_a" if half.startswith("A") else ".lora_b"
        writer.add_tensor(names.get_name(module + ".weight", try_suffixes=(".weight",)) + suffix,
                          stored.astype(np.float16) if f16 else stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
