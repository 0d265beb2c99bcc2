"""In-flight requests of one `LLM.generate` call: their states and a progress bar."""
from __future__ import annotations

from typing import Any

from tqdm import tqdm

from launch.outputs import RequestOutput
from launch.processing.request_state import RequestState
from protocol import EngineCoreOutput, SamplingParams


class RequestTracker:
    """Routes engine outputs to the `RequestState`s of one batch. A stop string is applied
    there, and the sequence is then aborted in the engine (the ids to abort are returned)."""

    def __init__(self, tokenizer: Any | None, use_tqdm: bool = True) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.sequence_of: dict[str, tuple[RequestState, int]] = {}  # engine id -> (state, i)
        self.unfinished = 0
        self.bar = tqdm(total=0, desc="Processed prompts", unit="req", disable=not use_tqdm,
                        dynamic_ncols=True)
        self.generated = 0

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Track a request; returns its engine requests (one per sequence, `n` in all)."""
        state = RequestState.create(request_id, prompt, prompt_token_ids, params,
                                    self.tokenizer)
        self.requests[request_id] = state
        for i, child_id in enumerate(state.child_ids):
            self.sequence_of[child_id] = (state, i)
        self.unfinished += params.n
        self.bar.total += 1
        self.bar.refresh()
        return [(c, s.params) for c, s in zip(state.child_ids, state.sequences)]

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
            state, index = self.sequence_of[out.request_id]
            self.generated += len(out.new_token_ids)
            if state.update(index, out, self.tokenizer):
                aborts.append(out.request_id)
            if state.sequences[index].output.finished():
                del self.sequence_of[out.request_id]
                self._finished_one(state)
        return aborts

    def _finished_one(self, state: RequestState) -> None:
        self.unfinished -= 1
        if state.finished:
            self.bar.update(1)
            elapsed = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(f"{self.generated / elapsed:.0f} output toks/s",
                                     refresh=False)
        if self.unfinished == 0:
            self.bar.close()

    def results(self) -> list[RequestOutput]:
        return [state.output() for state in self.requests.values()]
