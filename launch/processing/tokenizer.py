"""The model directory's Hugging Face tokenizer, and the tokens that end generation."""
from __future__ import annotations

import json
import os
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Tokenizer classes that are exactly `tokenizer.json` run by the `tokenizers` library.
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


class JsonTokenizer:
    """A generic `tokenizer.json` through the `tokenizers` library, as Hugging Face's
    `PreTrainedTokenizerFast` runs it, without importing transformers (and torch): the
    front-end then starts in a fraction of the time."""

    def __init__(self, model_dir: str, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer
        self._tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self._tokenizer.token_to_id(eos) if eos else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True,
                     ) -> list[list[int]]:
        """`encode` of each text, in one call (the library encodes them on its threads)."""
        if self._tokenizer.padding is not None:  # a batch would be padded to its longest
            return [self.encode(text, add_special_tokens) for text in texts]
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)


def load_tokenizer(model_dir: str) -> Any | None:
    """The directory's tokenizer (`AutoTokenizer`, or `JsonTokenizer` when that is all it
    is), or None when it ships none (token-id prompts still work then)."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return None
    config = read_json(os.path.join(model_dir, "tokenizer_config.json"))
    if (os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
            and config.get("tokenizer_class") in _GENERIC_CLASSES
            and not config.get("clean_up_tokenization_spaces")):
        return JsonTokenizer(model_dir, config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def max_token_chars(tokenizer: Any | None) -> int:
    """The longest vocabulary entry, in characters: a bound on the text one token stands for
    (byte-level BPE and SentencePiece entries spell at least as many characters as they decode
    to). 1 without a tokenizer (token-id prompts only)."""
    if tokenizer is None:
        return 1
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def stop_token_ids_of(model_dir: str, tokenizer: Any | None) -> list[int]:
    """[EOS, other end-of-generation ids...]: the tokenizer's EOS first, then any others the
    generation config names (vLLM treats those as extra stop tokens)."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        eos = read_json(os.path.join(model_dir, name)).get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def read_json(path: str) -> dict[str, Any]:
    """A model directory's JSON file, or {} when it has none."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def encode_many(tokenizer: Any, texts: list[str], add_special_tokens: bool = True,
                ) -> list[list[int]]:
    """Each text's ids as `tokenizer.encode` gives them; one batch call where it has one."""
    if isinstance(tokenizer, JsonTokenizer) and len(texts) > 1:
        return tokenizer.encode_batch(texts, add_special_tokens)
    return [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]
