"""In-flight requests of one `generate` call: text, stop strings, n > 1, progress."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tqdm import tqdm

from launch.detokenizer import IncrementalDetokenizer, find_stop_string
from launch.outputs import CompletionOutput, Logprob, RequestOutput
from protocol import EngineCoreOutput, SampleLogprobs, SamplingParams

logger = logging.getLogger("deltaserve")


@dataclass
class _Sequence:
    """One of a request's n sequences (an engine request of its own)."""

    output: CompletionOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0


class RequestTracker:
    """Turns engine outputs into `RequestOutput`s. A stop string is applied here, and the
    sequence is then aborted in the engine (the request ids to abort are returned)."""

    def __init__(self, tokenizer: Any | None, use_tqdm: bool = True) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        self.sequence_of: dict[str, tuple[str, int]] = {}  # engine id -> (request id, index)
        self.unfinished = 0
        self.bar = tqdm(total=0, desc="Processed prompts", unit="req", disable=not use_tqdm,
                        dynamic_ncols=True)
        self.generated = 0

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Track a request; returns its engine requests (one per sequence, `n` in all)."""
        request = self.requests[request_id] = _Request(prompt, prompt_token_ids)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child = params if params.n == 1 else msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            detok = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            request.sequences.append(_Sequence(CompletionOutput(i, "", []), child, detok))
            self.sequence_of[child_id] = (request_id, i)
            children.append((child_id, child))
        self.unfinished += params.n
        self.bar.total += 1
        self.bar.refresh()
        return children

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    def unfinished_ids(self) -> list[str]:
        return list(self.sequence_of)

    def process(self, outputs: list[EngineCoreOutput]) -> list[str]:
        aborts = []
        for out in outputs:
            if out.request_id not in self.sequence_of:
                continue  # e.g. the abort echo of a sequence a stop string already ended
            request_id, index = self.sequence_of[out.request_id]
            request = self.requests[request_id]
            request.num_cached_tokens = max(request.num_cached_tokens, out.num_cached_tokens)
            if self._update(request.sequences[index], out):
                aborts.append(out.request_id)
            if request.sequences[index].output.finished():
                del self.sequence_of[out.request_id]
                self._finished_one(request)
        return aborts

    def _update(self, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Apply one output; True if a stop string ended the sequence (abort it)."""
        result = seq.output
        result.token_ids += out.new_token_ids
        self.generated += len(out.new_token_ids)
        if out.logprobs:
            self._add_logprobs(result, out.logprobs)
        if out.error:
            logger.warning("request %s failed in the engine: %s", out.request_id, out.error)
        stop = None
        if seq.detokenizer is not None:
            new = seq.detokenizer.add(out.new_token_ids)
            if out.finish_reason is not None:
                new += seq.detokenizer.flush()
            result.text = seq.detokenizer.text
            if seq.params.stop and new:
                stop = find_stop_string(result.text, len(new), seq.params.stop,
                                        seq.params.include_stop_str_in_output)
        if stop is not None:
            result.text = result.text[:stop[1]]
            result.finish_reason, result.stop_reason = "stop", stop[0]
            return out.finish_reason is None
        if out.finish_reason is not None:
            result.finish_reason, result.stop_reason = out.finish_reason, (
                out.stop_reason if out.error is None else out.error)
        return False

    def _add_logprobs(self, result: CompletionOutput, entries: list[SampleLogprobs]) -> None:
        result.logprobs = result.logprobs or []
        for entry in entries:
            ranks = [entry.rank] + list(range(1, len(entry.token_ids)))
            step: dict[int, Logprob] = {}
            for token, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks):
                step.setdefault(token, Logprob(logprob, rank, self._decode_one(token)))
            result.logprobs.append(step)  # the sampled token first, then the top-n
            result.cumulative_logprob = (result.cumulative_logprob or 0.0) + entry.logprobs[0]

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _finished_one(self, request: _Request) -> None:
        self.unfinished -= 1
        if all(s.output.finished() for s in request.sequences):
            self.bar.update(1)
            elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(f"{self.generated / elapsed:.0f} output toks/s",
                                     refresh=False)
        if self.unfinished == 0:
            self.bar.close()

    def results(self) -> list[RequestOutput]:
        return [RequestOutput(request_id, r.prompt, r.prompt_token_ids,
                              [s.output for s in r.sequences], True, r.num_cached_tokens)
                for request_id, r in self.requests.items()]
