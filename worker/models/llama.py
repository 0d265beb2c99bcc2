"""The Llama decoder family: Llama, Mistral (no sliding window), Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm). Tensor parallelism lives in the layers; shapes are per rank."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.attention.backend import AttentionBackend
from worker.attention.kv_cache_spec import KVCache, KVCacheSpec
from worker.attention.metadata import AttentionMetadata
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.activation import silu_and_mul
from worker.layers.layernorm import RMSNorm
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.quantization.base import QuantizationConfig
from worker.layers.rotary_embedding import RotaryEmbedding
from worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from worker.models.config import ModelConfig
from worker.models.native_layer_loop import NativeLayerLoop
from worker.models.native_layer_table import LayerNorms


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads, tp,
            config.attention_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, tp,
            shard=(self.qkv_proj.q_start * d, self.qkv_proj.num_heads * d),
            quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim, self.scale, self.backend = d, d ** -0.5, backend
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, rotary: RotaryEmbedding,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """[num_tokens, hidden] (with `rows`: only those token rows are projected out)."""
        n, d = hidden.shape[0], self.head_dim
        q, k, v = self.qkv_proj(hidden).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm.heads_(q), self.k_norm.heads_(k)
        q, k = rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        out = out.reshape(n, self.num_heads * d)
        return self.o_proj(out if rows is None else out[rows])


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `intermediate_size` defaults to the config's. Without
    `reduce_results`, a rank returns its partial sum (a MoE block's shared expert)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel,
                 quant_config: QuantizationConfig | None, prefix: str,
                 intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], tp, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj",
                                           reduce_results=reduce_results)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.down_proj.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


# Builds layer `index`'s MLP: (config, tp, quant_config, index, prefix) -> module with
# `compute_dtype`, mapping [tokens, hidden] in that dtype to the same (reduced across ranks).
MLPFactory = Callable[[ModelConfig, TensorParallel, QuantizationConfig | None, int, str],
                      nn.Module]


def llama_mlp(config: ModelConfig, tp: TensorParallel, quant_config: QuantizationConfig | None,
              index: int, prefix: str) -> nn.Module:
    return LlamaMLP(config, tp, quant_config, prefix)


class LlamaDecoderLayer(nn.Module):
    """The residual stream is float32 whatever the compute dtype (a bfloat16 stream loses
    most of a bf16 model's precision over its layers); each sublayer runs in `dtype`, the
    linear weights' dtype, and its output is added to the stream in float32.

    A layer adds its sublayers' outputs lazily (vLLM's fused_add_rms_norm pattern): each norm
    first adds the previous sublayer's output to the stream, so the layer returns its MLP
    output for the next layer's (or the final) norm to add."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, backend: AttentionBackend,
                 quant_config: QuantizationConfig | None, prefix: str,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, backend, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp or LlamaMLP(config, tp, quant_config, f"{prefix}.mlp")

    @property
    def dtype(self) -> torch.dtype:
        return self.mlp.compute_dtype

    def native_norms(self) -> LayerNorms:
        attn = self.self_attn
        return LayerNorms(self.input_layernorm, self.post_attention_layernorm,
                          getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))

    def forward(self, positions: torch.Tensor, pending: torch.Tensor | None,
                residual: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                rotary: RotaryEmbedding) -> torch.Tensor:
        """residual: [num_tokens, hidden_size] float32, updated in place; pending: the
        previous layer's output in the compute dtype, not yet added to it (None for the
        first layer). Returns this layer's pending MLP output."""
        attn = self._attend(positions, pending, residual, kv_cache, metadata, rotary)
        return self.mlp(self.post_attention_layernorm.add_and_norm(attn, residual, self.dtype))

    def forward_rows(self, positions: torch.Tensor, pending: torch.Tensor | None,
                     residual: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                     rotary: RotaryEmbedding, rows: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for the model's last layer when only token `rows` ([n] indices) are read
        after it: attention runs over every token (all KV is written), the rest on those rows.
        Returns (pending MLP output, residual), both [n, hidden_size]."""
        attn = self._attend(positions, pending, residual, kv_cache, metadata, rotary, rows)
        residual = residual[rows]
        dtype = self.dtype
        return self.mlp(self.post_attention_layernorm.add_and_norm(attn, residual, dtype)), residual

    def _attend(self, positions: torch.Tensor, pending: torch.Tensor | None,
                residual: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata,
                rotary: RotaryEmbedding, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The pending output added to `residual` (in place), normed, and attended (every
        token's attention output, or with `rows` those rows')."""
        dtype = self.dtype
        if pending is None:
            hidden = self.input_layernorm(residual, dtype)
        else:
            hidden = self.input_layernorm.add_and_norm(pending, residual, dtype)
        return self.self_attn(positions, hidden, kv_cache, metadata, rotary, rows)


class LlamaModel(nn.Module):
    activation = "silu"

    def __init__(self, config: ModelConfig, tp: TensorParallel, backend: AttentionBackend,
                 max_positions: int, quant_config: QuantizationConfig | None,
                 prefix: str, make_mlp: MLPFactory = llama_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   quant_config, f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, backend, quant_config, f"{prefix}.layers.{i}",
                              make_mlp(config, tp, quant_config, i, f"{prefix}.layers.{i}.mlp"))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                          config.rope_scaling)
        # Made on the first forward (the weights are final by then); False: not taken.
        self.native_loop: NativeLayerLoop | None | bool = None

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        return self.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> [num_tokens, hidden_size] in the compute dtype (the LM head's); with `out_rows`
        ([n] token row indices), only those rows, [n, hidden_size] (a pooling model reading
        one row per prompt skips the rest of the last layer's work after attention)."""
        embeds = self.embed_tokens(input_ids)  # [num_tokens, hidden_size], compute dtype
        # The float32 stream, updated in place by the layers (a fresh tensor: the embedding
        # lookup's output, or its float32 copy).
        residual = embeds.float()
        if self.native_loop is None:
            self.native_loop = NativeLayerLoop.build(self) or False
        if self.native_loop and self.native_loop.takes(residual.shape[0], kv_caches):
            pending = self.native_loop(positions, residual, metadata)
            if out_rows is not None and pending is not None:
                pending, residual = pending[out_rows], residual[out_rows]
        else:
            pending, residual = self._run_layers(positions, residual, kv_caches, metadata,
                                                 out_rows)
        if pending is None:  # no layers
            out = self.norm(residual, embeds.dtype)
            return out if out_rows is None else out[out_rows]
        return self.norm.add_and_norm(pending, residual, embeds.dtype)

    def _run_layers(self, positions: torch.Tensor, residual: torch.Tensor,
                    kv_caches: list[KVCache], metadata: AttentionMetadata,
                    out_rows: torch.Tensor | None,
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the last layer's pending output, the residual stream): every token's, or with
        `out_rows` those rows' only."""
        pending = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i == last and out_rows is not None:
                return layer.forward_rows(positions, pending, residual, kv_cache, metadata,
                                          self.rotary_emb, out_rows)
            pending = layer(positions, pending, residual, kv_cache, metadata, self.rotary_emb)
        return pending, residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections stored inside a merged parameter: name -> (merged name, part).
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}
    # Checkpoint name substrings replaced before anything else (an architecture whose
    # checkpoints name a module differently from the modules here).
    checkpoint_renames: dict[str, str] = {}
    # Each decoder layer's MLP (a MoE architecture makes some of them sparse).
    make_mlp: MLPFactory = staticmethod(llama_mlp)

    def __init__(self, config: ModelConfig, tp: TensorParallel, backend: AttentionBackend,
                 max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        """Weights come from `quant_config`'s methods (None: dense)."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp, backend, max_positions, quant_config, "model",
                                self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, quant_config,
                                      "lm_head")
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, identical on every rank."""
        return self.lm_head.compute_logits(hidden)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One (key, value) pair per decoder layer, in the QKV projection's cache dtype (the
        compute dtype, or bfloat16 where bf16 linears multiply in float32)."""
        layers = self.model.layers
        attn = layers[0].self_attn
        return KVCacheSpec(len(layers), attn.num_kv_heads, attn.head_dim,
                           attn.qkv_proj.cache_dtype)
