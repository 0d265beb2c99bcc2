"""A PEFT adapter's `adapter_config.json`: rank, scaling and what LoRA features it uses.

Per module, PEFT scales the delta by `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA,
arXiv:2312.03732); `rank_pattern` and `alpha_pattern` override `r` and `lora_alpha` for the
modules whose name ends with a key at a "." boundary (PEFT's rule; the first match wins).
Features that change what an adapter computes and that deltaserve does not implement are
refused by name, never ignored.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

MAX_PATTERN = 200
_NESTED = re.compile(r"\)[*+?{]")  # a quantified group: the backtracking that can explode


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the reason."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at the given path."""


@dataclass(frozen=True)
class PeftConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    @staticmethod
    def parse(config: Any, name: str) -> PeftConfig:
        """`config` (adapter_config.json as parsed) checked; LoRAAdapterError naming the
        adapter `name` and every unsupported feature it uses."""
        if not isinstance(config, dict):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: adapter_config.json is not an "
                                   "object")
        problems = _unsupported(config)
        if problems:
            raise LoRAAdapterError(f"LoRA adapter {name!r} cannot be served: "
                                   + "; ".join(problems))
        r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if not _positive_int(r):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got "
                                   f"{r!r}")
        if not _number(alpha):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got "
                                   f"{alpha!r}")
        ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        for key in (*ranks, *alphas) if isinstance(ranks, dict) and isinstance(alphas, dict) \
                else ():
            _check_pattern(key, name)
        if not isinstance(ranks, dict) or not all(_positive_int(v) for v in ranks.values()):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: rank_pattern must map module "
                                   "patterns to positive integers")
        if not isinstance(alphas, dict) or not all(_number(v) for v in alphas.values()):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: alpha_pattern must map module "
                                   "patterns to numbers")
        base = config.get("base_model_name_or_path")
        return PeftConfig(r, float(alpha), bool(config.get("use_rslora", False)), dict(ranks),
                          {k: float(v) for k, v in alphas.items()},
                          base if isinstance(base, str) else None)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """(rank, scaling) PEFT uses for `module` (its name without `base_model.model.`)."""
        rank = _match(self.rank_pattern, module)
        alpha = _match(self.alpha_pattern, module)
        rank = self.r if rank is None else rank
        alpha = self.lora_alpha if alpha is None else alpha
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _unsupported(config: dict[str, Any]) -> list[str]:
    problems = []
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        problems.append(f"peft_type {peft_type!r} is not LoRA")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("adapter biases (bias, lora_bias) are not supported")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']!r} would replace whole "
                        "modules, which is not supported")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out (transposed Conv1D weights) is not supported")
    if config.get("layer_replication"):
        problems.append("layer_replication is not supported")
    if config.get("alora_invocation_tokens"):
        problems.append("activated LoRA (alora_invocation_tokens) is not supported")
    if config.get("use_qalora"):
        problems.append("QALoRA is not supported")
    if config.get("target_parameters"):
        problems.append("target_parameters (LoRA on expert parameters) is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal",
                                                      "mica", "lora_ga"):
        problems.append(f"init_lora_weights {init!r} changes the base weights when PEFT "
                        "loads it; convert the adapter to a plain LoRA first")
    return problems


def _check_pattern(key: Any, name: str) -> None:
    """A rank/alpha pattern key is a regular expression (PEFT's rule); one that could take
    exponential time (a quantified group) or is long is refused, as is one that does not
    compile."""
    if not isinstance(key, str) or len(key) > MAX_PATTERN or _NESTED.search(key):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: pattern {str(key)[:80]!r} is not "
                               f"accepted (at most {MAX_PATTERN} characters, no quantified "
                               "groups)")
    try:
        re.compile(key)
    except re.error as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: pattern {key!r}: {e}") from None


def _match(pattern: dict[str, Any], module: str) -> Any:
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _positive_int(value: Any) -> bool:
    return type(value) is int and value > 0


def _number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
