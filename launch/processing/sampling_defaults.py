"""Request defaults from a model's `generation_config.json`, as vLLM applies them
(`--generation-config auto|vllm|DIR`).

`auto` reads the model directory's file, `DIR` another directory's, `vllm` none. Of the file,
only the sampling fields vLLM takes count (`repetition_penalty`, `temperature`, `top_k`,
`top_p`, `min_p`, and `max_new_tokens` as `max_tokens`); they become the defaults of every
request that does not set them: the server's fields left out of a body, `LLM.generate` /
`AsyncLLM.generate` called without SamplingParams, `deltaserve generate` flags not given. A
request's own values always win. Named models carry their card's recommended values in the
file (launch/model_cache/cache.py).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from protocol import SamplingParams

logger = logging.getLogger("deltaserve")

FILE = "generation_config.json"
FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
          "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(model_dir: str, generation_config: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields the generation config sets (empty for `vllm` or no file);
    ValueError for a DIR without the file or a file that is not a JSON object, or values
    SamplingParams refuses."""
    if generation_config == "vllm":
        return {}
    directory = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        if generation_config == "auto":
            return {}
        raise ValueError(f"--generation-config {generation_config!r}: no {FILE} there")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    defaults = {ours: config[theirs] for theirs, ours in FIELDS.items()
                if config.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its sampling defaults are not valid: {e}") from None
    if defaults:
        logger.info("sampling defaults from %s: %s (a request's own values win; "
                    "--generation-config vllm ignores them)", path,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
