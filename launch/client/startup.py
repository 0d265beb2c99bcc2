"""Starting an engine for the front-end: resolve the model, spawn the engine core (which
starts the workers), load the tokenizer meanwhile, wait until the engine is ready."""
from __future__ import annotations

import os
from typing import Any

import msgspec

from common.worker_auth import read_secret_file
from engine_core.structured_output.grammar_validator import GrammarValidator
from launch.client.dp_client import DPEngineClient
from launch.client.engine_client import EngineClient
from launch.model_cache.cache import resolve_model
from launch.processing.input_processor import InputProcessor
from launch.processing.pooling import PoolingModelInfo
from launch.processing.sampling_defaults import load_sampling_defaults
from launch.processing.tokenizer import load_tokenizer, stop_token_ids_of
from protocol import EngineConfig
from worker.layers.quantization.registry import resolve_quantization
from worker.models.config import read_config_json


def start_engine(model: str, engine_args: dict[str, Any]
                 ) -> tuple[EngineClient | DPEngineClient, InputProcessor]:
    """The running engine for `model` and the engine options in `engine_args` (the fields of
    `EngineConfig`), and the input processor that validates requests against it. With
    `data_parallel_size` > 1, its replicas behind one client."""
    model = resolve_model(model)  # a name, a .gguf file, org/name: its directory
    if not os.path.isdir(model):
        raise ValueError(f"model must be a Hugging Face style directory, a .gguf file, a "
                         f"known name or a Hugging Face org/name, got {model!r}")
    config = with_draft_model(EngineConfig.create(model=os.path.abspath(model), **engine_args))
    config = config.with_runner()  # --runner/--convert auto resolved once, for every process
    _check_quantization(config)
    defaults = load_sampling_defaults(config.model, config.generation_config)
    if config.worker_secret_file is not None:
        read_secret_file(config.worker_secret_file)  # one clear line now, not in the engine
    # The processes start while we load the tokenizer.
    engine = EngineClient(config) if config.data_parallel_size == 1 else DPEngineClient(config)
    try:
        tokenizer = load_tokenizer(config.model)
        stop_token_ids = stop_token_ids_of(config.model, tokenizer)
        ready = engine.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    grammars = GrammarValidator.from_config(config, ready.vocab_size,
                                            stop_token_ids[0] if stop_token_ids else None)
    inputs = InputProcessor(tokenizer, stop_token_ids, ready, config.model,
                            config.max_logprobs, grammars, defaults)
    inputs.pooling = PoolingModelInfo.of(config)
    return engine, inputs


def with_draft_model(config: EngineConfig) -> EngineConfig:
    """`config` with its draft model (if any) resolved to a directory, like the target, and
    checked to share the target's vocabulary: a mismatch is refused here, before any process
    starts."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return config
    draft = resolve_model(spec.model)
    if not os.path.isfile(os.path.join(draft, "config.json")):
        raise ValueError(f"speculative_config: the draft model must be a Hugging Face style "
                         f"directory, got {spec.model!r}")
    draft = os.path.abspath(draft)
    sizes = [read_config_json(d).get("vocab_size")
             for d in (config.model, draft)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative_config: the draft model {spec.model!r} has a vocabulary "
                         f"of {sizes[1]} tokens, the target {sizes[0]}: they must share one")
    tokenizers = [load_tokenizer(d) for d in (config.model, draft)]
    if None not in tokenizers and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        raise ValueError(f"speculative_config: the draft model {spec.model!r} has another "
                         "tokenizer vocabulary than the target: they must share one")
    return msgspec.structs.replace(config, speculative_config=msgspec.structs.replace(
        spec, model=draft))


def _check_quantization(config: EngineConfig) -> None:
    """A --quantization the model cannot run with fails here, before any process starts."""
    hf = read_config_json(config.model)
    checkpoint = (hf.get("quantization_config") or {}).get("quant_method", "none")
    resolve_quantization(config.quantization, checkpoint)
