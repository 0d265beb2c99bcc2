"""Processes die, misbehave or get interrupted: errors are clear and nothing is left behind."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest
import zmq
from engine_utils import engine_pids, titles, wait_gone
from model_utils import make_tiny_model

from common.process import free_port, parent_exit_fd
from common.worker_auth import hello_proof, new_secret, secure_client
from engine_core.workers.worker_failure import WorkerFailure
from engine_core.workers.worker_group import WorkerGroup
from launch import LLM, EngineDeadError, SamplingParams
from protocol import HEADER, Channel, Codec, EngineConfig, WorkerError, WorkerHello

pytestmark = pytest.mark.slow  # real engine processes

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("sup") / "m"), "llama", tokenizer=True)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", num_gpu_blocks_override=64, max_model_len=256, **kwargs)


def _generate_in_thread(llm: LLM) -> dict:
    """Start a long generate; the dict receives its error and when it was raised."""
    result: dict = {}

    def run() -> None:
        try:
            while True:  # each call ends at max_model_len; keep going until the engine dies
                llm.generate(["def add(a, b):"] * 4, LONG, use_tqdm=False)
        except Exception as e:
            result["error"], result["at"] = e, time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    time.sleep(0.5)  # let it produce tokens
    return result


@pytest.mark.parametrize("victim", ["worker_1", "engine_core"])
def test_sigkill_is_noticed_within_a_second(tiny, victim):
    llm = _llm(tiny, tensor_parallel_size=2)
    pids = engine_pids(llm)
    result = _generate_in_thread(llm)
    core = psutil.Process(pids[0])
    target = core if victim == "engine_core" else next(
        p for p in core.children() if "worker_1" in " ".join(p.cmdline()))
    killed_at = time.monotonic()
    target.send_signal(signal.SIGKILL)
    result["thread"].join(timeout=5)
    error = result.get("error")
    assert isinstance(error, EngineDeadError), error
    assert error.process == victim and victim in str(error) and "SIGKILL" in str(error)
    noticed = result["at"] - killed_at
    assert noticed < 1.0, f"noticed after {noticed:.2f} s"
    with pytest.raises(EngineDeadError, match=victim):  # future calls fail at once
        llm.generate("again", use_tqdm=False)
    llm.shutdown()
    left = wait_gone(pids, 2.0)
    assert not left, f"still alive 2 s later: {titles(left)}"


def test_worker_that_fails_to_start(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "llama")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["MambaForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker_\d failed to start: "
                                              r"UnsupportedModelError: unsupported architecture"):
        _llm(path, tensor_parallel_size=2)
    assert time.monotonic() - start < 15
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not wait_gone([p.pid for p in left], 2.0)


def _script(path: str, body: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import faulthandler, signal, sys, time
        faulthandler.register(signal.SIGUSR1)  # the test asks for our stacks if we hang
        # Like a program in a terminal, whatever we inherited: a background job of a
        # non-interactive shell (CI) starts with SIGINT ignored, and Python keeps it so.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from launch import LLM, SamplingParams
        llm = LLM({path!r}, dtype="float32", num_gpu_blocks_override=64, max_model_len=256,
                  tensor_parallel_size=2)
        import psutil
        core = psutil.Process(llm.engine.proc.pid)
        # One line (a second one could sit in the reader's buffer, unseen by select):
        # the engine core's and workers' pids, then the runtime directory.
        print(*(p.pid for p in [core] + core.children()), llm.engine.runtime_dir, flush=True)
    """) + textwrap.dedent(body)
    # stderr goes to a file (a pipe nobody reads could fill up and block the engine's logs).
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log,
                            text=True)
    proc.log = log
    return proc


def _line(proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """The script's next stdout line; on a timeout or an early exit, fail with its stderr
    (and, if it hangs, its threads' stacks)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else None
    if line:
        return line
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
    code = proc.wait()
    proc.log.seek(0)
    pytest.fail(f"the script {'hung' if line is None else 'ended'} (exit {code}):\n"
                f"{proc.log.read().decode(errors='replace')}")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_children_exit_when_the_front_end_dies(tiny, signum):
    """Killed or terminated, the front-end cannot clean up: the engine core notices, stops its
    workers and removes the runtime directory."""
    proc = _script(tiny, "time.sleep(60)\n")
    *pids, runtime_dir = _line(proc).split()
    pids = [int(p) for p in pids]
    assert len(pids) == 3, f"expected the engine core and 2 workers, got pids {pids}"
    assert os.path.isdir(runtime_dir)
    proc.send_signal(signum)
    proc.wait()
    assert not wait_gone(pids, 2.0)
    assert not os.path.exists(runtime_dir)


def test_parent_exit_fd_is_only_our_parents():
    fd = parent_exit_fd(os.getppid())
    if fd is None:
        pytest.skip("no pidfd_open here: watch_parent polls instead")
    os.close(fd)
    assert parent_exit_fd(os.getpid()) is None  # alive, but not our parent


def test_an_orphan_leaves_at_once_and_does_not_poll_meanwhile(tmp_path):
    """watch_parent blocks on the parent's pidfd: no wake-ups while the parent lives (the
    engine's children ran a 10 Hz poll before), and the orphan leaves as soon as it dies."""
    if parent_exit_fd(os.getppid()) is None:
        pytest.skip("no pidfd_open here: watch_parent polls instead")
    marker = tmp_path / "orphaned"
    child = textwrap.dedent(f"""
        import os, time
        from common.process import watch_parent
        watch_parent(os.getppid(), lambda: open({str(marker)!r}, "w").close())
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}])
        time.sleep(60)
    """)], stdout=subprocess.PIPE)
    try:
        pid = int(parent.stdout.readline())
        time.sleep(0.2)  # the watch thread is blocked by now
        before = _switches(pid)
        time.sleep(0.5)
        assert _switches(pid) - before <= 1  # a 10 Hz poll would switch about 5 times
        parent.kill()
        parent.wait()
        gone_at = time.monotonic()
        assert not wait_gone([pid], 2.0)
        assert time.monotonic() - gone_at < 0.5 and marker.exists()
    finally:
        parent.kill()
        parent.stdout.close()


