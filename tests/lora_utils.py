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
                max_new_tokens: int) -> list[list[int]]:
    """Hugging Face `generate` (float32, greedy, one prompt at a time) with PEFT applying
    `adapters[i]` (None: the base model) to `prompts[i]`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    models: dict[str | None, torch.nn.Module] = {}
    out = []
    for adapter, prompt in zip(adapters, prompts):
        if adapter not in models:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            models[adapter] = (PeftModel.from_pretrained(base, adapter) if adapter else base).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = models[adapter].generate(ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=max_new_tokens,
                                           min_new_tokens=max_new_tokens, do_sample=False,
                                           pad_token_id=0, eos_token_id=None)
        out.append(seq[0, len(prompt):].tolist())
    return out
