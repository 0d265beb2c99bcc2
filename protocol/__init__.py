"""The contract between deltaserve's processes: wire messages and their codecs (no torch)."""
from protocol.codec import HEADER, PROTOCOL_VERSION, Channel, Codec, ProtocolError, to_builtins
from protocol.engine_config import EngineConfig
from protocol.engine_messages import (AbortRequests, AddRequest, AddRequests, CoreToFrontend,
                                      EngineCoreOutput,
                                      EngineCoreOutputs, EngineFailed, EngineReady, FinishReason,
                                      FrontendToCore, SchedulerStats, ShutdownEngine)
from protocol.int_column import IntColumn
from protocol.model_runner_output import ModelRunnerOutput, SampleLogprobs
from protocol.sampling_params import SamplingParams
from protocol.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput, TokenCounts
from protocol.worker_messages import (CoreToWorker, WorkerConfig, WorkerError, WorkerHello,
                                      WorkerInit, WorkerReady, WorkerShutdown, WorkerToCore)

__all__ = [
    "HEADER", "PROTOCOL_VERSION", "Channel", "Codec", "ProtocolError", "IntColumn",
    "EngineConfig", "AbortRequests", "AddRequest", "AddRequests", "CoreToFrontend", "EngineCoreOutput", "EngineCoreOutputs",
    "EngineFailed", "EngineReady", "FinishReason", "FrontendToCore", "SchedulerStats",
    "ShutdownEngine", "ModelRunnerOutput", "SampleLogprobs", "SamplingParams",
    "CachedRequestData", "NewRequestData", "SchedulerOutput", "TokenCounts", "to_builtins",
    "CoreToWorker", "WorkerConfig",
    "WorkerError", "WorkerHello", "WorkerInit", "WorkerReady", "WorkerShutdown", "WorkerToCore",
]
