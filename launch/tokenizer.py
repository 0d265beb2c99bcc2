"""The model directory's Hugging Face tokenizer, and the tokens that end generation."""
from __future__ import annotations

import json
import os
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: str) -> Any | None:
    """`AutoTokenizer` for the directory, or None when it ships no tokenizer (token-id
    prompts still work then)."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def stop_token_ids_of(model_dir: str, tokenizer: Any | None) -> list[int]:
    """[EOS, other end-of-generation ids...]: the tokenizer's EOS first, then any others the
    generation config names (vLLM treats those as extra stop tokens)."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            for token in eos if isinstance(eos, list) else [eos]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
    return ids
