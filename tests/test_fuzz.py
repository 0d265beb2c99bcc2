"""Seeded fuzzing of every socket: 10,000 random and mutated frames each, then the engine
must still serve, token for token as before, without having grown in memory. A failure
prints the seed; rerun with DELTASERVE_FUZZ_SEED=<seed> to replay it."""
from __future__ import annotations

import os
import random
import time

import msgspec
import psutil
import pytest
import zmq
from model_utils import make_tiny_model

from launch import LLM, SamplingParams
from protocol import (
    HEADER,
    AbortRequests,
    AddRequest,
    Channel,
    Codec,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    ProtocolError,
    SchedulerOutput,
    ShutdownEngine,
    WorkerError,
    WorkerHello,
)

SEED = int(os.environ.get("DELTASERVE_FUZZ_SEED", "1234"))
FRAMES = 10_000
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_PARAMS = SamplingParams(temperature=0.0, max_tokens=2)
SEEDS = {
    Channel.FRONTEND_TO_CORE: [AddRequest("r", [1, 2, 3], _PARAMS, 0.0), AbortRequests(["r"])],
    Channel.CORE_TO_FRONTEND: [EngineCoreOutputs([EngineCoreOutput("r", [5], "stop")], 3)],
    Channel.CORE_TO_WORKER: [SchedulerOutput([NewRequestData(0, "r", [1, 2], _PARAMS, [1])],
                                             num_scheduled_tokens={0: 2},
                                             total_num_scheduled_tokens=2, step=1)],
    Channel.WORKER_TO_CORE: [WorkerHello(0, 1, "h", b"x" * 32), WorkerError(0, "e", 1),
                             ModelRunnerOutput([0], [[5]], step=1)],
}


def frames(channel: Channel, rng: random.Random, count: int = FRAMES):
    """Random bytes, valid frames with flipped, cut or appended bytes, and valid headers on
    random msgpack: what a confused or hostile peer sends."""
    codec = Codec(channel)
    valid = [bytes(codec.encode(m)) for m in SEEDS[channel]]
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:
            yield rng.randbytes(rng.randrange(0, 64))
        elif kind == 1:
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            yield bytes(frame)
        elif kind == 2:
            frame = rng.choice(valid)
            yield frame[:rng.randrange(len(frame))] + rng.randbytes(rng.randrange(0, 8))
        else:
            junk = [rng.choice([rng.randrange(-2**63, 2**64), rng.random(), "x" * 3, None,
                                [], {}, b"b"]) for _ in range(rng.randrange(1, 6))]
            yield HEADER + msgspec.msgpack.encode([rng.choice([1, 2, 10, 11, 13, 20, 40])] + junk)


@pytest.mark.parametrize("channel", list(Channel))
def test_decoding_never_raises_anything_but_protocol_error(channel):
    codec, kinds = Codec(channel), 0
    for i, frame in enumerate(frames(channel, random.Random(SEED + channel))):
        try:
            codec.decode(frame)
            kinds += 1
        except ProtocolError:
            pass
        except Exception as e:  # noqa: BLE001 - anything else is the bug
            pytest.fail(f"seed {SEED}, frame {i} ({frame[:40].hex()}): {type(e).__name__}: {e}")
    assert kinds < FRAMES  # the generator must mostly produce bad frames


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


@pytest.mark.slow
def test_an_engine_flooded_on_every_socket_still_serves_alike(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "llama", tokenizer=True)
    with LLM(path, dtype="float32", num_gpu_blocks_override=64, max_model_len=256) as llm:
        expected = llm.generate("def add", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        pids = [os.getpid(), llm.engine.proc.pid]
        before = _rss(pids)
        rng = random.Random(SEED)
        stranger = zmq.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(f"ipc://{llm.engine.runtime_dir}/workers")
        for frame in frames(Channel.WORKER_TO_CORE, rng):
            parts = [frame] if rng.random() < 0.9 else [frame, rng.randbytes(4)]
            stranger.send_multipart(parts)
        _flood_engine_input(llm, rng)
        time.sleep(1.0)
        stranger.close()
        got = llm.generate("def add", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        grown = (_rss(pids) - before) >> 20
    assert got == expected, f"seed {SEED}"
    assert grown < 50, f"seed {SEED}: memory grew by {grown} MiB"


def _send_or_fail(llm: LLM, frame: bytes) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            return llm.engine.input.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            if llm.engine.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"seed {SEED}: the engine core stopped reading (exit code "
                            f"{llm.engine.proc.poll()})")
            time.sleep(0.001)


def _flood_engine_input(llm: LLM, rng: random.Random) -> None:
    """The front-end's own link, as a buggy front-end would use it: every mutated frame that
    would not decode to a request or a shutdown (those would be obeyed, rightly)."""
    codec = Codec(Channel.FRONTEND_TO_CORE)
    for frame in frames(Channel.FRONTEND_TO_CORE, rng):
        try:
            message = codec.decode(frame)
        except ProtocolError:
            message = None
        if not isinstance(message, (AddRequest, ShutdownEngine)) and not hasattr(
                message, "requests"):
            _send_or_fail(llm, frame)
    deadline = time.monotonic() + 10
    while llm.engine.get_outputs(200) and time.monotonic() < deadline:
        pass  # error answers to requests whose ids were readable