def _switches(pid: int) -> int:
    """Context switches of all of a process's threads so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def test_ctrl_c_stops_everything_in_order(tiny):
    body = """
        try:
            while True:  # each call ends at max_model_len; keep generating until interrupted
                llm.generate(["x"] * 8, SamplingParams(max_tokens=100000, ignore_eos=True),
                             use_tqdm=False)
        except KeyboardInterrupt:
            llm.shutdown()
            print("interrupted", flush=True)
    """
    proc = _script(tiny, body)
    *pids, runtime_dir = _line(proc).split()
    pids = [int(p) for p in pids]
    time.sleep(1.0)
    for pid in [proc.pid] + pids:  # a terminal's Ctrl-C reaches the whole process group
        os.kill(pid, signal.SIGINT)
    assert _line(proc).strip() == "interrupted"
    assert proc.wait(timeout=10) == 0
    assert not wait_gone(pids, 2.0)
    assert not os.path.exists(runtime_dir)


def test_malformed_frames_are_dropped_and_serving_continues(tiny):
    with _llm(tiny) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        expected = llm.generate("def add", params, use_tqdm=False)[0].outputs[0].token_ids
        context = zmq.Context.instance()
        # Into the engine core's input: garbage, another protocol version, an unknown tag.
        for frame in (b"garbage", bytes([HEADER[0], 99]) + b"\x90", HEADER + b"\x91\x7f"):
            llm.engine.input.send(frame)
        # Into the worker socket: a rogue peer.
        rogue = context.socket(zmq.DEALER)
        rogue.connect(f"ipc://{llm.engine.runtime_dir}/workers")
        rogue.send(b"\x00\x01garbage")
        rogue.send(Codec(Channel.WORKER_TO_CORE).encode(WorkerHello(7, 1)))  # bad rank
        # Into the front-end's output socket.
        pusher = context.socket(zmq.PUSH)
        pusher.connect(f"ipc://{llm.engine.runtime_dir}/output")
        pusher.send(b"not a frame")
        time.sleep(0.3)
        again = llm.generate("def add", params, use_tqdm=False)[0].outputs[0].token_ids
        rogue.close(linger=0)  # a stranger leaving is not a worker dying
        pusher.close(linger=0)
        time.sleep(0.3)
        after = llm.generate("def add", params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == expected and after == expected


def test_process_titles(tiny):
    with _llm(tiny, tensor_parallel_size=2) as llm:
        names = titles(engine_pids(llm))
    assert names[0] == "deltaserve::engine_core"
    assert sorted(names[1:]) == ["deltaserve::worker_0", "deltaserve::worker_1"]


def test_remote_worker_joins_over_tcp(tiny, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    secret = tmp_path / "secret"
    secret.write_text(new_secret())
    worker = subprocess.Popen([sys.executable, "-m", "launch", "worker", "--connect", address,
                               "--rank", "1", "--worker-secret-file", str(secret)])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        with _llm(tiny, tensor_parallel_size=2, worker_address=address, local_ranks=[0],
                  worker_secret_file=str(secret)) as llm:
            assert llm.engine.ready.world_size == 2
            remote = llm.generate("def add", params, use_tqdm=False)[0].outputs[0].token_ids
        assert worker.wait(timeout=10) == 0  # told to shut down with the engine
        with _llm(tiny) as llm:
            local = llm.generate("def add", params, use_tqdm=False)[0].outputs[0].token_ids
        assert remote == local
    finally:
        worker.kill()


def test_a_workers_last_report_wins_over_its_disconnect(tmp_path):
    """A remote rank says hello, reports its failure and is gone before the engine core reads
    anything: the error it sent, not the disconnect or the failed reply, is what is raised."""
    address = f"tcp://127.0.0.1:{free_port()}"
    secret = tmp_path / "secret"
    secret.write_text(new_secret())
    config = EngineConfig(model=str(tmp_path), worker_address=address, local_ranks=[],
                          startup_timeout_s=10, worker_secret_file=str(secret))
    context = zmq.Context()
    group = WorkerGroup(config, context, str(tmp_path))
    worker = context.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"remote-0")
    secure_client(worker, secret.read_text())
    worker.connect(address)
    codec = Codec(Channel.WORKER_TO_CORE)
    proof = hello_proof(secret.read_text(), 0, os.getpid(), b"remote-0")
    worker.send(codec.encode(WorkerHello(0, os.getpid(), "remote", proof)))
    worker.send(codec.encode(WorkerError(0, "OSError: disk on fire", 0)))
    worker.close(linger=1000)
    time.sleep(0.3)  # hello, report and disconnect are all queued
    try:
        with pytest.raises(WorkerFailure, match="worker_0 failed to start: OSError: disk on fire"):
            group.start()
    finally:
        group.shutdown()
        context.term()
