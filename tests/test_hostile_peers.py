"""Issue 12's probes, as a hostile user and a faulty machine would run them: strangers on the
sockets, bad input, stopped processes, floods. Every case must leave the engine serving (or,
for a dead or hung process, end it with an EngineDeadError naming that process)."""
from __future__ import annotations

import math
import os
import signal
import time

import msgspec
import psutil
import pytest
import zmq
from engine_utils import engine_pids, wait_gone
from model_utils import make_tiny_model

from common.worker_auth import new_secret
from engine_core.workers.worker_group import WorkerGroup
from launch import LLM, EngineDeadError, SamplingParams
from protocol import HEADER, Channel, Codec, EngineConfig, WorkerError, WorkerHello

pytestmark = pytest.mark.slow  # real engine processes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("hostile") / "m"), "llama", tokenizer=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", num_gpu_blocks_override=64, max_model_len=256, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny):
    with _llm(tiny) as llm:
        llm.expected = _greedy(llm)
        yield llm


def _greedy(llm: LLM) -> list[int]:
    return llm.generate("def add", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _stranger(llm: LLM, socket_type: int, name: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{llm.engine.runtime_dir}/{name}")
    return sock


def test_strangers_on_the_worker_socket_change_nothing(llm):
    """Multipart messages, unauthenticated hellos and error reports, garbage: all dropped."""
    worker_codec = Codec(Channel.WORKER_TO_CORE)
    sock = _stranger(llm, zmq.DEALER, "workers")
    sock.send_multipart([b"one", b"two"])
    sock.send_multipart([b"a", b"b", b"c"])
    sock.send(worker_codec.encode(WorkerHello(0, os.getpid(), "evil", b"\0" * 32)))
    sock.send(worker_codec.encode(WorkerError(0, "fake failure", 1)))
    sock.send(b"\xff" * 100)
    assert not sock.poll(500), "a stranger must not be answered (no WorkerInit)"
    sock.close()  # a stranger leaving is not a worker dying
    time.sleep(0.3)
    assert _greedy(llm) == llm.expected


def test_the_front_end_link_takes_no_second_peer(llm):
    """The request and output sockets are PAIRs: frames from a later peer never arrive."""
    for name in ("input", "output"):
        sock = _stranger(llm, zmq.PAIR, name)
        for _ in range(20):
            try:
                sock.send(b"\xd5\x01" + b"\x00" * (1 << 20), zmq.NOBLOCK)
            except zmq.Again:
                break
        sock.close()
    assert _greedy(llm) == llm.expected


def _mutated(**changes) -> SamplingParams:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)  # as a caller might, after construction
    return params


@pytest.mark.parametrize("prompt,params,kwargs,match", [
    ({"prompt_token_ids": [5, True]}, None, {}, "prompt_token_ids must be ints"),
    ({"prompt_token_ids": "5 6"}, None, {}, "list of ints"),
    ({"prompt_token_ids": [5, -3]}, None, {}, "negative"),
    ("x", _mutated(temperature=math.nan), {}, "temperature"),
    ("x", _mutated(max_tokens=0), {}, "max_tokens"),
    ("x", _mutated(top_k=-5), {}, "top_k"),
    ("x", _mutated(seed=2 ** 64), {}, "seed"),
    ("x", _mutated(max_tokens=2 ** 64), {}, "max_tokens"),
    ("x", {"temperature": 0.0}, {}, "sampling_params must be SamplingParams"),
    ("x", SamplingParams(logprobs=21), {}, "max_logprobs"),
    ("x", SamplingParams(n=129), {}, "n must be at most"),
    ("bad \ud800 text", None, {}, "not valid Unicode"),
    ("x", None, {"priority": ["high"]}, "priority"),
])
def test_bad_input_raises_value_error_naming_the_field(llm, prompt, params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False, **kwargs)
    assert _greedy(llm) == llm.expected


def test_the_engine_core_answers_frames_it_cannot_decode(llm):
    """A client other than `LLM` sends requests the engine core cannot decode or must refuse:
    each request id it can read gets an error, never silence."""
    undecodable = HEADER + msgspec.msgpack.encode(
        [13, [[10, "bad-1", ["not", "ids"], [], 0.0], [10, "bad-2", 7]]])
    negative = HEADER + msgspec.msgpack.encode(
        [10, "bad-3", [-5, 7], [1, 0.0], 0.0])  # decodes; the prompt check refuses it
    llm.engine.input.send(undecodable)
    llm.engine.input.send(negative)
    errors: dict[str, str] = {}
    deadline = time.monotonic() + 5
    while len(errors) < 3 and time.monotonic() < deadline:
        for out in llm.engine.get_outputs():
            errors[out.request_id] = out.error
    assert set(errors) == {"bad-1", "bad-2", "bad-3"}, errors
    assert "could not decode" in errors["bad-1"] and "negative" in errors["bad-3"]
    assert _greedy(llm) == llm.expected


@pytest.mark.parametrize("victim", ["worker_1", "engine_core"])
def test_a_stopped_process_ends_the_engine_within_two_seconds(tiny, victim):
    llm = _llm(tiny, tensor_parallel_size=2)
    pids = engine_pids(llm)
    core = psutil.Process(pids[0])
    target = core if victim == "engine_core" else next(
        p for p in core.children() if "worker_1" in " ".join(p.cmdline()))
    try:
        target.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"{victim}.*stopped") as err:
            llm.generate(["def add"] * 2, SamplingParams(max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
        assert err.value.process == victim
        assert time.monotonic() - stopped_at < 2.0
    finally:
        try:
            target.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass  # killed when it was found stopped
        llm.shutdown()
    assert not wait_gone(pids, 5.0)


def test_a_worker_death_between_calls_is_blamed_on_the_worker(tiny):
    llm = _llm(tiny, tensor_parallel_size=2)
    pids = engine_pids(llm)
    llm.generate("x", GREEDY, use_tqdm=False)
    worker = next(p for p in psutil.Process(pids[0]).children()
                  if "worker_1" in " ".join(p.cmdline()))
    worker.send_signal(signal.SIGKILL)
    time.sleep(1.0)  # the engine core notices while idle, reports and exits
    with pytest.raises(EngineDeadError, match="worker_1") as err:
        llm.generate("x", GREEDY, use_tqdm=False)
    assert err.value.process == "worker_1"
    llm.shutdown()
    assert not wait_gone(pids, 5.0)


def test_a_remote_rendezvous_is_reachable_from_other_hosts(tmp_path):
    """With workers on other hosts and a wildcard address, the rendezvous names this host's
    address, not loopback; with every rank local it is a file in the private directory."""
    secret = tmp_path / "secret"
    secret.write_text(new_secret())
    config = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, local_ranks=[0],
                          worker_address="tcp://0.0.0.0:0", worker_secret_file=str(secret))
    group = WorkerGroup(config, zmq.Context.instance(), str(tmp_path))
    try:
        assert not group._rendezvous(all_local=False).startswith("tcp://127.")
        assert group._rendezvous(all_local=True) == f"file://{tmp_path}/rendezvous"
    finally:
        group.shutdown()


def test_a_tcp_worker_address_needs_a_secret(tmp_path):
    with pytest.raises(ValueError, match="worker_secret_file"):
        EngineConfig(model=str(tmp_path), worker_address="tcp://127.0.0.1:5000")
