"""Prometheus metrics under vLLM's names (so existing dashboards work), labelled model_name,
in a registry of their own per server (several servers may share one process)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from launch.metrics.stats import IterationStats
from protocol import EngineConfig, EngineReady, SpecDecodingStats

FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's CacheConfig field names, for the ones deltaserve has.
_CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching",
                      "gpu_memory_utilization", "num_gpu_blocks", "num_gpu_blocks_override",
                      "prefix_caching_hash_algo")
_HASH_ALGO = "blake2b_128"  # chained over token ids (kv_cache_manager.hash_block_tokens)
_TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class PrometheusStatLogger:
    """A `StatLogger` for `AsyncLLM`: gauges from each engine's latest `SchedulerStats`,
    counters and histograms from each batch of outputs, all labelled by `engine` (the
    replica's data-parallel rank, "0" with one engine), as vLLM labels them."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels, r = ["model_name", "engine"], self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests running in the engine.",
                             labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                             labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = all).", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions in the engine.",
                                   labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token (arrival to first output).", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's consecutive outputs.", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Arrival to the last output of a request.", labels,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Arrival to first scheduled in the engine core.", labels,
                               buckets=_REQUEST_BUCKETS, registry=r)
        self.spec_decode = {  # SpecDecodingStats field -> counter
            "num_drafts": Counter("vllm:spec_decode_num_drafts",
                                  "Verifications of a request's draft tokens.", labels,
                                  registry=r),
            "num_draft_tokens": Counter("vllm:spec_decode_num_draft_tokens",
                                        "Draft tokens verified.", labels, registry=r),
            "num_accepted_tokens": Counter("vllm:spec_decode_num_accepted_tokens",
                                           "Draft tokens the target model accepted.", labels,
                                           registry=r)}
        self._engines: dict[int, _EngineMetrics] = {}
        self.lora_info: Gauge | None = None  # with LoRA enabled (log_lora_config)
        self.max_loras = 0

    def engine(self, rank: int) -> _EngineMetrics:
        """The label children of one engine, made on first use."""
        found = self._engines.get(rank)
        if found is None:
            m, e = self.model_name, str(rank)
            found = self._engines[rank] = _EngineMetrics(
                self.running.labels(m, e), self.waiting.labels(m, e), self.kv_usage.labels(m, e),
                self.prompt_tokens.labels(m, e), self.generation_tokens.labels(m, e),
                self.preemptions.labels(m, e),
                {reason: self.success.labels(m, e, reason) for reason in FINISHED_REASONS},
                self.ttft.labels(m, e), self.itl.labels(m, e), self.e2e.labels(m, e),
                self.queue.labels(m, e),
                {name: c.labels(m, e) for name, c in self.spec_decode.items()})
        return found

    def log_cache_config(self, config: EngineConfig, readies: list[EngineReady]) -> None:
        """`vllm:cache_config_info`, value 1, one series per engine, labelled (as vLLM) with
        the cache's settings: what routers such as llm-d read block_size and num_gpu_blocks
        from (num_gpu_blocks counts the reserved null block, as vLLM's does)."""
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     [*_CACHE_INFO_LABELS, "engine"], registry=self.registry)
        for index, ready in enumerate(readies):
            rank = config.data_parallel_rank + index
            info.labels(str(ready.block_size), "auto", str(config.enable_prefix_caching),
                        str(config.gpu_memory_utilization), str(ready.num_blocks),
                        str(config.num_gpu_blocks_override), _HASH_ALGO, str(rank)).set(1)
            self.engine(rank)

    def log_lora_config(self, config: EngineConfig) -> None:
        """With LoRA enabled, vLLM's `vllm:lora_requests_info`: one series, value the time of
        the last update, labelled `max_lora` and the adapters with waiting and running
        requests (comma-separated names). Unlike vLLM, an update replaces the previous
        series, so /metrics holds the current one only."""
        if config.enable_lora and self.lora_info is None:
            self.max_loras = config.max_loras
            self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters",
                                    "running_lora_adapters"], registry=self.registry)

    def record(self, stats: IterationStats) -> None:
        if stats.lora is not None and self.lora_info is not None:
            self.lora_info.clear()
            self.lora_info.labels(str(self.max_loras), ",".join(stats.lora.waiting),
                                  ",".join(stats.lora.running)).set_to_current_time()
        m = self.engine(stats.engine)
        s = stats.scheduler
        if s is not None:
            m.running.set(s.num_running)
            m.waiting.set(s.num_waiting)
            m.kv_usage.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0)
            if s.num_preemptions > m.last_preemptions:  # the engine's count is cumulative
                m.preemptions.inc(s.num_preemptions - m.last_preemptions)
                m.last_preemptions = s.num_preemptions
            if s.spec_decoding is not None:
                _record_spec_decoding(m, s.spec_decoding)
        if stats.num_prompt_tokens:
            m.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            m.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.ttfts_s:
            m.ttft.observe(value)
        for value in stats.itls_s:
            m.itl.observe(value)
        for reason in stats.finished_reasons:
            m.success[reason if reason in m.success else "error"].inc()
        for done in stats.finished:
            m.e2e.observe(done.e2e_s)
            if done.queue_s is not None:
                m.queue.observe(done.queue_s)


def _record_spec_decoding(m: _EngineMetrics, spec: SpecDecodingStats) -> None:
    """The engine's counts are cumulative: each counter takes what is new."""
    for name, counter in m.spec_decode.items():
        value = getattr(spec, name)
        if value > m.last_spec_decode.get(name, 0):
            counter.inc(value - m.last_spec_decode.get(name, 0))
            m.last_spec_decode[name] = value


@dataclass(slots=True)
class _EngineMetrics:
    running: Any
    waiting: Any
    kv_usage: Any
    prompt_tokens: Any
    generation_tokens: Any
    preemptions: Any
    success: dict[str, Any]
    ttft: Any
    itl: Any
    e2e: Any
    queue: Any
    spec_decode: dict[str, Any]  # SpecDecodingStats field -> counter
    last_preemptions: int = 0
    last_spec_decode: dict[str, int] = field(default_factory=dict)
