"""Per-architecture readings of config.json: what an architecture fixes beyond the generic
fields, and the values its model does not implement."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.models.config import ModelConfig, UnsupportedModelError


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
