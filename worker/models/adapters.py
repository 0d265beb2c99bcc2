"""Per-architecture readings of config.json: what an architecture fixes beyond the generic
fields, and the values its model does not implement."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from worker.models.config import ModelConfig, MoEConfig, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class ConfigAdapter:
    """A Llama-family architecture's facts, read into a `ModelConfig` by `model_config`."""

    model_type: str  # config.json's model_type: names the architecture without `architectures`
    qkv_bias: bool = False  # q/k/v projections always carry a bias, whatever attention_bias says
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE
    sliding_window: bool = False  # use_sliding_window's default

    def check(self, hf: dict[str, Any]) -> None:
        """UnsupportedModelError for a value the Llama decoder does not implement."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} (only 'silu')")
        window = hf.get("sliding_window")
        uses_window = hf.get("use_sliding_window", self.sliding_window)
        if window is not None and uses_window and window < hf.get("max_position_embeddings", 0):
            raise UnsupportedModelError(
                f"unsupported sliding_window={window} (shorter than max_position_embeddings); "
                "sliding-window attention is not implemented")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("unsupported mlp_bias=true")

    def model_config(self, architecture: str, hf: dict[str, Any]) -> ModelConfig:
        self.check(hf)
        return ModelConfig.from_dict(
            hf, architecture, attention_bias=self.qkv_bias or bool(hf.get("attention_bias")),
            qk_norm=self.qk_norm)


LLAMA = ConfigAdapter("llama")
MISTRAL = ConfigAdapter("mistral", sliding_window=True)
QWEN2 = ConfigAdapter("qwen2", qkv_bias=True)
QWEN3 = ConfigAdapter("qwen3", qk_norm=True)


@dataclass(frozen=True, slots=True)
class Gemma3Facts:
    """What Gemma 3 adds to the generic fields: which layers attend through a sliding window,
    each kind's RoPE, the attention scale, and the final logits' soft cap. Read from either
    config layout (transformers 5's `rope_parameters` per layer type, or the older
    `rope_theta` / `rope_local_base_freq` / `rope_scaling` of the global layers)."""

    sliding: tuple[bool, ...]  # per layer: a sliding-window (local) layer
    sliding_window: int
    local_rope_theta: float
    global_rope_theta: float
    global_rope_scaling: dict[str, Any] | None
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None

    @staticmethod
    def read(hf: dict[str, Any]) -> Gemma3Facts:
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:
            pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(layers)]
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(f"unsupported layer_types {types!r}")
        params = hf.get("rope_parameters") or {}
        local = params.get("sliding_attention") or {}
        full = params.get("full_attention") or hf.get("rope_scaling") or {}
        scaling = {**full, "rope_type": full.get("rope_type", full.get("type", "default"))}
        if scaling["rope_type"] not in ("default", "linear"):
            raise UnsupportedModelError(f"unsupported rope type {scaling['rope_type']!r} "
                                        "for Gemma 3's global layers")
        return Gemma3Facts(
            sliding=tuple(t == "sliding_attention" for t in types),
            sliding_window=int(hf.get("sliding_window") or 4096),
            local_rope_theta=float(local.get("rope_theta") or hf.get("rope_local_base_freq")
                                   or 10000.0),
            global_rope_theta=float(full.get("rope_theta") or hf.get("rope_theta") or 1e6),
            global_rope_scaling=None if scaling["rope_type"] == "default" else scaling,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=hf.get("final_logit_softcapping"))


@dataclass(frozen=True, slots=True)
class Gemma3Adapter:
    """Gemma 3 text models (`Gemma3ForCausalLM`): Gemma3TextConfig's defaults where a
    config.json leaves a field out (save_pretrained writes only what differs from them)."""

    model_type: str = "gemma3_text"
    defaults: tuple[tuple[str, Any], ...] = (
        ("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
        ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
        ("head_dim", 256), ("max_position_embeddings", 131072), ("rms_norm_eps", 1e-6),
        ("tie_word_embeddings", True), ("eos_token_id", 1))

    def model_config(self, architecture: str, hf: dict[str, Any]) -> ModelConfig:
        hf = {**dict(self.defaults), **hf}
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"unsupported hidden_activation {act!r} "
                                        "(only gelu_pytorch_tanh)")
        if hf.get("attn_logit_softcapping"):
            raise UnsupportedModelError("unsupported attn_logit_softcapping (attention scores "
                                        "soft-capping is not implemented)")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("unsupported use_bidirectional_attention=true")
        if hf.get("attention_bias"):
            raise UnsupportedModelError("unsupported attention_bias=true for Gemma 3")
        Gemma3Facts.read(hf)  # refuses what the model does not implement
        return ModelConfig.from_dict(hf, architecture, attention_bias=False, qk_norm=True)


GEMMA3 = Gemma3Adapter()


@dataclass(frozen=True, slots=True)
class MoEAdapter(ConfigAdapter):
    """A mixture-of-experts architecture: the Llama-family attention its base fields say, and
    the experts' fields under this architecture's names."""

    expert_size_key: str = "moe_intermediate_size"  # Mixtral: intermediate_size
    norm_topk_prob: bool | None = None  # fixed by the architecture (Mixtral), else config's
    shared_expert: bool = False  # Qwen2-MoE: a shared expert with a sigmoid gate

    def model_config(self, architecture: str, hf: dict[str, Any]) -> ModelConfig:
        config = ConfigAdapter.model_config(self, architecture, hf)
        return dataclasses.replace(config, moe=self.moe_config(hf))

    def moe_config(self, hf: dict[str, Any]) -> MoEConfig:
        # Mixtral's name, and what transformers 5 writes for Qwen3-MoE too
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        top_k = int(hf["num_experts_per_tok"])
        if experts and not 0 < top_k <= experts:
            raise UnsupportedModelError(f"num_experts_per_tok={top_k} with {experts} experts")
        norm = self.norm_topk_prob
        return MoEConfig(
            num_experts=experts, top_k=top_k, intermediate_size=int(hf[self.expert_size_key]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if norm is None else norm,
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
            if self.shared_expert else 0,
            sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))


QWEN3_MOE = MoEAdapter("qwen3_moe", qk_norm=True)
QWEN2_MOE = MoEAdapter("qwen2_moe", qkv_bias=True, shared_expert=True)
MIXTRAL = MoEAdapter("mixtral", sliding_window=True, expert_size_key="intermediate_size",
                     norm_topk_prob=True)
