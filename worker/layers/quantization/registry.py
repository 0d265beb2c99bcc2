"""Quantization configs by name, the `quant_method` of a checkpoint's `quantization_config`
("none" for dense checkpoints)."""
from __future__ import annotations

from worker.layers.quantization.base import QuantizationConfig
from worker.layers.quantization.unquantized import UnquantizedConfig

QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {
    "none": UnquantizedConfig,
}


def get_quantization_config(name: str) -> QuantizationConfig:
    if name not in QUANTIZATION_CONFIGS:
        raise ValueError(f"unknown quantization {name!r}; known: "
                         f"{', '.join(QUANTIZATION_CONFIGS)}")
    return QUANTIZATION_CONFIGS[name]()
