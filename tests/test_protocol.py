"""Wire messages: round trips, compactness, and bad frames becoming ProtocolError."""
from __future__ import annotations

import pickle
import subprocess
import sys

import msgspec
import pytest

from protocol import (
    HEADER,
    AbortRequests,
    AddRequest,
    CachedRequestData,
    Channel,
    Codec,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    IntColumn,
    ModelRunnerOutput,
    NewRequestData,
    ProtocolError,
    SampleLogprobs,
    SamplingParams,
    SchedulerOutput,
    SchedulerStats,
    ShutdownEngine,
    WorkerError,
    WorkerHello,
    WorkerInit,
    WorkerReady,
    WorkerShutdown,
    to_builtins,
)


def _step() -> SchedulerOutput:
    new = NewRequestData(3, "req-a", [1, 2, 3], SamplingParams(temperature=0.0, seed=7),
                         [4, 5], 0, eos_token_id=2)
    cached = CachedRequestData([0, 1], [17, 40], [None, [9]], [1])
    return SchedulerOutput([new], cached, [3, 1, 5], 9, [2], [6], step=4)


MESSAGES = {
    Channel.CORE_TO_WORKER: [
        _step(), SchedulerOutput(step=1),
        WorkerInit(EngineConfig(model="/m", tensor_parallel_size=2, seed=3), "tcp://127.0.0.1:1"), WorkerShutdown()],
    Channel.WORKER_TO_CORE: [
        ModelRunnerOutput([3, 0], [[5], []], step=4),
        ModelRunnerOutput([1], [[7]], [[SampleLogprobs([7, 8], [-0.1, -2.5], 1)]], step=2),
        WorkerHello(1, 1234, "host"), WorkerReady(0, 100, 2048), WorkerError(1, "boom", 3)],
    Channel.FRONTEND_TO_CORE: [
        AddRequest("r", [1, 2], SamplingParams(stop=["x"], logprobs=2), 12.5, priority=3,
                   eos_token_id=0),
        AbortRequests(["r", "s"]), ShutdownEngine()],
    Channel.CORE_TO_FRONTEND: [
        EngineCoreOutputs([EngineCoreOutput("r", [4], "stop", 9)], 7, SchedulerStats(1, 2, 3, 4)),
        EngineReady(2048, 99, 16), EngineFailed("worker_1 died", "worker_1")],
}


@pytest.mark.parametrize("channel,message", [(c, m) for c, ms in MESSAGES.items() for m in ms])
def test_round_trip(channel, message):
    codec = Codec(channel)
    frame = codec.encode(message)
    assert bytes(frame[:2]) == HEADER
    decoded = codec.decode(bytes(frame))
    assert decoded == message and type(decoded) is type(message)
    assert codec.encode(decoded) == frame  # stable bytes: what replay relies on


def test_num_scheduled_tokens_is_a_dict_in_step_order():
    so = _step()
    assert so.scheduled_req_ids == [3, 0, 1] and so.scheduled_token_counts.tolist() == [3, 1, 5]
    assert so.num_scheduled_tokens == {3: 3, 0: 1, 1: 5}
    assert list(so.num_scheduled_tokens) == [3, 0, 1]
    decoded = Codec(Channel.CORE_TO_WORKER).decode(Codec(Channel.CORE_TO_WORKER).encode(so))
    assert list(decoded.num_scheduled_tokens.items()) == [(3, 3), (0, 1), (1, 5)]
    assert to_builtins(so)[3] == {3: 3, 0: 1, 1: 5}


def test_one_token_count_per_scheduled_request():
    with pytest.raises(ValueError, match="must be exactly the scheduled handles"):
        SchedulerOutput(scheduled_cached_reqs=CachedRequestData([1], [0], [None]),
                        num_scheduled_tokens={1: 1, 2: 1})


def _bad_frames() -> list[tuple[bytes, str]]:
    enc = msgspec.msgpack.encode
    add = [10, "r", [1], [1, 1.0, 1.0, 0, 0.0], 1.0]
    return [
        (b"", "not a deltaserve frame"),
        (b"\x00garbage", "not a deltaserve frame"),
        (bytes([HEADER[0], 99]) + enc(add), "protocol version 99"),
        (HEADER + b"\xc1\xc1", "malformed"),
        (HEADER + enc([77, 1]), "malformed"),  # unknown tag
        (HEADER + enc([10, "r", "not tokens", [1], 1.0]), "malformed"),
        (HEADER + enc([10, "r", [1], [1, -0.5], 1.0]), "temperature must be non-negative"),
        (HEADER + enc([10, "r", [1], [1, 1.0, 0.0], 1.0]), "top_p must be in"),
        (HEADER + enc(add)[:-3], "malformed"),  # truncated
    ]


@pytest.mark.parametrize("frame,message", _bad_frames())
def test_bad_frames_raise_protocol_error_and_decoder_survives(frame, message):
    codec = Codec(Channel.FRONTEND_TO_CORE)
    with pytest.raises(ProtocolError, match=message):
        codec.decode(frame)
    good = AbortRequests(["x"])
    assert codec.decode(codec.encode(good)) == good


def test_bad_column_frames():
    codec = Codec(Channel.CORE_TO_WORKER)
    col = lambda values: IntColumn(values, "H").to_wire()  # noqa: E731

    def frame(counts, req_ids=col([7])):
        return HEADER + msgspec.msgpack.encode([1, [], [req_ids, col([0]), [None], []],
                                                counts, 1, [], [], 1])
    assert codec.decode(frame(col([1]))).num_scheduled_tokens == {7: 1}
    with pytest.raises(ProtocolError, match="token counts for 1 requests"):
        codec.decode(frame(col([1, 1])))
    for bad in (["x"], b"Z\x00", b"H\x00", b""):
        with pytest.raises(ProtocolError, match="malformed"):
            codec.decode(frame(bad))
    with pytest.raises(ProtocolError, match="one entry per request"):
        codec.decode(frame(col([1]), req_ids=col([7, 8])))


def test_int_column_round_trip():
    column = IntColumn.for_bound([3, 70000], 70001)
    assert column.typecode == "I" and IntColumn.for_bound([1], 200).typecode == "B"
    assert column.tolist() == [3, 70000] and column[1] == 70000 and 3 in column
    assert column == IntColumn([3, 70000], "Q") and column != IntColumn([3], "I")
    assert IntColumn.from_wire(column.to_wire()) == column


def test_decode_step_is_compact():
    """A steady-state decode step of 256 requests fits in 8 bytes per request."""
    n = 256
    cached = CachedRequestData(list(range(n)), [3000 + 17 * i for i in range(n)], [None] * n)
    so = SchedulerOutput(scheduled_cached_reqs=cached,
                         num_scheduled_tokens=dict.fromkeys(range(n), 1),
                         total_num_scheduled_tokens=n, step=123456)
    frame = Codec(Channel.CORE_TO_WORKER).encode(so)
    assert len(frame) / n <= 8.0
    assert len(frame) < len(pickle.dumps(so))


def test_protocol_imports_no_torch():
    code = "import sys, protocol; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
