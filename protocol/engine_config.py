"""The engine's options: the one definition that `LLM`, `AsyncLLM`, the CLI and the workers
derive from. Each field's description is its help text; `extra` carries CLI spellings."""
from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.kv_events import KVEventsConfig, parse_kv_events_config
from protocol.pooler_config import PoolerConfig, resolve_runner
from protocol.speculative_config import SpeculativeConfig

AttentionBackendName = Literal["auto", "torch", "cpu", "cupy", "emulated"]
SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "gguf", "gguf_a8", "int8", "w8a8", "none"]
ExecutorBackend = Literal["mp", "ray"]
Runner = Literal["auto", "generate", "pooling"]
Convert = Literal["auto", "none", "embed", "classify"]


def _opt(help: str, **extra: Any) -> Meta:
    return Meta(description=help, extra=extra)


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything an engine is started with, validated on construction."""

    model: Annotated[str, _opt(
        "a Hugging Face directory, a .gguf file, an org/name hub id, or a named model: "
        "smollm2 (the default; Apache-2.0) or gemma3-270m (Google's Gemma 3 270M, under the "
        "Gemma Terms of Use, https://ai.google.dev/gemma/terms)")]
    tensor_parallel_size: Annotated[int, _opt("number of worker ranks", aliases=["-tp"])] = 1
    device: Annotated[str, _opt("auto, cpu or cuda[:N]")] = "auto"
    dtype: Annotated[DType, _opt("weights and activations; auto: the checkpoint's")] = "auto"
    quantization: Annotated[Quantization, _opt(
        "weights: gguf keeps a GGUF file's blocks and multiplies them as they are; gguf_a8 "
        "multiplies them with activations quantized to 8 bits per block (llama.cpp's "
        "arithmetic, integer dot products; not exact, never chosen by auto); int8 "
        "quantizes a dense model at load (a scale per output channel); w8a8 does too and "
        "multiplies with activations quantized per token to int8 (vLLM's CPU W8A8; not "
        "exact, never chosen by auto); none runs dense "
        "weights (a GGUF file dequantized to float32); auto: gguf for a GGUF model (a .gguf "
        "file, smollm2, gemma3-270m), none otherwise. Quantized weights compute in float32",
        aliases=["-q"])] = "auto"
    w8a8_smoothing: Annotated[bool, _opt(
        "with --quantization w8a8, fold SmoothQuant factors (calibrated at load on a built-in "
        "text) into the weights before quantizing them; turn off for a checkpoint that is "
        "smoothed already")] = True
    max_model_len: Annotated[int | None, _opt(
        "longest sequence (prompt + output); default: the model's limit")] = None
    max_num_seqs: Annotated[int, _opt("most requests running at once")] = 256
    max_num_batched_tokens: Annotated[int | None, _opt(
        "tokens per step; default: max(8192, max_model_len without chunked prefill)")] = None
    block_size: Annotated[int, _opt("tokens per KV-cache block")] = 16
    enable_prefix_caching: Annotated[bool, _opt("reuse the KV of shared prompt prefixes")] = True
    enable_chunked_prefill: Annotated[bool, _opt("split long prompts across steps")] = True
    disable_hybrid_kv_cache_manager: Annotated[bool, _opt(
        "allocate every layer's KV as full attention (sliding-window layers keep all their "
        "blocks; the attention still uses the window)")] = False
    long_prefill_token_threshold: Annotated[int, _opt(
        "most tokens one prefill chunk takes per step (0: no cap)")] = 0
    policy: Annotated[SchedulingPolicy, _opt(
        "waiting-queue order", flag="--scheduling-policy")] = "fcfs"
    async_scheduling: Annotated[bool, _opt(
        "schedule the next step while the workers run the current one")] = False
    speculative_config: Annotated[SpeculativeConfig | None, _opt(
        "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": "
        "K, \"prompt_lookup_min\": N, \"prompt_lookup_max\": M} or {\"method\": "
        "\"draft_model\", \"model\": DIR, \"num_speculative_tokens\": K}")] = None
    num_gpu_blocks_override: Annotated[int | None, _opt(
        "KV-cache blocks per worker, overriding the memory budget")] = None
    kv_cache_memory_bytes: Annotated[int | None, _opt("KV-cache bytes per worker")] = None
    gpu_memory_utilization: Annotated[float, _opt(
        "fraction of GPU memory the engine may use")] = 0.9
    num_threads: Annotated[int | None, _opt(
        "torch threads per CPU worker rank, fixed; default: VLLM_CPU_OMP_THREADS_BIND's CPU "
        "list or $OMP_NUM_THREADS if set, else the CPUs the process may use (affinity mask, "
        "cgroup quota) divided among the ranks on the host, fewer while other processes "
        "keep the CPUs busy")] = None
    seed: Annotated[int, _opt("seed of requests that bring none")] = 0
    generation_config: Annotated[str, _opt(
        "request defaults: auto, the sampling fields of the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); vllm, "
        "none (vLLM's defaults); or a directory holding a generation_config.json")] = "auto"
    max_logprobs: Annotated[int, _opt("most logprobs a request may ask for per token")] = 20
    attention_backend: Annotated[AttentionBackendName, _opt(
        "auto: CUDA kernels on a GPU, the compiled CPU kernel on a CPU")] = "auto"
    worker_address: Annotated[str | None, _opt(
        "tcp://HOST:PORT to let remote workers join (default: a private ipc socket)")] = None
    local_ranks: Annotated[list[int] | None, _opt(
        "ranks the engine starts itself (default: all); the others join with "
        "`deltaserve worker`")] = None
    record_path: Annotated[str | None, _opt(
        "write a message journal of the run to this path", flag="--record")] = None
    worker_secret_file: Annotated[str | None, _opt(
        "file holding the secret workers prove themselves with; required with a tcp "
        "worker address (workers on other hosts read the same file)")] = None
    distributed_executor_backend: Annotated[ExecutorBackend, _opt(
        "how the workers start: mp, local processes; ray, Ray actors in a placement group "
        "(the cluster at $RAY_ADDRESS or `ray start`'s, else a local one)")] = "mp"
    data_parallel_size: Annotated[int, _opt(
        "engine replicas, each an engine core with its own workers and KV cache; each new "
        "request goes to the least loaded", aliases=["-dp"])] = 1
    data_parallel_rank: Annotated[int, _opt(
        "data-parallel rank of the (first) replica: offsets its KV-event ports and names it "
        "in KV events and metrics (behind an external load balancer: one per server)")] = 0
    kv_events_config: Annotated[KVEventsConfig | None, _opt(
        "KV-cache events as vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true}' (ZeroMQ "
        "PUB on tcp://127.0.0.1:5557 + rank)")] = None
    enable_lora: Annotated[bool, _opt(
        "serve LoRA adapters (PEFT directories) beside the base model, per request")] = False
    max_loras: Annotated[int, _opt(
        "most distinct LoRA adapters in one step (requests of another wait for a later "
        "step)")] = 1
    max_lora_rank: Annotated[int, _opt(
        "highest adapter rank accepted; a higher one is refused when it is loaded")] = 16
    max_cpu_loras: Annotated[int | None, _opt(
        "adapters each worker keeps loaded, least recently used out first (an evicted one is "
        "read again when a request needs it); default: max_loras")] = None
    startup_timeout_s: Annotated[float, _opt("how long workers may take to start")] = 600.0
    step_timeout_s: Annotated[float, _opt(
        "a step that makes no progress for this long ends the engine")] = 60.0
    structured_outputs_compile_timeout_s: Annotated[float, _opt(
        "a request whose structured-output grammar has not compiled this long after it "
        "reached the engine fails (finish reason error)")] = 10.0
    structured_outputs_validation_timeout_s: Annotated[float, _opt(
        "the front-end's deadline for checking a request's constraint: still queued then, "
        "the request is refused as busy (503); still running, as too complex (400)")] = 5.0
    structured_outputs_mask_wait_ms: Annotated[float, _opt(
        "how long a step waits for the masks of constrained requests that sampled in the "
        "step before; a request whose mask is later sits out steps until it is ready")] = 50.0
    structured_outputs_max_items_in_row: Annotated[int, _opt(
        "grammar limit: Earley items one grammar row may hold (a rule's alternatives)")] = 2000
    structured_outputs_max_items_per_step: Annotated[int, _opt(
        "grammar limit: Earley items computing one token's mask may create")] = 50_000
    structured_outputs_lexer_fuel: Annotated[int, _opt(
        "grammar limit: work building a grammar's lexer (its regexes; ~50 per us)")] = 1_000_000
    structured_outputs_step_lexer_fuel: Annotated[int, _opt(
        "grammar limit: lexer work computing one token's mask (~14 per us)")] = 200_000
    structured_outputs_max_lexer_states: Annotated[int, _opt(
        "grammar limit: lexer states one grammar may build (1-2 kB each)")] = 250_000
    structured_outputs_max_grammar_size: Annotated[int, _opt(
        "grammar limit: symbols in a grammar's productions")] = 500_000
    runner: Annotated[Runner, _opt(
        "generate: a text generator; pooling: embeddings, classification and scores "
        "(/v1/embeddings, /pooling, /score, /rerank); auto: pooling for a "
        "*ForSequenceClassification or *Model checkpoint or a sentence-transformers "
        "directory, else generate")] = "auto"
    convert: Annotated[Convert, _opt(
        "with --runner pooling, what a generating checkpoint becomes: embed (its pooled "
        "hidden states) or classify (a *ForSequenceClassification score head); auto: from "
        "the architecture")] = "auto"
    pooler_config: Annotated[PoolerConfig | None, _opt(
        "pooling, as JSON: {\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", \"normalize\": "
        "true|false (vLLM 0.32: use_activation), \"dimensions\": N}; unset fields come "
        "from sentence-transformers' modules.json, else LAST and normalized")] = None

    def __post_init__(self) -> None:
        for field in msgspec.structs.fields(self):
            choices = literal_choices(field.type)
            value = getattr(self, field.name)
            if choices and value not in choices:
                raise ValueError(f"{field.name} must be one of {', '.join(choices)}, "
                                 f"got {value!r}")
        for name in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs",
                     "block_size", "max_model_len", "num_threads",
                     "max_num_batched_tokens", "kv_cache_memory_bytes", "max_loras",
                     "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is reserved)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative")
        if self.worker_address is not None and not self.worker_address.startswith("tcp://"):
            raise ValueError(f"worker_address must be tcp://HOST:PORT, got {self.worker_address!r}")
        if self.worker_address is not None and self.worker_secret_file is None and \
                self.distributed_executor_backend == "mp":
            raise ValueError("a tcp worker_address needs worker_secret_file: workers on the "
                             "network must prove they belong to this engine")
        positive = [name for name in self.__struct_fields__ if name.startswith(
            "structured_outputs_") and not name.endswith("_wait_ms")]
        for name in ("startup_timeout_s", "step_timeout_s", *positive):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.structured_outputs_mask_wait_ms <= 10_000:
            raise ValueError(f"structured_outputs_mask_wait_ms must be in [0, 10000], got "
                             f"{self.structured_outputs_mask_wait_ms}")
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("speculative_config does not work with async_scheduling: a "
                             "step's proposals follow from the tokens the step before it "
                             "accepted, which the scheduler does not know yet while that step "
                             "runs; choose one of them")
        self._check_scale_out()
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}): a step's adapters must all be loaded")
        self._check_pooling()
        for rank in self.local_ranks or ():
            if not 0 <= rank < self.tensor_parallel_size:
                raise ValueError(f"local rank {rank} is outside tensor_parallel_size "
                                 f"{self.tensor_parallel_size}")

    def _check_scale_out(self) -> None:
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be non-negative, got "
                             f"{self.data_parallel_rank}")
        if not isinstance(self.kv_events_config, (KVEventsConfig, type(None))):
            raise ValueError("kv_events_config must be a KVEventsConfig (EngineConfig.create "
                             "also takes JSON text or a dict)")
        if self.distributed_executor_backend == "ray" and self.local_ranks is not None:
            raise ValueError("local_ranks is for the mp backend: with ray, Ray places every "
                             "rank")

    def _check_pooling(self) -> None:
        if not isinstance(self.pooler_config, (PoolerConfig, type(None))):
            raise ValueError("pooler_config must be a PoolerConfig (EngineConfig.create also "
                             "takes JSON text or a dict)")
        if self.runner != "pooling":
            return
        if self.speculative_config is not None:
            raise ValueError("speculative_config does not apply to --runner pooling: a "
                             "pooling model generates no tokens")
        if self.async_scheduling:
            raise ValueError("async_scheduling does not apply to --runner pooling: a pooling "
                             "request ends with its prompt, so there is no next step to "
                             "overlap")

    @staticmethod
    def create(**options: Any) -> EngineConfig:
        """Like the constructor, but an unknown option is a ValueError naming the known ones,
        and kv_events_config may be JSON text or a dict."""
        known = set(EngineConfig.__struct_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        if options.get("speculative_config") is not None:
            options["speculative_config"] = SpeculativeConfig.parse(options["speculative_config"])
        if "kv_events_config" in options:
            options["kv_events_config"] = parse_kv_events_config(options["kv_events_config"])
        if options.get("pooler_config") is not None:
            options["pooler_config"] = PoolerConfig.parse(options["pooler_config"])
        return EngineConfig(**options)

    def with_runner(self) -> EngineConfig:
        """This config with `runner`, `convert` and `pooler_config` resolved against the model
        directory (vLLM's `auto` rules; see protocol/pooler_config.py). Idempotent: every
        process may call it, the front-end does so before anything starts."""
        choice = resolve_runner(self.model, self.runner, self.convert, self.pooler_config)
        if (choice.runner, choice.convert, choice.pooler_config) == (
                self.runner, self.convert, self.pooler_config):
            return self
        return msgspec.structs.replace(self, runner=choice.runner, convert=choice.convert,
                                       pooler_config=choice.pooler_config)

    @property
    def spawned_ranks(self) -> list[int]:
        if self.local_ranks is None:
            return list(range(self.tensor_parallel_size))
        return sorted(self.local_ranks)

    @property
    def lora_cache_size(self) -> int:
        """Adapters a worker keeps loaded (--max-cpu-loras, else --max-loras)."""
        return self.max_cpu_loras or self.max_loras

    def token_budget(self, max_model_len: int) -> int:
        """Tokens per step: as given, else 8192, raised to max_model_len when prompts cannot
        be chunked (a prompt must then fit one step)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(8192, 0 if self.enable_chunked_prefill else max_model_len)


def literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The allowed values of a (possibly Annotated, possibly Optional) Literal type."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return ()
