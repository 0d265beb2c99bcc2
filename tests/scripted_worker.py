"""A stand-in for the model that still speaks the real step protocol.

`ScriptedWorker` keeps per-handle state from `NewRequestData` and applies the
`CachedRequestData` deltas like a real worker, asserting every invariant a worker relies on.
It simulates the KV cache as one fingerprint per slot (a hash of the token prefix ending at that
position), writes the step's slots first and then checks that every position a sampling
request attends holds its own prefix: a wrong prefix-cache hit, a block reused while shared, or
a bad resume shows up as a mismatch. Tokens come from a fixed script.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import ModelRunnerOutput, SchedulerOutput

TokenScript = Callable[[str, list[int]], int]


def default_script(request_id: str, tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the request and its last tokens."""
    return (sum(tokens[-3:]) * 31 + len(tokens) * 7 + len(request_id)) % 997 + 3


@dataclass
class _State:
    request_id: str
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    fingerprints: list[int] = field(default_factory=list)

    def fingerprint(self, pos: int) -> int:
        while len(self.fingerprints) <= pos:
            prev = self.fingerprints[-1] if self.fingerprints else 17
            self.fingerprints.append(hash((prev, self.tokens[len(self.fingerprints)])))
        return self.fingerprints[pos]


class ScriptedWorker:
    def __init__(self, num_blocks: int, block_size: int, script: TokenScript = default_script,
                 check_kv: bool = True) -> None:
        self.block_size = block_size
        self.script = script
        self.check_kv = check_kv
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.states: dict[int, _State] = {}
        self.last_step = 0
        self.answers: deque[ModelRunnerOutput] = deque()  # submitted, not yet collected

    def submit(self, so: SchedulerOutput) -> None:
        """Run the step now (a real worker runs steps in order too); answer at `collect`."""
        self.answers.append(self.execute_model(so))

    def collect(self) -> ModelRunnerOutput:
        return self.answers.popleft()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert so.step == self.last_step + 1, f"step gap: {self.last_step} -> {so.step}"
        self.last_step = so.step
        self._apply_deltas(so)
        order = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        assert list(so.num_scheduled_tokens) == order
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            self._write_kv(self.states[req_id], n)
        sampled = []
        for req_id in order:
            state = self.states[req_id]
            if state.num_computed < len(state.tokens):
                sampled.append([])
                continue
            self._check_kv(state)
            token = self.script(state.request_id, state.tokens)
            state.tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(order, sampled, step=so.step)

    def _apply_deltas(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            assert req_id in self.states, f"finished unknown handle {req_id}"
            del self.states[req_id]
        for req_id in so.preempted_req_ids:
            self.states[req_id].block_ids = []  # its KV is gone until it resumes
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"handle {new.req_id} is already live"
            assert new.num_computed_tokens % self.block_size == 0
            self.states[new.req_id] = _State(new.request_id, list(new.prompt_token_ids),
                                             list(new.block_ids), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(cached.new_block_ids[i])
                state.num_computed = cached.num_computed_tokens[i]
            else:
                assert cached.num_computed_tokens[i] == state.num_computed
                state.block_ids += cached.new_block_ids[i] or []

    def _slot(self, state: _State, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _write_kv(self, state: _State, n: int) -> None:
        end = state.num_computed + n
        assert 0 < n and end <= len(state.tokens), "scheduled past the known tokens"
        assert len(state.block_ids) * self.block_size >= end, "not enough blocks for the step"
        assert 0 not in state.block_ids, "null block handed to a request"
        for pos in range(state.num_computed, end):
            self.kv[self._slot(state, pos)] = state.fingerprint(pos)
        state.num_computed = end

    def _check_kv(self, state: _State) -> None:
        if not self.check_kv:
            return
        for pos in range(state.num_computed):
            assert self.kv[self._slot(state, pos)] == state.fingerprint(pos), (
                f"{state.request_id}: KV at position {pos} is not this request's prefix")
