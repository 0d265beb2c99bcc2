"""Replaying a journal: into fresh workers, into a fresh scheduler, or one step's inputs to disk."""
from __future__ import annotations

import json
import os
import shutil

import msgspec
import numpy as np
import zmq

from common.process import make_runtime_dir
from engine_core.engine_core import EngineCore
from engine_core.workers.worker_group import WorkerGroup
from protocol import Channel, Codec, ModelRunnerOutput, SchedulerOutput
from replay.recorded_run import Print, RecordedRun, readable, unified_diff

_TRUNCATED = "the journal is truncated: only what it holds was replayed"


def open_run(path: str, allow_truncated: bool = False, out: Print = print) -> RecordedRun:
    """A journal fit for replay: complete, or truncated if allowed (then said so)."""
    run = RecordedRun(path)
    run.require_intact(allow_truncated)
    if run.truncated:
        out(f"warning: {run.damage}; replaying the {len(run.steps)} steps before it")
    return run


def replay_workers(path: str, model: str | None = None, tensor_parallel_size: int | None = None,
                   until_step: int | None = None, out: Print = print,
                   allow_truncated: bool = False) -> int:
    """Feed the recorded steps to fresh workers and compare their answers with the recorded
    ones. 0 when every step matches, 1 at the first divergence (printed). A truncated
    journal (if allowed) is replayed up to its last answered step."""
    run = open_run(path, allow_truncated, out)
    config = msgspec.structs.replace(
        run.header.engine_config, model=model or run.header.engine_config.model,
        tensor_parallel_size=tensor_parallel_size or run.header.world_size,
        num_gpu_blocks_override=run.ready.num_blocks, max_model_len=run.ready.max_model_len,
        kv_cache_memory_bytes=None, record_path=None, worker_address=None, local_ranks=None,
        distributed_executor_backend="mp", kv_events_config=None)
    steps = [s for s in run.steps if until_step is None or s.step <= until_step]
    while run.truncated and steps and steps[-1].model_runner_output is None:
        steps.pop()  # sent, but the journal ends before its answer
    names = run.request_names()
    context, runtime_dir = zmq.Context(), make_runtime_dir()
    workers = WorkerGroup(config, context, runtime_dir)
    try:
        workers.start()
        for step in steps:
            got = workers.execute_frame(step.frame, step.step)
            problem = _compare_outputs(step.model_runner_output, got, names)
            if problem:
                out(f"step {step.step} diverges:\n{problem}")
                return 1
        out(f"all {len(steps)} steps match ({os.path.basename(path)}, tensor parallel "
            f"{config.tensor_parallel_size}{'; ' + _TRUNCATED if run.truncated else ''})")
        return 0
    finally:
        workers.shutdown()
        context.term()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _compare_outputs(recorded: ModelRunnerOutput | None, got: ModelRunnerOutput,
                     names: dict[int, str]) -> str:
    if recorded is None:
        return "the journal has no answer for this step"
    if list(recorded.req_ids) != list(got.req_ids):
        return f"  requests: recorded {recorded.req_ids}, replayed {got.req_ids}"
    lines = [f"  request {names.get(h, '?')} (handle {h}): recorded {a}, replayed {b}"
             for h, a, b in zip(got.req_ids, recorded.sampled_token_ids, got.sampled_token_ids)
             if a != b]
    if recorded.draft_token_ids != got.draft_token_ids:
        lines.append(f"  draft proposals: recorded {_drafts(recorded)}, replayed {_drafts(got)}")
    lines += _pooled_differences(recorded, got, names)
    return "\n".join(lines)


# Pooled results are floats: a replay matches when each differs from its recording by at
# most this much, relative to the recording's largest magnitude (threads may sum in
# another order).
POOLED_RTOL = 1e-4


def _pooled_differences(recorded: ModelRunnerOutput, got: ModelRunnerOutput,
                        names: dict[int, str]) -> list[str]:
    """A line per request whose pooled result differs (present or absent, size, values)."""
    before = recorded.pooler_output or [None] * len(recorded.req_ids)
    after = got.pooler_output or [None] * len(got.req_ids)
    lines = []
    for h, a, b in zip(got.req_ids, before, after):
        if a is None and b is None:
            continue
        va = None if a is None else np.frombuffer(a, "<f4")
        vb = None if b is None else np.frombuffer(b, "<f4")
        if va is None or vb is None or va.shape != vb.shape:
            lines.append(f"  request {names.get(h, '?')} (handle {h}): pooled result recorded "
                         f"{_shape(va)}, replayed {_shape(vb)}")
            continue
        scale = max(float(np.abs(va).max(initial=0.0)), 1e-30)
        worst = float(np.abs(va - vb).max(initial=0.0))
        if worst > POOLED_RTOL * scale:
            lines.append(f"  request {names.get(h, '?')} (handle {h}): pooled result differs "
                         f"by {worst:.3g} (recorded magnitude {scale:.3g})")
    return lines


