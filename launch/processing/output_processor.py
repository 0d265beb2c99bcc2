"""Engine outputs to request states: the front-end's one router, shared by `LLM` and
`AsyncLLM` (vLLM's OutputProcessor).

A request of n sequences is n engine requests (children); each child id routes to its
request's `RequestState` and sequence index until that sequence finishes. Stop strings are
applied in the state; a sequence one ended while the engine still runs it is returned in
`aborts`, for the caller to abort in the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launch.metrics.stats import FinishedRequest, IterationStats, LoRAStats
from launch.processing.request_state import RequestState
from protocol import EngineCoreOutput


@dataclass(slots=True)
class ProcessedOutputs:
    updated: list[RequestState] = field(default_factory=list)  # changed, in output order
    finished: list[RequestState] = field(default_factory=list)  # every sequence finished
    aborts: list[str] = field(default_factory=list)  # children a stop string ended


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}  # unfinished requests by id
        self._routes: dict[str, tuple[RequestState, int]] = {}  # child id -> (state, index)
        self.lora_seen = False  # a LoRA request was ever added: stats count adapters

    def add_request(self, state: RequestState) -> None:
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        self.lora_seen = self.lora_seen or state.lora_request is not None
        for i, child_id in enumerate(state.child_ids):
            self._routes[child_id] = (state, i)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def unfinished_child_ids(self) -> list[str]:
        return list(self._routes)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        stats: IterationStats | None = None) -> ProcessedOutputs:
        """Apply a batch of engine outputs; with `stats`, also account latencies, token
        counts and finish reasons in it."""
        result = ProcessedOutputs()
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # aborted here already, or the echo of a stop-string abort
            state, index = route
            if stats is not None:
                _account(state, out, stats)
            if state.update(index, out, self.tokenizer):
                result.aborts.append(out.request_id)
            result.updated.append(state)
            sequence = state.sequences[index].output
            if not sequence.finished():
                continue
            del self._routes[out.request_id]
            if stats is not None:
                stats.finished_reasons.append(sequence.finish_reason)
            if state.finished:
                del self.requests[state.request_id]
                result.finished.append(state)
                if stats is not None:
                    _finished(state, stats)
        if stats is not None and self.lora_seen:
            stats.lora = self.lora_stats()
        return result

    def lora_stats(self) -> LoRAStats:
        """Unfinished requests per adapter: waiting until the engine first scheduled them
        (or they produced a token), running after."""
        stats = LoRAStats()
        for state in self.requests.values():
            if state.lora_request is not None:
                started = state.times.queued_s is not None or state.times.first_token is not None
                counts = stats.running if started else stats.waiting
                name = state.lora_request.lora_name
                counts[name] = counts.get(name, 0) + 1
        return stats

    def abort_request(self, request_id: str, stats: IterationStats | None = None
                      ) -> list[str]:
        """Finish the request here ("abort"); returns its children the engine still runs
        (empty for an unknown or finished id)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        children = state.unfinished_child_ids()
        for child_id in state.child_ids:
            self._routes.pop(child_id, None)
        state.finish_all("abort")
        if stats is not None:
            stats.finished_reasons += ["abort"] * len(children)
            _finished(state, stats)
        return children

    def abort_all(self) -> list[str]:
        """Abort every request; returns the children the engine still runs."""
        return [child for request_id in list(self.requests)
                for child in self.abort_request(request_id)]

    def drop_requests_of(self, child_ids: list[str]) -> list[RequestState]:
        """Forget the requests these children belong to (their engine died); returns their
        states."""
        states = {}
        for child_id in child_ids:
            route = self._routes.get(child_id)
            if route is not None:
                states[route[0].request_id] = route[0]
        for state in states.values():
            del self.requests[state.request_id]
            for child_id in state.child_ids:
                self._routes.pop(child_id, None)
        return list(states.values())

    def drop_all(self) -> list[RequestState]:
        """Forget every request (the engine died); returns their states."""
        states = list(self.requests.values())
        self.requests, self._routes = {}, {}
        return states


def _account(state: RequestState, out: EngineCoreOutput, stats: IterationStats) -> None:
    """Queue time on the first scheduled output; TTFT (and the prompt's tokens) on the first
    output with tokens, an inter-token latency on each later one."""
    times, n = state.times, len(out.new_token_ids)
    if out.scheduled_time is not None and times.queued_s is None:
        times.queued_s = max(0.0, out.scheduled_time - times.arrival)
    if not n:
        if out.pooling_output is not None:  # a pooling request's only output: its prompt ran
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        return
    stats.num_generation_tokens += n
    if times.first_token is None:
        times.first_token = stats.time
        stats.num_prompt_tokens += len(state.prompt_token_ids)
        stats.ttfts_s.append(stats.time - times.arrival)
    elif times.last_token is not None:
        stats.itls_s.append(stats.time - times.last_token)
    times.last_token = stats.time


def _finished(state: RequestState, stats: IterationStats) -> None:
    times = state.times
    reason = state.sequences[0].output.finish_reason or "abort"
    stats.finished.append(FinishedRequest(reason, stats.time - times.arrival, times.queued_s))
