"""`deltaserve journal show|diff`: reading journals step by step. Both show what is readable,
then report a damaged (or truncated) journal on one line and return 1."""
from __future__ import annotations

from dataclasses import dataclass

from replay.recorded_run import Print, RecordedRun, RecordedStep, readable, unified_diff


@dataclass(frozen=True, slots=True)
class StepRow:
    step: int
    new: int
    cached: int
    resumed: int
    preempted: int
    finished: int
    tokens: int
    kv_blocks: int  # distinct blocks held by live requests after this step's allocations
    gap_ms: float  # time since the previous step was sent
    drafts: int = 0  # draft tokens verified (speculative decoding)
    accepted: int = 0  # of which the target accepted (from rank 0's answer)


def step_rows(run: RecordedRun) -> list[StepRow]:
    """Per-step figures, derived from the step messages alone (no scheduler code involved)."""
    owned: dict[int, list[int]] = {}
    rows, previous = [], None
    for s in run.steps:
        so = s.scheduler_output
        for handle in so.finished_req_ids:
            owned.pop(handle, None)
        for handle in so.preempted_req_ids:
            owned[handle] = []
        for new in so.scheduled_new_reqs:
            owned[new.req_id] = list(new.block_ids)
        cached = so.scheduled_cached_reqs
        for handle, blocks in zip(cached.req_ids, cached.new_block_ids):
            if handle in cached.resumed_req_ids:
                owned[handle] = list(blocks)
            elif blocks:
                owned[handle] += blocks
        gap = 0.0 if previous is None else (s.timestamp_ns - previous) / 1e6
        previous = s.timestamp_ns
        rows.append(StepRow(so.step, len(so.scheduled_new_reqs), cached.num_reqs,
                            len(cached.resumed_req_ids), len(so.preempted_req_ids),
                            len(so.finished_req_ids), so.total_num_scheduled_tokens,
                            len({b for blocks in owned.values() for b in blocks}), gap,
                            *_verified(s)))
    return rows


def _verified(step: RecordedStep) -> tuple[int, int]:
    """(draft tokens the step verified, how many the target accepted)."""
    spec = step.scheduler_output.scheduled_spec_decode_tokens
    if spec is None:
        return 0, 0
    answer = step.model_runner_output
    emitted = dict(zip(answer.req_ids, map(len, answer.sampled_token_ids))) if answer else {}
    drafts = sum(spec.num_tokens)
    return drafts, sum(max(emitted.get(h, 0) - 1, 0) for h in spec.req_ids)


def show(path: str, out: Print = print) -> int:
    run = RecordedRun(path)
    config = run.header.engine_config
    total = run.ready.num_blocks - 1 if run.ready else "?"
    out(f"{path}: {config.model}, tensor parallel {run.header.world_size}, "
        f"{len(run.steps)} steps, {total} usable KV blocks of {config.block_size} tokens")
    spec = config.speculative_config is not None  # then also drafts verified, accepted
    out(f"{'step':>6} {'new':>4} {'cached':>6} {'resumed':>7} {'preempt':>7} {'finish':>6} "
        f"{'tokens':>6} {'kv_blocks':>9} {'gap_ms':>8}" + (" drafts accepted" if spec else ""))
    for r in step_rows(run):
        out(f"{r.step:>6} {r.new:>4} {r.cached:>6} {r.resumed:>7} {r.preempted:>7} "
            f"{r.finished:>6} {r.tokens:>6} {r.kv_blocks:>9} {r.gap_ms:>8.2f}"
            + (f" {r.drafts:>6} {r.accepted:>8}" if spec else ""))
    if run.damage is not None:
        out(f"error: {run.damage}")
        return 1
    return 0


def diff(path_a: str, path_b: str, out: Print = print) -> int:
    """The first step where two journals differ (step messages or answers), then any damage
    of either journal; 0 if they agree and both are intact."""
    a, b = RecordedRun(path_a), RecordedRun(path_b)
    differs = _first_difference(a, b, out)
    for run in (a, b):
        if run.damage is not None:
            out(f"error: {run.damage}")
    if differs or a.damage is not None or b.damage is not None:
        return 1
    out(f"no difference in {len(a.steps)} steps")
    return 0


def _first_difference(a: RecordedRun, b: RecordedRun, out: Print) -> bool:
    names = (a.path, b.path)
    for sa, sb in zip(a.steps, b.steps):
        if sa.frame != sb.frame:
            out(f"step {sa.step}: the step messages differ\n"
                + unified_diff(readable(sa.scheduler_output), readable(sb.scheduler_output),
                               names))
            return True
        if _answer(sa) != _answer(sb):
            out(f"step {sa.step}: the model outputs differ\n"
                + unified_diff(_answer(sa), _answer(sb), names))
            return True
    if len(a.steps) != len(b.steps):
        out(f"the journals agree for {min(len(a.steps), len(b.steps))} steps, then one ends "
            f"({len(a.steps)} vs {len(b.steps)} steps)")
        return True
    return False


def _answer(step: RecordedStep) -> str:
    return readable(step.model_runner_output) if step.model_runner_output else "(none)"