def _shape(vector: np.ndarray | None) -> str:
    return "nothing" if vector is None else f"{len(vector)} floats"


def _drafts(output: ModelRunnerOutput) -> dict[int, list[int]] | None:
    return None if output.draft_token_ids is None else output.draft_token_ids.as_dict()


def replay_scheduler(path: str, out: Print = print, allow_truncated: bool = False) -> int:
    """Feed the recorded requests, grammar events and model answers into a fresh scheduler;
    its step messages must be byte-identical to the recorded ones. 0 if so, 1 at the first
    difference. Constrained requests have their grammars compiled here, when the journal says
    they became ready (the recorded model directory's tokenizer is needed for that)."""
    run = open_run(path, allow_truncated, out)
    engine = EngineCore.from_config(run.header.engine_config, None, run.ready.num_blocks,
                                    run.ready.max_model_len, run.ready.vocab_size,
                                    run.ready.sliding_windows)
    codec = Codec(Channel.CORE_TO_WORKER)
    pending: dict[int, SchedulerOutput] = {}  # by step: async scheduling keeps two in flight
    steps = 0
    try:
        for record in run.records:
            for message in run.frontend_messages(record):
                engine.handle(message)
            if isinstance(record.message, SchedulerOutput):
                decided = engine.schedule()
                if bytes(codec.encode(decided)) != record.frame:
                    out(f"step {record.message.step}: the scheduler decides differently\n"
                        + unified_diff(readable(record.message), readable(decided)))
                    return 1
                pending[decided.step] = decided
                steps += 1
            elif isinstance(record.message, ModelRunnerOutput) and record.peer == 0 \
                    and record.message.step in pending:
                engine.update_from_output(pending.pop(record.message.step), record.message)
    finally:
        engine.structured_output.shutdown()
    out(f"all {steps} scheduler steps are byte-identical"
        + (f" ({_TRUNCATED})" if run.truncated else ""))
    return 0


def dump_step(path: str, step: int, out_dir: str, out: Print = print,
              allow_truncated: bool = False) -> int:
    """Write a worker's inputs for `step` (token batch, positions, slots, block table,
    sampling params) as .npy/.json files, rebuilt from the recorded messages alone."""
    import torch

    from worker.input_batch import InputBatch
    from worker.step_inputs import prepare_step
    run = open_run(path, allow_truncated, out)
    config = run.header.engine_config
    batch = InputBatch(run.ready.max_model_len, config.block_size, torch.device("cpu"))
    for recorded in run.steps:
        so = recorded.scheduler_output
        batch.apply(so)
        if so.total_num_scheduled_tokens == 0:
            continue
        inputs = prepare_step(batch, so)
        if so.step == step:
            _write_step(out_dir, so, inputs, batch)
            out(f"wrote step {step} ({so.total_num_scheduled_tokens} tokens, "
                f"{len(inputs.req_ids)} requests) to {out_dir}")
            return 0
        answer = recorded.model_runner_output
        if answer is not None:  # the tokens the workers appended after this step
            tokens = [t for t in answer.sampled_token_ids if t]  # the sampled ones, in order
            rows = inputs.rows[inputs.sampled]
            if inputs.num_drafts is not None:
                batch.append_verified(rows, tokens, inputs.num_drafts[inputs.sampled])
            elif tokens:
                batch.append_tokens(rows, [t[0] for t in tokens])
    out(f"step {step} is not in the journal (steps 1..{len(run.steps)})")
    return 1


def _write_step(out_dir: str, so: SchedulerOutput, inputs, batch) -> None:
    os.makedirs(out_dir, exist_ok=True)
    meta = inputs.metadata
    arrays = {"input_ids": inputs.input_ids, "positions": inputs.positions,
              "slot_mapping": meta.slot_mapping, "query_start_loc": meta.query_start_loc,
              "seq_lens": meta.seq_lens, "block_table": meta.block_table}
    for name, tensor in arrays.items():
        np.save(os.path.join(out_dir, f"{name}.npy"), tensor.numpy())
    requests = [{"handle": h, "request_id": batch.request_ids[row],
                 "sampling_params": msgspec.to_builtins(batch.sampling.params[row])}
                for h, row in zip(inputs.req_ids, inputs.rows.tolist())]
    with open(os.path.join(out_dir, "requests.json"), "w") as f:
        json.dump({"step": so.step, "requests": requests,
                   "query_lens": meta.query_lens_cpu, "seq_lens": meta.seq_lens_cpu}, f,
                  indent=1)
    with open(os.path.join(out_dir, "scheduler_output.json"), "w") as f:
        f.write(readable(so))
