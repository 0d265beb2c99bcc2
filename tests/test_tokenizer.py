"""The front-end's tokenizer: the torch-free path must agree with Hugging Face's."""
from __future__ import annotations

import pytest
from model_utils import save_tiny_tokenizer
from transformers import AutoTokenizer

from launch.model_cache.cache import SHIPPED_MODEL
from launch.processing.detokenizer import IncrementalDetokenizer, find_stop_string
from launch.processing.tokenizer import JsonTokenizer, load_tokenizer, stop_token_ids_of

TEXTS = ["def fibonacci(n):\n    return n", "  leading spaces\tand tabs\n\n",
         "unicode: naïve café — 東京 🚀", "<|endoftext|>special inside<|endoftext|>", "", "x"]


@pytest.fixture(scope="module", params=["shipped", "tiny"])
def directory(request, tmp_path_factory):
    if request.param == "shipped":
        return SHIPPED_MODEL
    path = str(tmp_path_factory.mktemp("tok"))
    save_tiny_tokenizer(path)
    return path


def test_fast_path_agrees_with_auto_tokenizer(directory):
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert isinstance(ours, JsonTokenizer)
    assert ours.eos_token_id == theirs.eos_token_id and len(ours) == len(theirs)
    assert stop_token_ids_of(directory, ours) == stop_token_ids_of(directory, theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip)


def test_incremental_detokenizer_holds_back_partial_characters(directory):
    tokenizer = load_tokenizer(directory)
    text = "café 🚀 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, ids[:1], skip_special_tokens=True)
    pieces = [detok.add([t]) for t in ids[1:]] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids[1:], skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_find_stop_string():
    assert find_stop_string("hello world", 5, ["wor", "o"], False) == ("wor", 6)  # new text only
    assert find_stop_string("hello world", 3, ["wor"], True) == ("wor", 9)
    assert find_stop_string("hello world", 1, ["hello"], False) is None
