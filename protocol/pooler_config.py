"""Pooling models: vLLM's `--runner`, `--convert` and `--pooler-config`, resolved once against
the model directory (config.json, and sentence-transformers' modules.json where present), so
that every process reads the same resolved options from `EngineConfig`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from protocol.json_option import parse_json_option

PoolingType = Literal["LAST", "MEAN", "CLS", "ALL"]
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# Architecture suffixes that say what a checkpoint is (vLLM's defaults, in its order).
_GENERATE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
_CLASSIFY_SUFFIXES = ("ForSequenceClassification",)
_EMBED_SUFFIXES = ("EmbeddingModel", "Model")
# sentence-transformers modules a directory may list (modules.json): the model itself, its
# pooling and normalization. Others (Dense projections, ...) change the vectors: refused.
_ST_MODULES = ("models.Transformer", "models.Pooling", "models.Normalize")


class PoolerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How a pooling model pools: `pooling_type` LAST (the last prompt token's hidden state,
    decoders' default), MEAN (the average over the prompt), CLS (the first token) or ALL
    (every token); `use_activation` (vLLM's name; `normalize`, its older one, is taken
    too) L2-normalizes embeddings or applies the classifier's softmax/sigmoid; `dimensions`
    is the embedding size requests get unless they ask otherwise (Matryoshka models)."""

    pooling_type: str | None = None
    use_activation: bool | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if (self.use_activation is not None and self.normalize is not None
                and self.use_activation != self.normalize):
            raise ValueError("pooler_config: normalize and use_activation disagree (they are "
                             "one switch: normalize is its older name)")
        if self.dimensions is not None and (type(self.dimensions) is not int
                                            or self.dimensions < 1):
            raise ValueError(f"pooler_config: dimensions must be at least 1, got "
                             f"{self.dimensions!r}")

    @property
    def seq_pooling(self) -> str:
        return (self.pooling_type or "LAST").upper()

    @property
    def activation(self) -> bool:
        """The default of requests that do not say (vLLM: on)."""
        value = self.use_activation if self.use_activation is not None else self.normalize
        return value is not False

    @property
    def needs_every_position(self) -> bool:
        """Whether a request's result depends on every prompt position's hidden state (then
        prefix-cache hits cannot be used: their positions are not recomputed)."""
        return self.seq_pooling != "LAST"

    @staticmethod
    def parse(value: Any) -> PoolerConfig:
        return parse_json_option(value, PoolerConfig, "pooler_config")


@dataclass(frozen=True)
class RunnerChoice:
    runner: str  # "generate" or "pooling"
    convert: str  # "none", "embed" or "classify"
    pooler_config: PoolerConfig | None


def resolve_runner(model_dir: str, runner: str, convert: str,
                   pooler_config: PoolerConfig | None) -> RunnerChoice:
    """vLLM's rules for `auto`: a `*ForSequenceClassification` checkpoint classifies, a
    `*Model` one (or a sentence-transformers directory) embeds, a `*ForCausalLM` generates
    unless `--convert` (or a `--pooler-config`) says otherwise. The pooler config: the user's fields, then
    sentence-transformers' pooling module, then the defaults (LAST, activation on)."""
    hf = read_model_config(model_dir)
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else ""
    st = sentence_transformers_pooling(model_dir)
    if runner == "auto":
        native = _native_task(arch)
        wants_pooling = convert not in ("auto", "none") or pooler_config is not None
        runner = "pooling" if wants_pooling or st or native else "generate"
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} needs --runner pooling (it makes a pooling "
                             f"model of {arch or 'the checkpoint'})")
        if pooler_config is not None:
            raise ValueError("--pooler-config needs --runner pooling")
        return RunnerChoice("generate", "none", None)
    if convert in ("auto", "none"):
        convert = _native_task(arch) or ("embed" if convert == "auto" else "none")
    if convert == "none":
        raise ValueError(f"--runner pooling with --convert none: {arch!r} is a generating "
                         "architecture; pass --convert embed or --convert classify")
    given = pooler_config or PoolerConfig()
    merged = PoolerConfig(
        pooling_type=(given.pooling_type or (st or {}).get("pooling_type") or "LAST").upper(),
        use_activation=(given.use_activation if given.use_activation is not None
                        else given.normalize if given.normalize is not None
                        else (st or {}).get("normalize", True) if convert == "embed"
                        else True),
        dimensions=given.dimensions)
    return RunnerChoice("pooling", convert, merged)


def _native_task(architecture: str) -> str | None:
    if architecture.endswith(_CLASSIFY_SUFFIXES):
        return "classify"
    if architecture.endswith(_GENERATE_SUFFIXES):
        return None
    if architecture.endswith(_EMBED_SUFFIXES):
        return "embed"
    return None


def read_model_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    with open(path) as f:
        return json.load(f)


def sentence_transformers_pooling(model_dir: str) -> dict[str, Any] | None:
    """What a sentence-transformers directory says about pooling (vLLM reads the same):
    its Pooling module's mode (`pooling_mode_lasttoken` -> LAST, `_mean_tokens` -> MEAN,
    `_cls_token` -> CLS) and whether a Normalize module follows. None without modules.json."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    types = [m.get("type", "") for m in modules if isinstance(m, dict)]
    unknown = [t for t in types if not t.endswith(_ST_MODULES)]
    if unknown:  # e.g. a Dense projection after pooling: refused, never silently skipped
        raise ValueError(f"sentence-transformers module(s) {', '.join(unknown)} in "
                         f"{os.path.join(model_dir, 'modules.json')} are not supported "
                         f"(supported: {', '.join(_ST_MODULES)})")
    result: dict[str, Any] = {"normalize": any(t.endswith("models.Normalize") for t in types)}
    pooling = next((m for m in modules if isinstance(m, dict)
                    and m.get("type", "").endswith("models.Pooling")), None)
    if pooling is not None:
        config = _read_json(os.path.join(model_dir, pooling.get("path", ""), "config.json"))
        mode = _pooling_mode(config if isinstance(config, dict) else {})
        if mode is not None:
            result["pooling_type"] = mode
    return result


def _pooling_mode(config: dict[str, Any]) -> str | None:
    names = [config["pooling_mode"]] if isinstance(config.get("pooling_mode"), str) else [
        key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    for name in names:
        name = name.removeprefix("pooling_mode_").split("_", 1)[0].lower()
        mode = "LAST" if "lasttoken" in name else name.upper()
        if mode in POOLING_TYPES:
            return mode
    return None


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
