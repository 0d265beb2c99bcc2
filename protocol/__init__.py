"""The contract between deltaserve's processes: wire messages and their codecs (no torch)."""
from protocol.codec import HEADER, PROTOCOL_VERSION, Channel, Codec, ProtocolError, to_builtins
from protocol.draft_tokens import DraftTokens
from protocol.engine_config import EngineConfig
from protocol.engine_messages import (
                                      AbortRequests,
                                      AddRequest,
                                      AddRequests,
                                      CoreToFrontend,
                                      EngineCoreOutput,
                                      EngineCoreOutputs,
                                      EngineFailed,
                                      EngineReady,
                                      FinishReason,
                                      FrontendToCore,
                                      GrammarError,
                                      GrammarsCompiled,
                                      SchedulerStats,
                                      ShutdownEngine,
                                      SpecDecodingStats,
)
from protocol.int_column import IntColumn
from protocol.model_runner_output import ModelRunnerOutput, SampleLogprobs
from protocol.pooler_config import PoolerConfig
from protocol.pooling_params import PoolingParams
from protocol.prompt_check import check_prompt
from protocol.sampling_params import SamplingParams
from protocol.scheduler_output import (
                                       CachedRequestData,
                                       GrammarBitmask,
                                       MaskedSchedulerOutput,
                                       NewRequestData,
                                       SchedulerOutput,
                                       SpecDecodeSchedulerOutput,
)
from protocol.speculative_config import SpeculativeConfig
from protocol.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from protocol.worker_messages import (
                                      CoreToWorker,
                                      WorkerError,
                                      WorkerHello,
                                      WorkerInit,
                                      WorkerPing,
                                      WorkerReady,
                                      WorkerShutdown,
                                      WorkerToCore,
)

__all__ = [
    "HEADER", "PROTOCOL_VERSION", "Channel", "Codec", "ProtocolError", "to_builtins",
    "EngineConfig", "AbortRequests", "AddRequest", "AddRequests", "CoreToFrontend",
    "EngineCoreOutput", "EngineCoreOutputs", "EngineFailed", "EngineReady", "FinishReason",
    "FrontendToCore", "GrammarError", "GrammarsCompiled", "SchedulerStats", "ShutdownEngine",
    "SpecDecodingStats", "DraftTokens", "IntColumn", "ModelRunnerOutput", "SampleLogprobs",
    "check_prompt", "PoolerConfig", "PoolingParams", "SamplingParams", "CachedRequestData",
    "GrammarBitmask",
    "MaskedSchedulerOutput", "NewRequestData", "SchedulerOutput", "SpecDecodeSchedulerOutput",
    "SpeculativeConfig", "StructuredOutputsError", "StructuredOutputsParams", "CoreToWorker",
    "WorkerError", "WorkerHello", "WorkerInit", "WorkerPing", "WorkerReady", "WorkerShutdown",
    "WorkerToCore",
]
