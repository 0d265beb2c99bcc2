"""A model's size from its config, before it loads (to plan memory): its weights, the share
of them in linear layers, and its KV cache per block. Counts follow the config's shapes for
the whole model (every rank's share); norms and biases are left out. A worker counts every
model it loads: the target, and a draft model where speculative decoding proposes with one
(ModelRunner.draft_config)."""
from __future__ import annotations

from worker.models.config import ModelConfig


def linear_weights(config: ModelConfig) -> int:
    """Weights of every linear layer and of the LM head (a tied head counted too): what a
    bf16 model's float32 copies cover (worker/layers/bf16_linear.py)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads + config.num_key_value_heads  # q + o, k + v
    attention = 2 * hidden * config.head_dim * heads
    layers = sum(attention + _mlp_linears(config, i) for i in range(config.num_hidden_layers))
    return layers + config.vocab_size * hidden


def weights(config: ModelConfig) -> int:
    """Every weight: the linears, an untied embedding table and the routed experts."""
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    moe = config.moe
    experts = 0 if moe is None else sum(
        3 * config.hidden_size * moe.intermediate_size * moe.num_experts
        for i in range(config.num_hidden_layers) if moe.is_sparse(i))
    return linear_weights(config) + embedding + experts


def kv_block_bytes(config: ModelConfig, block_size: int, ranks: int, dtype_bytes: int) -> int:
    """One rank's keys and values for `block_size` tokens in every layer (a KV head is
    replicated where the ranks outnumber them)."""
    heads = max(1, config.num_key_value_heads // ranks)
    return 2 * config.num_hidden_layers * heads * config.head_dim * block_size * dtype_bytes


def _mlp_linears(config: ModelConfig, layer: int) -> int:
    """A dense MLP's three projections; a sparse layer's router and shared expert (its
    routed experts are not linear layers)."""
    moe, hidden = config.moe, config.hidden_size
    if moe is None or not moe.is_sparse(layer):
        return 3 * hidden * config.intermediate_size
    shared = moe.shared_expert_intermediate_size
    return hidden * (moe.num_experts + 3 * shared + (1 if shared else 0))
