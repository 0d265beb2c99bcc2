"""Prometheus metrics under vLLM's names (so existing dashboards work), labelled model_name,
in a registry of their own per server (several servers may share one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from launch.metrics.stats import IterationStats
from protocol import SpecDecodingStats

FINISHED_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class PrometheusStatLogger:
    """A `StatLogger` for `AsyncLLM`: gauges from the engine core's latest `SchedulerStats`,
    counters and histograms from each batch of outputs."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels, r, m = ["model_name"], self.registry, model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(m)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(m)
        self.running = gauge("vllm:num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = all).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions in the engine.")
        success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(m, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time to first token (arrival to first output).", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's consecutive outputs.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Arrival to the last output of a request.", _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Arrival to first scheduled in the engine core.",
                               _REQUEST_BUCKETS)
        self._last_preemptions = 0
        self.spec_decode = {  # SpecDecodingStats field -> counter
            "num_drafts": counter("vllm:spec_decode_num_drafts",
                                  "Verifications of a request's draft tokens."),
            "num_draft_tokens": counter("vllm:spec_decode_num_draft_tokens",
                                        "Draft tokens verified."),
            "num_accepted_tokens": counter("vllm:spec_decode_num_accepted_tokens",
                                           "Draft tokens the target model accepted.")}
        self._last_spec_decode = dict.fromkeys(self.spec_decode, 0)

    def record(self, stats: IterationStats) -> None:
        s = stats.scheduler
        if s is not None:
            self.running.set(s.num_running)
            self.waiting.set(s.num_waiting)
            self.kv_usage.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0)
            if s.num_preemptions > self._last_preemptions:  # the engine's count is cumulative
                self.preemptions.inc(s.num_preemptions - self._last_preemptions)
                self._last_preemptions = s.num_preemptions
            if s.spec_decoding is not None:
                self._record_spec_decoding(s.spec_decoding)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.ttfts_s:
            self.ttft.observe(value)
        for value in stats.itls_s:
            self.itl.observe(value)
        for reason in stats.finished_reasons:
            self.success[reason if reason in self.success else "error"].inc()
        for done in stats.finished:
            self.e2e.observe(done.e2e_s)
            if done.queue_s is not None:
                self.queue.observe(done.queue_s)

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        """The engine's counts are cumulative: each counter takes what is new."""
        for name, counter in self.spec_decode.items():
            value = getattr(spec, name)
            if value > self._last_spec_decode[name]:
                counter.inc(value - self._last_spec_decode[name])
                self._last_spec_decode[name] = value
