"""Recording runs, replaying them, and reading journals."""
from __future__ import annotations

import json
import os
import struct
import zlib

import msgspec
import numpy as np
import pytest
from model_utils import make_tiny_model

from launch import LLM, SamplingParams
from launch.cli.main import main as cli_main
from protocol import Channel, Codec, ModelRunnerOutput, SchedulerOutput
from protocol.journal import (
    PREFIX,
    RECORD,
    TRAILER_BODY,
    JournalError,
    JournalRecord,
    JournalTruncated,
    JournalWriter,
)
from protocol.journal_reader import JournalReader
from replay import journal_tools, replay, timeline
from replay.recorded_run import RecordedRun

PROMPTS = ["def add(a, b):", "The quick brown fox", "x", "Pack my box with five dozen liquor",
           "def add(a, b):\n    return", "print('hello"] * 2

pytestmark = pytest.mark.slow  # real engine processes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("journal") / "m"), "llama",
                           tokenizer=True)


def _record(path: str, tiny: str, stop: bool = True, tp: int = 1, **engine_args) -> list:
    """A run with chunked prefill, prefix hits, preemption, and stop-string aborts (the stop
    string is taken from the model's own greedy text, so it is sure to occur)."""
    with LLM(tiny, dtype="float32", block_size=8, max_num_batched_tokens=16,
             num_gpu_blocks_override=16, max_model_len=256, record_path=path,
             tensor_parallel_size=tp, **engine_args) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
        if stop:
            text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].text
            visible = [c for c in text[len(text) // 2:] if c.strip()]
            greedy = msgspec.structs.replace(greedy, stop=[visible[0]])
        seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)
        outs = llm.generate(PROMPTS, [greedy, seeded] * (len(PROMPTS) // 2), use_tqdm=False)
    return outs


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rec") / "run.journal")
    outs = _record(path, tiny)
    return path, outs


def test_recording_has_everything(recorded):
    path, outs = recorded
    run = RecordedRun(path)
    assert run.damage is None and run.ready is not None
    assert run.header.weights_hash and run.header.versions["torch"].startswith("2.13")
    kinds = {(r.endpoint, r.direction) for r in run.records}
    assert kinds == {("frontend", "in"), ("frontend", "out"), ("worker", "in"),
                     ("worker", "out")}
    messages = [s.scheduler_output for s in run.steps]
    assert [m.step for m in messages] == list(range(1, len(messages) + 1))
    assert any(m.preempted_req_ids for m in messages), "expected preemption"
    assert any(r.num_computed_tokens for m in messages for r in m.scheduled_new_reqs)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs), "expected a stop string"
    assert all(s.model_runner_output is not None for s in run.steps)


def test_worker_and_scheduler_replays_pass(recorded, capsys):
    path, _ = recorded
    assert replay.replay_workers(path) == 0
    assert replay.replay_scheduler(path) == 0
    assert replay.replay_workers(path, tensor_parallel_size=2, until_step=6) == 0
    out = capsys.readouterr().out
    assert "steps match" in out and "byte-identical" in out


def test_an_async_scheduled_run_replays(tiny, tmp_path, capsys):
    """Two steps in flight: answers arrive after the next step was sent, and still pair up."""
    path = str(tmp_path / "async.journal")
    _record(path, tiny, async_scheduling=True)
    run = RecordedRun(path)
    steps = [r.message for r in run.records
             if isinstance(r.message, (SchedulerOutput, ModelRunnerOutput))]
    first_answer = next(i for i, m in enumerate(steps) if isinstance(m, ModelRunnerOutput))
    assert [m.step for m in steps[:first_answer + 1]] == [1, 2, 1], "sent 2 before 1's answer"
    assert any(s.scheduler_output.preempted_req_ids for s in run.steps)
    assert replay.replay_scheduler(path) == 0 and replay.replay_workers(path) == 0
    assert "byte-identical" in capsys.readouterr().out


def _rewrite(src: str, dst: str, change) -> None:
    """Copy a journal, letting `change(record)` return a replacement frame (or None)."""
    reader = iter(JournalReader(src))
    writer = JournalWriter(dst, next(reader))
    for record in reader:
        writer.record(record.channel, change(record) or record.frame, record.step, record.peer)
    writer.close()


def test_perturbed_answer_is_caught_at_its_step(recorded, tmp_path, capsys):
    path, _ = recorded
    codec = Codec(Channel.WORKER_TO_CORE)

    def change(record: JournalRecord):
        m = record.message
        if isinstance(m, ModelRunnerOutput) and m.step == 7 and record.peer == 0:
            tokens = [[t[0] + 1] if t else t for t in m.sampled_token_ids]
            return bytes(codec.encode(msgspec.structs.replace(m, sampled_token_ids=tokens)))
    bad = str(tmp_path / "bad.journal")
    _rewrite(path, bad, change)
    assert replay.replay_workers(bad) == 1
    out = capsys.readouterr().out
    assert out.startswith("step 7 diverges") and "recorded [" in out and "replayed [" in out


def test_scheduler_change_is_reported_at_the_first_differing_step(recorded, capsys,
                                                                  monkeypatch):
    path, _ = recorded
    from engine_core.sched.scheduler import Scheduler
    original = Scheduler.schedule

    def altered(self):
        out = original(self)
        if out.step == 5:  # a scheduler that decides differently from step 5 on
            out.preempted_req_ids = out.preempted_req_ids + [99]
        return out
    monkeypatch.setattr(Scheduler, "schedule", altered)
    assert replay.replay_scheduler(path) == 1
    out = capsys.readouterr().out
    assert out.startswith("step 5: the scheduler decides differently")
    assert "--- recorded" in out and "+++ replayed" in out and "99" in out


def test_truncated_and_corrupted_journals(recorded, tmp_path, capsys):
    path, _ = recorded
    data = open(path, "rb").read()
    cut = str(tmp_path / "cut.journal")
    open(cut, "wb").write(data[:len(data) * 2 // 3])
    run = RecordedRun(cut)
    assert isinstance(run.damage, JournalError) and len(run.steps) > 3
    assert f"byte offset {run.damage.offset}" in str(run.damage)
    with pytest.raises(JournalError, match="truncated"):
        replay.replay_scheduler(cut)
    flipped = bytearray(data)
    # A byte of the body of the record around the middle (not its length: that is another
    # error, tested below).
    middle = max(o for o in _layout(path)[1] if o < len(data) // 2)
    flipped[middle + RECORD.size + 1] ^= 0xFF
    bad = str(tmp_path / "flipped.journal")
    open(bad, "wb").write(bytes(flipped))
    with pytest.raises(JournalError, match=r"checksum mismatch .* at byte offset \d+"):
        list(JournalReader(bad))
    assert journal_tools.show(cut) == 1
    assert "error:" in capsys.readouterr().out
    with pytest.raises(JournalError, match="not a deltaserve journal"):
        list(JournalReader(str(tmp_path / "empty")) if open(str(tmp_path / "empty"), "wb")
             else [])


def _first_abort_step(run: RecordedRun) -> int:
    """The newest step scheduled when the engine core received the run's first abort."""
    return next(r.step for r in run.records if r.channel == Channel.FRONTEND_TO_CORE
                and type(r.message).__name__ == "AbortRequests")


def test_same_requests_and_seeds_give_identical_journals(recorded, tiny, tmp_path, capsys):
    path, outs = recorded
    again = str(tmp_path / "again.journal")
    outs2 = _record(again, tiny)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in outs2]
    a, b = RecordedRun(path), RecordedRun(again)
    # Steps are identical up to the first stop-string abort of either run: when the front-end
    # sees the stop string, and so which step the abort lands before, is a matter of timing.
    limit = min(_first_abort_step(a), _first_abort_step(b))
    assert limit > 5
    assert [s.frame for s in a.steps[:limit]] == [s.frame for s in b.steps[:limit]]
    no_stop_a, no_stop_b = str(tmp_path / "a.journal"), str(tmp_path / "b.journal")
    _record(no_stop_a, tiny, stop=False)
    _record(no_stop_b, tiny, stop=False)
    assert journal_tools.diff(no_stop_a, no_stop_b) == 0
    assert journal_tools.diff(path, no_stop_a) == 1
    assert "differ" in capsys.readouterr().out


def test_show_timeline_and_dump(recorded, tmp_path, capsys):
    path, _ = recorded
    assert journal_tools.show(path) == 0
    lines = capsys.readouterr().out.splitlines()
    run = RecordedRun(path)
    assert len(lines) == 2 + len(run.steps)
    rows = journal_tools.step_rows(run)
    assert max(r.kv_blocks for r in rows) <= run.ready.num_blocks - 1
    png = str(tmp_path / "timeline.png")
    assert timeline.draw(path, png) == 0 and os.path.getsize(png) > 10_000
    ids, grid = timeline.request_states(run)
    assert len(ids) == len(PROMPTS) + 1 and (grid == timeline.PREEMPTED).any()  # +1: stop probe
    assert (grid == timeline.FINISHED).sum(axis=1).tolist() == [1] * len(ids)
    out_dir = str(tmp_path / "dump")
    assert replay.dump_step(path, 4, out_dir) == 0
    so = run.steps[3].scheduler_output
    ids_ = np.load(os.path.join(out_dir, "input_ids.npy"))
    slots = np.load(os.path.join(out_dir, "slot_mapping.npy"))
    assert len(ids_) == len(slots) == np.load(os.path.join(out_dir, "positions.npy")).size \
        == so.total_num_scheduled_tokens
    meta = json.load(open(os.path.join(out_dir, "requests.json")))
    assert meta["step"] == 4 and sum(meta["query_lens"]) == so.total_num_scheduled_tokens
    assert all("temperature" in r["sampling_params"] or r["sampling_params"] is not None
               for r in meta["requests"])


# --- damaged journals: each error is one line naming the file and the byte offset -----------

def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refused(capsys, path: str, *needles: str, readable: bool = False) -> None:
    """`replay` refuses the journal with one line (exit 2); so does `journal show`, or, if
    the damage is after a `readable` header, it shows what it can and ends with that line
    (exit 1)."""
    code, out, err = _cli(capsys, "replay", path, "--scheduler-only", "--allow-truncated")
    assert code == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith(f"deltaserve: error: {path}: ") and "Traceback" not in err
    assert all(n in err for n in needles), err
    code, out, err = _cli(capsys, "journal", "show", path)
    line = out.splitlines()[-1] if readable else err.strip()
    assert (code, len(err.splitlines())) == ((1, 0) if readable else (2, 1)), (out, err)
    assert line.startswith(("error: " if readable else "deltaserve: error: ") + f"{path}: ")
    assert all(n in line for n in needles), line


def _layout(path: str) -> tuple[bytes, list[int]]:
    """The journal's bytes and where each record starts (the first one: the header's end)."""
    return open(path, "rb").read(), [r.offset for r in JournalReader(path).records()]


def _write(tmp_path, name: str, data: bytes) -> str:
    path = str(tmp_path / name)
    open(path, "wb").write(data)
    return path


def test_the_recording_ends_with_its_trailer(recorded):
    path, _ = recorded
    data, offsets = _layout(path)
    count, _ = TRAILER_BODY.unpack_from(data, len(data) - TRAILER_BODY.size)
    assert count == len(offsets) and data[-TRAILER_BODY.size - RECORD.size + 8] == 0xFF


@pytest.mark.parametrize("where", ["record boundary", "header end", "mid-record"])
def test_truncation_is_reported_where_the_file_ends(recorded, tmp_path, capsys, where):
    path, _ = recorded
    data, offsets = _layout(path)
    middle = offsets[len(offsets) // 2]
    cut = {"record boundary": middle, "header end": offsets[0], "mid-record": middle + 7}[where]
    short = _write(tmp_path, "short.journal", data[:cut])
    run = RecordedRun(short)
    assert isinstance(run.damage, JournalTruncated) and run.damage.offset == cut
    assert len(run.records) == (0 if where == "header end" else offsets.index(middle))
    err = _refused_replay(capsys, short)
    assert "truncated" in err and f"at byte offset {cut}" in err
    code, out, err = _cli(capsys, "journal", "show", short)  # readable part, then the damage
    assert code == 1 and err == ""
    assert out.splitlines()[-1] == f"error: {run.damage}"
    assert len(out.splitlines()) == 3 + len(run.steps)


def _refused_replay(capsys, path: str) -> str:
    code, out, err = _cli(capsys, "replay", path, "--scheduler-only")
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (out, err)
    return err


def test_allow_truncated_replays_what_is_there(recorded, tmp_path, capsys):
    path, _ = recorded
    data, offsets = _layout(path)
    half = _write(tmp_path, "half.journal", data[:offsets[len(offsets) // 2] + 5])
    steps = len(RecordedRun(half).steps)
    assert 2 < steps < len(RecordedRun(path).steps)
    code, out, _ = _cli(capsys, "replay", half, "--allow-truncated")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"warning: {half}: truncated"), out
    assert "steps match" in lines[-1] and "truncated" in lines[-1]
    code, out, _ = _cli(capsys, "replay", half, "--scheduler-only", "--allow-truncated")
    assert code == 0 and f"all {steps} scheduler steps are byte-identical" in out


def test_diff_and_timeline_report_truncation(recorded, tmp_path, capsys):
    path, _ = recorded
    data, offsets = _layout(path)
    half = _write(tmp_path, "half.journal", data[:offsets[len(offsets) // 2]])
    code, out, _ = _cli(capsys, "journal", "diff", path, half)
    assert code == 1 and out.splitlines()[-1].startswith(f"error: {half}: truncated")
    code, out, _ = _cli(capsys, "journal", "timeline", half, "-o", str(tmp_path / "t.png"))
    assert code == 1 and out.splitlines()[-1].startswith(f"error: {half}: truncated")
    assert os.path.getsize(tmp_path / "t.png") > 0


def _with_trailer(body: bytes, count: int, crc: int) -> bytes:
    """`body` (header and records) followed by a trailer claiming `count` and `crc`."""
    meta = struct.pack("<BBQQ", 0xFF, 255, 0, 0)
    tail = TRAILER_BODY.pack(count, crc)
    return body + PREFIX.pack(len(tail), zlib.crc32(tail, zlib.crc32(meta))) + meta + tail


def test_a_trailer_that_disagrees_is_corruption(recorded, tmp_path, capsys):
    path, _ = recorded
    data, offsets = _layout(path)
    body = data[:len(data) - RECORD.size - TRAILER_BODY.size]
    # A whole record cut out of the middle: every record is sound, the count is not.
    spliced = body[:offsets[3]] + body[offsets[4]:]
    fake = _write(tmp_path, "spliced.journal", _with_trailer(spliced, len(offsets),
                                                              zlib.crc32(spliced)))
    _refused(capsys, fake, "trailer counts", f"at byte offset {len(spliced)}", readable=True)
    # A record changed with its own checksum fixed: only the whole-journal checksum sees it.
    start = offsets[3] + RECORD.size
    frame = bytearray(body[start:offsets[4]])
    frame[-1] ^= 0x01
    meta = body[offsets[3] + 8:start]
    edited = (body[:offsets[3]] + PREFIX.pack(len(frame), zlib.crc32(frame, zlib.crc32(meta)))
              + meta + bytes(frame) + body[offsets[4]:])
    original = data[len(body) + RECORD.size:]
    fake = _write(tmp_path, "edited.journal", _with_trailer(
        edited, len(offsets), TRAILER_BODY.unpack(original)[1]))
    _refused(capsys, fake, "do not match its checksum", f"at byte offset {len(edited)}",
             readable=True)
    _refused(capsys, _write(tmp_path, "tail.journal", data + b"\0"), "after the trailer",
             f"at byte offset {len(data)}", readable=True)


def test_headers_and_files_that_are_not_journals(recorded, tmp_path, capsys):
    path, _ = recorded
    data, _ = _layout(path)
    bogus = msgspec.msgpack.encode([1, 2, 3])  # a valid checksum over the wrong shape
    start = len(b"DSJRNL02") + PREFIX.size
    _refused(capsys, _write(tmp_path, "bogus.journal", b"DSJRNL02" + PREFIX.pack(
        len(bogus), zlib.crc32(bogus)) + bogus), "not a JournalHeader", "got `array`",
        f"at byte offset {start}")
    _refused(capsys, _write(tmp_path, "old.journal", b"DSJRNL01" + data[8:]), "DSJRNL01",
             "DSJRNL02", "at byte offset 0")
    _refused(capsys, _write(tmp_path, "png.journal", b"\x89PNG\r\n\x1a\n" + data[8:]),
             "not a deltaserve journal", "at byte offset 0")
    _refused(capsys, _write(tmp_path, "cut.journal", data[:start + 5]), "truncated or "
             "corrupted header", "at byte offset 8")
    _refused(capsys, str(tmp_path), "is a directory")
    _refused(capsys, str(tmp_path / "missing.journal"), "no such file")
    unreadable = _write(tmp_path, "locked.journal", data)
    os.chmod(unreadable, 0)
    if not os.access(unreadable, os.R_OK):  # root reads anything
        _refused(capsys, unreadable, "cannot be read")
