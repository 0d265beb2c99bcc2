"""`deltaserve journal timeline`: every request over steps, above tokens per step and KV usage."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocol import EngineCoreOutputs
from replay.journal_tools import step_rows
from replay.recorded_run import RecordedRun

# Cell states of the request-by-step picture.
ABSENT, WAITING, PREFILL, DECODE, PREEMPTED, IDLE, FINISHED = range(7)
COLORS = ["#ffffff", "#d0d0d0", "#3b6fd4", "#3aa655", "#d9453b", "#f2c14e", "#222222"]
LABELS = ["", "waiting", "prefill chunk", "decode", "preempted", "running, not scheduled",
          "finished"]


@dataclass
class _Life:
    arrival: int
    prompt_len: int = 0
    states: dict[int, int] = field(default_factory=dict)  # step -> state
    finish: int | None = None


def request_states(run: RecordedRun) -> tuple[list[str], np.ndarray]:
    """Request ids in arrival order and their state at each step: [requests, steps]."""
    lives: dict[str, _Life] = {}
    for record in run.records:
        for message in run.frontend_messages(record):
            if hasattr(message, "prompt_token_ids"):
                lives.setdefault(message.request_id, _Life(record.step + 1,
                                                            len(message.prompt_token_ids)))
        if isinstance(record.message, EngineCoreOutputs):
            for out in record.message.outputs:
                if out.finish_reason and out.request_id in lives:
                    lives[out.request_id].finish = record.step
    names: dict[int, str] = {}
    for s in run.steps:
        _mark_step(s.scheduler_output, lives, names)
    num_steps = max((s.step for s in run.steps), default=0) + 1
    ids = list(lives)
    grid = np.full((len(ids), num_steps), ABSENT, np.int8)
    for i, request_id in enumerate(ids):
        _fill_row(grid[i], lives[request_id])
    return ids, grid


def _mark_step(so, lives: dict[str, _Life], names: dict[int, str]) -> None:
    for new in so.scheduled_new_reqs:
        names[new.req_id] = new.request_id
    computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    computed.update(zip(so.scheduled_cached_reqs.req_ids,
                        so.scheduled_cached_reqs.num_computed_tokens))
    for handle in so.num_scheduled_tokens:
        life = lives.get(names.get(handle, ""))
        if life is not None:
            life.states[so.step] = DECODE if computed[handle] >= life.prompt_len else PREFILL
    for handle in so.preempted_req_ids:
        life = lives.get(names.get(handle, ""))
        if life is not None:
            life.states[so.step] = PREEMPTED


def _fill_row(row: np.ndarray, life: _Life) -> None:
    end = life.finish if life.finish is not None else len(row) - 1
    state = WAITING
    for step in range(life.arrival, min(end, len(row) - 1) + 1):
        if step in life.states:
            state = life.states[step]
            row[step] = state
        else:  # between events: preempted stays preempted, a scheduled request idles
            row[step] = state if state in (WAITING, PREEMPTED) else IDLE
    if life.finish is not None and life.finish < len(row):
        row[life.finish] = FINISHED


def draw(path: str, output: str) -> int:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("deltaserve journal timeline draws with matplotlib, which the "
                         "runtime install leaves out: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    run = RecordedRun(path)
    ids, grid = request_states(run)
    rows = step_rows(run)
    steps = [r.step for r in rows]
    fig, (top, mid, low) = plt.subplots(3, 1, sharex=True, figsize=(12, 8),
                                        gridspec_kw={"height_ratios": [6, 1.5, 1.5]})
    top.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(COLORS),
               vmin=0, vmax=len(COLORS) - 1)
    top.set_ylabel(f"requests ({len(ids)}, by arrival)")
    fig.suptitle(f"{path}: {len(ids)} requests, {len(steps)} steps")
    top.legend(handles=[Patch(color=c, label=t) for c, t in zip(COLORS[1:], LABELS[1:])],
               loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, ncol=6, frameon=False)
    mid.bar(steps, [r.tokens for r in rows], width=1.0, color="#3b6fd4", label="scheduled")
    if any(r.drafts for r in rows):  # speculative decoding: accepted draft tokens per step
        mid.bar(steps, [r.accepted for r in rows], width=1.0, color="#3aa655",
                label="accepted drafts")
        mid.legend(loc="upper right", fontsize=8, frameon=False)
    mid.set_ylabel("tokens/step")
    total = (run.ready.num_blocks - 1) if run.ready else max((r.kv_blocks for r in rows), default=0)
    low.plot(steps, [r.kv_blocks / max(total, 1) * 100 for r in rows], color="#d9453b")
    low.set_ylabel("KV used %")
    low.set_ylim(0, 105)
    low.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    print(f"wrote {output}: {len(ids)} requests over {len(steps)} steps")
    if run.damage is not None:  # drawn from what was readable
        print(f"error: {run.damage}")
        return 1
    return 0
