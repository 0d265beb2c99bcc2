"""Gemma 3 (text): interleaved local (sliding-window) and global attention layers, each kind
with its own RoPE base; per-head q/k RMSNorm; four (1 + w) RMSNorms per layer (before and after
attention and MLP); a GELU-tanh gated MLP; the embedding scaled by sqrt(hidden_size) in the
embedding's dtype; a tied LM head; scores scaled by query_pre_attn_scalar ** -0.5; the final
logits optionally soft-capped. Tensor parallelism lives in the layers; shapes are per rank."""
from __future__ import annotations

import torch
from torch import nn

from worker.attention.backend import AttentionBackend
from worker.attention.kv_cache_spec import KVCache, KVCacheSpec
from worker.attention.metadata import AttentionMetadata
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.activation import gelu_tanh_and_mul
from worker.layers.layernorm import GemmaRMSNorm
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.quantization.base import QuantizationConfig
from worker.layers.rotary_embedding import RotaryEmbedding
from worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from worker.models.adapters import Gemma3Facts
from worker.models.config import ModelConfig
from worker.models.native_layer_loop import NativeLayerLoop
from worker.models.native_layer_table import LayerNorms


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, facts: Gemma3Facts, layer: int, tp: TensorParallel,
                 backend: AttentionBackend, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads, tp,
            False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, tp,
            shard=(self.qkv_proj.q_start * d, self.qkv_proj.num_heads * d),
            quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.backend, self.layer = d, backend, layer
        self.scale = facts.query_pre_attn_scalar ** -0.5
        self.sliding_window = facts.sliding_window if facts.sliding[layer] else 0
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        n, d = hidden.shape[0], self.head_dim
        q, k, v = self.qkv_proj(hidden).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        q, k = rotary(positions, self.q_norm.heads_(q), self.k_norm.heads_(k))
        meta = metadata.for_layer(self.layer)
        if meta.sliding_window != self.sliding_window:
            raise ValueError(f"layer {self.layer} has window {self.sliding_window}, its KV "
                             f"group {meta.sliding_window}")
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * d))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], tp, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """Hugging Face's `h += post_attn_norm(attn(in_norm(h)))`, then
    `h += post_ffw_norm(mlp(pre_ffw_norm(h)))`, on a float32 stream with the adds fused into
    the next norm (as LlamaDecoderLayer): a layer returns its normed MLP output, not yet added."""

    def __init__(self, config: ModelConfig, facts: Gemma3Facts, layer: int, tp: TensorParallel,
                 backend: AttentionBackend, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, facts, layer, tp, backend, quant_config,
                                         f"{prefix}.self_attn")
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config, tp, quant_config, f"{prefix}.mlp")
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.mlp.down_proj.compute_dtype

    def native_norms(self) -> LayerNorms:
        attn = self.self_attn
        return LayerNorms(self.input_layernorm, self.pre_feedforward_layernorm, attn.q_norm,
                          attn.k_norm, self.post_attention_layernorm,
                          self.post_feedforward_layernorm)

    def forward(self, positions: torch.Tensor, pending: torch.Tensor | None,
                residual: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                rotary: RotaryEmbedding) -> torch.Tensor:
        """residual [num_tokens, hidden_size] float32, updated in place; pending: the previous
        layer's output, not yet added (None for the first layer)."""
        dtype = self.dtype
        if pending is None:
            hidden = self.input_layernorm(residual, dtype)
        else:
            hidden = self.input_layernorm.add_and_norm(pending, residual, dtype)
        attn = self.post_attention_layernorm(
            self.self_attn(positions, hidden, kv_cache, metadata, rotary), dtype)
        mlp = self.mlp(self.pre_feedforward_layernorm.add_and_norm(attn, residual, dtype))
        return self.post_feedforward_layernorm(mlp, dtype)


class Gemma3Model(nn.Module):
    activation = "gelu_tanh"

    def __init__(self, config: ModelConfig, tp: TensorParallel, backend: AttentionBackend,
                 max_positions: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        facts = self.facts = Gemma3Facts.read(config.hf)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   quant_config, f"{prefix}.embed_tokens")
        self.embed_scale = config.hidden_size ** 0.5  # rounded to the embedding's dtype
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, facts, i, tp, backend, quant_config,
                               f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        d = config.head_dim
        self.rotary_local = RotaryEmbedding(d, max_positions, facts.local_rope_theta, None)
        self.rotary_global = RotaryEmbedding(d, max_positions, facts.global_rope_theta,
                                             facts.global_rope_scaling)
        # Made on the first forward (the weights are final by then); False: not taken.
        self.native_loop: NativeLayerLoop | None | bool = None

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        return self.rotary_local if self.facts.sliding[layer] else self.rotary_global

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        """-> [num_tokens, hidden_size] in the compute dtype (the LM head's)."""
        embeds = self.embed_tokens(input_ids)  # [num_tokens, hidden_size], compute dtype
        # Hugging Face multiplies by the scale cast to the embedding's dtype; the product is
        # the float32 stream's start (a fresh tensor, updated in place by the layers).
        scale = torch.tensor(self.embed_scale, dtype=torch.float32).to(embeds.dtype)
        residual = (embeds * scale).float()
        if self.native_loop is None:
            self.native_loop = NativeLayerLoop.build(self) or False
        if self.native_loop and self.native_loop.takes(residual.shape[0], kv_caches):
            pending = self.native_loop(positions, residual, metadata)
        else:
            pending = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                pending = layer(positions, pending, residual, kv_cache, metadata,
                                self.rotary_of(i))
        if pending is None:  # no layers
            return self.norm(residual, embeds.dtype)
        return self.norm.add_and_norm(pending, residual, embeds.dtype)


class Gemma3ForCausalLM(nn.Module):
    # Checkpoint projections stored inside a merged parameter: name -> (merged name, part).
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, tp: TensorParallel, backend: AttentionBackend,
                 max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        """Weights come from `quant_config`'s methods (None: dense)."""
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config, tp, backend, max_positions, quant_config, "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, quant_config,
                                      "lm_head")
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = self.model.facts.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, identical on every rank; with
        final_logit_softcapping c, c * tanh(logits / c)."""
        logits = self.lm_head.compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def kv_cache_spec(self) -> KVCacheSpec:
        """One (key, value) pair per decoder layer, each with its window (0: global)."""
        layers = self.model.layers
        attn = layers[0].self_attn
        return KVCacheSpec(len(layers), attn.num_kv_heads, attn.head_dim,
                           attn.qkv_proj.cache_dtype,
                           tuple(layer.self_attn.sliding_window for layer in layers))
