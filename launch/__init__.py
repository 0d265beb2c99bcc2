"""The processes a user starts: the offline `LLM`, the online `AsyncLLM` (and the server on
it), and the `deltaserve` CLI."""
from launch.async_llm import AsyncLLM
from launch.errors import EngineDeadError
from launch.llm import LLM
from launch.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from launch.pooling_outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)
from protocol import PoolerConfig, PoolingParams, SamplingParams, StructuredOutputsParams
from protocol.lora import LoRARequest

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "EngineDeadError",
           "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind", "LoRARequest",
           "PoolingParams", "PoolerConfig", "PoolingRequestOutput", "PoolingOutput",
           "EmbeddingOutput", "ClassificationOutput", "ScoringOutput"]
