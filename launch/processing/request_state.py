"""One request in the front-end: its n sequences, their text, stop strings and logprobs.

Both `LLM` and `AsyncLLM` keep one `RequestState` per request, which their shared
`OutputProcessor` feeds the engine's outputs; it turns them into `RequestOutput`s, cumulative
or as deltas.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from launch.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from launch.processing.detokenizer import IncrementalDetokenizer, find_stop_string
from protocol import EngineCoreOutput, SampleLogprobs, SamplingParams
from protocol.lora import LoRARequest

logger = logging.getLogger("deltaserve")


@dataclass
class _Sequence:
    """One of a request's n sequences (an engine request of its own). `sent_*` count what
    earlier delta outputs already carried."""

    output: CompletionOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    sent_text: int = 0
    sent_tokens: int = 0


@dataclass
class RequestTimes:
    """Wall-clock times (time.time()) of a request's life in the front-end."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    queued_s: float | None = None  # first scheduled - arrival, as the engine core reports it


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.time()))
    lora_request: LoRARequest | None = None

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
               params: SamplingParams, tokenizer: Any | None,
               arrival: float | None = None,
               lora_request: LoRARequest | None = None) -> RequestState:
        """n sequences, each its own engine request: `request_id` itself when n == 1, else
        `{i}_{request_id}` with `child_seed(seed, i)` (so each sequence samples differently)."""
        state = cls(request_id, prompt, prompt_token_ids,
                    times=RequestTimes(time.time() if arrival is None else arrival),
                    lora_request=lora_request)
        for i in range(params.n):
            child = params if params.n == 1 else msgspec.structs.replace(
                params, n=1, seed=None if params.seed is None else child_seed(params.seed, i))
            detok = None if tokenizer is None else IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens)
            state.sequences.append(_Sequence(CompletionOutput(i, "", []), child, detok))
            state.child_ids.append(request_id if params.n == 1 else f"{i}_{request_id}")
        return state

    @property
    def finished(self) -> bool:
        return all(s.output.finished() for s in self.sequences)

    def unfinished_child_ids(self) -> list[str]:
        return [c for c, s in zip(self.child_ids, self.sequences) if not s.output.finished()]

    def update(self, index: int, out: EngineCoreOutput, tokenizer: Any | None) -> bool:
        """Apply one engine output to sequence `index`; True if a stop string ended the
        sequence while the engine still runs it (the caller aborts it there)."""
        seq = self.sequences[index]
        if seq.output.finished():
            return False  # e.g. the abort echo of a sequence a stop string already ended
        if len(out.new_token_ids) > 1 and seq.params.stop and seq.detokenizer is not None:
            return self._update_token_by_token(index, out, tokenizer)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        result = seq.output
        result.token_ids += out.new_token_ids
        if out.logprobs:
            _add_logprobs(result, out.logprobs, tokenizer)
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

    def _update_token_by_token(self, index: int, out: EngineCoreOutput,
                               tokenizer: Any | None) -> bool:
        """An output of several tokens (speculative decoding) for a sequence with stop
        strings: applied one token at a time, so a stop string ends the sequence at the token
        that completes it, in its token ids and logprobs as in its text."""
        last = len(out.new_token_ids) - 1
        for k, token in enumerate(out.new_token_ids):
            final = k == last
            part = msgspec.structs.replace(
                out, new_token_ids=[token], logprobs=out.logprobs[k:k + 1] if out.logprobs
                else None, finish_reason=out.finish_reason if final else None,
                stop_reason=out.stop_reason if final else None,
                error=out.error if final else None)
            ended_here = self.update(index, part, tokenizer)
            if self.sequences[index].output.finished():
                return ended_here and out.finish_reason is None
        return False

    def finish_all(self, reason: str, stop_reason: str | None = None) -> None:
        """End every unfinished sequence here (an abort, or the engine's death)."""
        for seq in self.sequences:
            if not seq.output.finished():
                seq.output.finish_reason, seq.output.stop_reason = reason, stop_reason

    def output(self, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> RequestOutput:
        """The request so far. CUMULATIVE (and FINAL_ONLY): every sequence's text and tokens
        from the start (the same objects, updated in place). DELTA: only what earlier DELTA
        outputs did not carry, as fresh objects; text that a stop string could still cut is
        held back, so the concatenated deltas always equal the final text."""
        if kind is RequestOutputKind.DELTA:
            outputs = [_take_delta(s) for s in self.sequences]
        else:
            outputs = [s.output for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             self.finished, self.num_cached_tokens,
                             lora_request=self.lora_request)


def child_seed(seed: int, index: int) -> int:
    """Sequence `index` of an n > 1 request samples with `seed + index`, wrapped around into
    the signed 64-bit range the engine takes (so 2**63 - 1 is followed by -2**63)."""
    return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


def _take_delta(seq: _Sequence) -> CompletionOutput:
    out = seq.output
    end = len(out.text)
    if not out.finished() and seq.params.stop:
        end = max(seq.sent_text, end - max(len(s) for s in seq.params.stop) + 1)
    logprobs = None if out.logprobs is None else out.logprobs[seq.sent_tokens:]
    delta = CompletionOutput(out.index, out.text[seq.sent_text:end],
                             out.token_ids[seq.sent_tokens:], out.cumulative_logprob, logprobs,
                             out.finish_reason, out.stop_reason)
    seq.sent_text, seq.sent_tokens = end, len(out.token_ids)
    return delta


def _add_logprobs(result: CompletionOutput, entries: list[SampleLogprobs],
                  tokenizer: Any | None) -> None:
    result.logprobs = result.logprobs or []
    for entry in entries:
        ranks = [entry.rank] + list(range(1, len(entry.token_ids)))
        step: dict[int, Logprob] = {}
        for token, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks):
            decoded = None if tokenizer is None else tokenizer.decode([token])
            step.setdefault(token, Logprob(logprob, rank, decoded))
        result.logprobs.append(step)  # the sampled token first, then the top-n
        result.cumulative_logprob = (result.cumulative_logprob or 0.0) + entry.logprobs[0]
