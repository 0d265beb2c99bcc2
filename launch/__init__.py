"""The processes a user starts: the offline `LLM` front-end and the `deltaserve` CLI."""
from launch.errors import EngineDeadError
from launch.llm import LLM
from launch.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from protocol import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineDeadError", "RequestOutput", "CompletionOutput",
           "Logprob"]
