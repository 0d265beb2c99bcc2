"""Request bodies of the pooling routes (OpenAI's /v1/embeddings; vLLM's /pooling,
/classify, /score and /rerank, the latter in Jina's and Cohere's shape), and how results are
encoded. Pooling fields are passed through untyped to `PoolingParams`, so a bad value gets
the same message through the server as through `LLM`."""
from __future__ import annotations

import base64
import sys
from typing import Any

import msgspec
import numpy as np

from launch.entrypoints.openai.errors import APIError
from launch.entrypoints.openai.protocol import ChatMessage, completion_prompts
from protocol import PoolingParams

EMBED_DTYPES = ("float32", "float16", "bfloat16")
ENDIANNESS = ("native", "little", "big")


class _PoolingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Any = None
    truncation_side: str | None = None
    priority: int = 0
    use_activation: Any = None
    normalize: Any = None  # use_activation's older vLLM name

    def pooling_params(self, task: str | None = None, dimensions: Any = None) -> PoolingParams:
        activation = self.use_activation if self.use_activation is not None else self.normalize
        try:
            return PoolingParams(task=task, dimensions=dimensions, use_activation=activation)
        except (ValueError, TypeError) as e:
            raise APIError.bad_request(str(e)) from None


class _Encoded(_PoolingFields, kw_only=True):
    input: Any = None
    add_special_tokens: bool = True
    encoding_format: str = "float"
    embed_dtype: str = "float32"
    endianness: str = "native"

    def prompts(self) -> list[str | dict[str, Any]]:
        try:
            return completion_prompts(self.input)
        except APIError as e:
            raise APIError(400, e.message.replace("prompt", "input"), "input") from None

    def check_encoding(self) -> None:
        if self.encoding_format not in ("float", "base64"):
            raise APIError(400, f"encoding_format must be 'float' or 'base64', got "
                           f"{self.encoding_format!r}", "encoding_format")
        if self.embed_dtype not in EMBED_DTYPES:
            raise APIError(400, f"embed_dtype must be one of {', '.join(EMBED_DTYPES)}, got "
                           f"{self.embed_dtype!r}", "embed_dtype")
        if self.endianness not in ENDIANNESS:
            raise APIError(400, f"endianness must be one of {', '.join(ENDIANNESS)}, got "
                           f"{self.endianness!r}", "endianness")

    def encode(self, data: np.ndarray) -> list | str:
        """A result as JSON floats, or base64 of its bytes (OpenAI: float32, native order)."""
        if self.encoding_format == "float":
            return data.tolist()
        return base64.b64encode(to_bytes(data, self.embed_dtype, self.endianness)).decode()


class _Chat(_Encoded, kw_only=True):
    """vLLM's chat-style input: `messages` rendered with the model's chat template (no
    generation prompt unless asked; the template's special tokens, none added)."""

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False

    def check_input(self) -> None:
        if (self.messages is None) == (self.input is None):
            raise APIError(400, "give either input or messages", "input")


class EmbeddingRequest(_Chat, kw_only=True):
    dimensions: Any = None


class PoolingRequest(_Chat, kw_only=True):
    task: str | None = None
    dimensions: Any = None


class ClassificationRequest(_PoolingFields, kw_only=True):
    input: Any = None
    add_special_tokens: bool = True


class ScoreRequest(_PoolingFields, kw_only=True):
    """vLLM's /score: `text_1` and `text_2` (also as `queries`/`documents` or
    `data_1`/`data_2`)."""

    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    data_1: Any = None
    data_2: Any = None

    def pair(self) -> tuple[Any, Any]:
        for first, second in ((self.text_1, self.text_2), (self.queries, self.documents),
                              (self.data_1, self.data_2)):
            if first is not None or second is not None:
                if first is None or second is None:
                    raise APIError(400, "give both sides: text_1 and text_2 (or queries and "
                                   "documents)", "text_1" if first is None else "text_2")
                return first, second
        raise APIError(400, "text_1 and text_2 are required", "text_1")


class RerankRequest(_PoolingFields, kw_only=True):
    """Jina's and Cohere's rerank: a query, documents (strings or {"text": ...}), `top_n`
    (0 or absent: all), `return_documents` (default true, as vLLM answers)."""

    query: Any = None
    documents: Any = None
    top_n: int | None = None
    return_documents: bool = True

    def texts(self) -> tuple[str, list[str]]:
        if not isinstance(self.query, str):
            raise APIError(400, "query must be a string", "query")
        docs = self.documents
        if not isinstance(docs, list) or not docs:
            raise APIError(400, "documents must be a non-empty list", "documents")
        texts = [d if isinstance(d, str) else d.get("text") if isinstance(d, dict) else None
                 for d in docs]
        if not all(isinstance(t, str) for t in texts):
            raise APIError(400, "documents must be strings or objects with a text string",
                           "documents")
        if self.top_n is not None and self.top_n < 0:
            raise APIError(400, f"top_n must be non-negative, got {self.top_n}", "top_n")
        return self.query, texts


def to_bytes(data: np.ndarray, dtype: str, endianness: str) -> bytes:
    """`data` (float32) as `dtype`'s bytes in the given order (bfloat16: float32's upper
    half, rounded to nearest even)."""
    order = sys.byteorder if endianness == "native" else endianness
    prefix = "<" if order == "little" else ">"
    data = np.ascontiguousarray(data, np.float32)
    if dtype == "bfloat16":
        bits = data.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.astype(prefix + "u2").tobytes()
    return data.astype(prefix + ("f2" if dtype == "float16" else "f4")).tobytes()
