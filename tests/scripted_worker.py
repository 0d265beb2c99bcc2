"""A stand-in for the model that still speaks the real step protocol.

`ScriptedWorker` keeps per-handle state from `NewRequestData` and applies the
`CachedRequestData` deltas like a real worker, asserting every invariant a worker relies on.
It simulates the KV cache as one fingerprint per slot (a hash of the token prefix ending at that
position), writes the step's slots first and then checks that every position a sampling
request attends holds its own prefix: a wrong prefix-cache hit, a block reused while shared, or
a bad resume shows up as a mismatch. Tokens come from a fixed script. With KV layer groups
(`sliding_windows`), block ids arrive group-major; each group's slots hold (group,
fingerprint), and a sliding-window group is checked over its window only (the keys its layers
read), where no null block may stand.
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
    groups: list[list[int]]  # block ids per KV layer group
    num_computed: int
    fingerprints: list[int] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        return self.groups[0]

    def fingerprint(self, pos: int) -> int:
        while len(self.fingerprints) <= pos:
            prev = self.fingerprints[-1] if self.fingerprints else 17
            self.fingerprints.append(hash((prev, self.tokens[len(self.fingerprints)])))
        return self.fingerprints[pos]


class ScriptedWorker:
    def __init__(self, num_blocks: int, block_size: int, script: TokenScript = default_script,
                 check_kv: bool = True, sliding_windows: tuple[int, ...] = (0,)) -> None:
        self.block_size = block_size
        self.windows = sliding_windows
        self.script = script
        self.check_kv = check_kv
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
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
        for req_id in so.preempted_req_ids:  # its KV is gone until it resumes
            self.states[req_id].groups = [[] for _ in self.windows]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"handle {new.req_id} is already live"
            assert new.num_computed_tokens % self.block_size == 0
            self.states[new.req_id] = _State(new.request_id, list(new.prompt_token_ids),
                                             self._split(new.block_ids),
                                             new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            if req_id in cached.resumed_req_ids:
                state.groups = self._split(cached.new_block_ids[i])
                state.num_computed = cached.num_computed_tokens[i]
            else:
                assert cached.num_computed_tokens[i] == state.num_computed
                for blocks, new in zip(state.groups, self._split(cached.new_block_ids[i] or [])):
                    blocks += new

    def _split(self, block_ids: list[int]) -> list[list[int]]:
        """Group-major ids -> one list per group, all of equal length."""
        n = len(block_ids) // len(self.windows)
        assert n * len(self.windows) == len(block_ids), "groups of unequal length"
        return [list(block_ids[g * n:(g + 1) * n]) for g in range(len(self.windows))]

    def _slot(self, state: _State, pos: int, group: int = 0) -> int:
        block = state.groups[group][pos // self.block_size]
        assert block != 0, f"{state.request_id}: the null block at position {pos}"
        return block * self.block_size + pos % self.block_size

    def _write_kv(self, state: _State, n: int) -> None:
        end = state.num_computed + n
        assert 0 < n and end <= len(state.tokens), "scheduled past the known tokens"
        assert len(state.block_ids) * self.block_size >= end, "not enough blocks for the step"
        for pos in range(state.num_computed, end):
            for g in range(len(self.windows)):
                self.kv[self._slot(state, pos, g)] = (g, state.fingerprint(pos))
        state.num_computed = end

    def _check_kv(self, state: _State) -> None:
        """The keys the last computed token attended, in every group."""
        if not self.check_kv:
            return
        last = state.num_computed - 1
        for g, window in enumerate(self.windows):
            for pos in range(max(0, last - window + 1) if window else 0, last + 1):
                assert self.kv[self._slot(state, pos, g)] == (g, state.fingerprint(pos)), (
                    f"{state.request_id}: group {g}'s KV at position {pos} is not this "
                    "request's prefix")
