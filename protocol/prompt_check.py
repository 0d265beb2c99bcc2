"""Whether a prompt can ever run on an engine: the one check the front-end and the engine core
both apply (the front-end so a bad prompt fails alone, before anything is sent; the engine
core because any client may send anything)."""
from __future__ import annotations

from collections.abc import Sequence


def check_prompt(token_ids: Sequence[int], max_model_len: int, num_usable_blocks: int,
                 block_size: int, vocab_size: int | None = None,
                 max_kv_tokens: int = 0, *, needs_output: bool = True) -> None:
    """Raise ValueError if the prompt is empty, leaves no room for output (unless it needs
    none: a pooling prompt may fill max_model_len), needs more KV blocks than the whole cache
    holds, or names a token outside the vocabulary. `max_kv_tokens`: the longest sequence the
    whole cache holds, where its layer groups differ (sliding windows); 0: `num_usable_blocks`
    blocks of `block_size` tokens."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if not needs_output and n > max_model_len:
        raise ValueError(f"the prompt has {n} tokens, more than max_model_len="
                         f"{max_model_len}")
    if needs_output and n >= max_model_len:
        raise ValueError(f"the prompt has {n} tokens, which leaves no room for output "
                         f"within max_model_len={max_model_len}")
    blocks = -(-n // block_size)
    if max_kv_tokens and n > max_kv_tokens:
        raise ValueError(f"the prompt has {n} tokens, but the whole KV cache holds at most "
                         f"{max_kv_tokens} tokens of one sequence ({num_usable_blocks} blocks "
                         "shared by its layer groups)")
    if not max_kv_tokens and blocks > num_usable_blocks:
        raise ValueError(f"the prompt has {n} tokens and needs {blocks} KV blocks, but the "
                         f"whole KV cache has {num_usable_blocks} "
                         f"({num_usable_blocks * block_size} tokens)")
    low, high = min(token_ids), max(token_ids)
    if low < 0:
        raise ValueError(f"prompt token id {low} is negative")
    if vocab_size and high >= vocab_size:
        raise ValueError(f"prompt token id {high} is outside the vocabulary (size {vocab_size})")
