"""The model's tokenizer as llguidance needs it: every token's bytes, for computing masks."""
from __future__ import annotations

import os
from typing import Any


def load(model_dir: str | None, vocab_size: int | None, eos_token_id: int | None) -> Any:
    """An `llguidance.LLTokenizer` over the model's vocabulary (`vocab_size` tokens: ids the
    tokenizer lacks are never allowed). From `tokenizer.json` through the `tokenizers`
    library when the directory has one (no transformers import), else through transformers'
    fast tokenizer. `eos_token_id` is the token llguidance allows where the grammar ends."""
    import llguidance
    if model_dir is None:
        raise ValueError("the engine core has no model directory to read a tokenizer from")
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer
        return llguidance.LLTokenizer(Tokenizer.from_file(path).to_str(), n_vocab=vocab_size,
                                      eos_token=eos_token_id)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import llguidance.hf
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
