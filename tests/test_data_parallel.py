"""Data-parallel replicas behind one front-end (`data_parallel_size`): same tokens as one
engine, load split, aborts to the right replica, a dead replica costs only its requests,
one journal per replica, one /metrics with an `engine` label each, a clean SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import psutil
import pytest
from engine_utils import wait_gone
from server_utils import Server

from launch import LLM, AsyncLLM, EngineDeadError, SamplingParams
from launch.client.dp_client import replica_journal
from protocol import AbortRequests
from replay.recorded_run import RecordedRun
from replay.replay import replay_scheduler, replay_workers

pytestmark = pytest.mark.slow
MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "launch", "model_cache", "default_model")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]


def _pids(engine) -> list[int]:
    """Every replica's engine core and the processes it started."""
    pids = []
    for replica in engine.replicas:
        core = psutil.Process(replica.proc.pid)
        pids += [core.pid] + [p.pid for p in core.children(recursive=True)]
    return pids


def test_two_replicas_give_one_engines_tokens_and_share_the_load(tmp_path):
    journal = str(tmp_path / "run.journal")
    with LLM(MODEL, data_parallel_size=2, record_path=journal) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        steps = [replica.last_step for replica in llm.engine.replicas]
        n = llm.generate("def g(", SamplingParams(n=4, max_tokens=6, seed=3), use_tqdm=False)
        moved = [r.last_step - s for r, s in zip(llm.engine.replicas, steps)]
    with LLM(MODEL) as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert two == one
    assert all(steps), f"both replicas should have run steps, got {steps}"
    assert len(n[0].outputs) == 4 and sorted(moved)[0] == 0 < sorted(moved)[1], \
        f"a request's sequences stay on one replica, steps moved {moved}"
    paths = [replica_journal(journal, rank) for rank in (0, 1)]
    assert paths == [str(tmp_path / "run.dp0.journal"), str(tmp_path / "run.dp1.journal")]
    for path in paths:  # each replayable on its own
        assert replay_scheduler(path, out=lambda *_: None) == 0
        assert replay_workers(path, out=lambda *_: None) == 0
    assert not os.path.exists(journal)


def test_an_abort_reaches_the_replica_holding_the_request(tmp_path):
    journal = str(tmp_path / "abort.journal")
    engine = AsyncLLM(MODEL, data_parallel_size=2, record_path=journal)

    async def main() -> int:
        streams = [engine.generate(p, LONG, f"long-{i}") for i, p in enumerate(PROMPTS[:2])]
        for stream in streams:
            await stream.__anext__()
        holders = [engine.engine.owner[f"long-{i}"] for i in range(2)]
        assert sorted(holders) == [0, 1], "two requests on two idle replicas"
        await engine.abort("long-1")
        await streams[0].aclose()  # a consumer leaving aborts too
        return holders[1]
    try:
        holder = asyncio.run(main())
    finally:
        engine.shutdown()
    aborts = {rank: _aborted(replica_journal(journal, rank)) for rank in (0, 1)}
    assert aborts[holder] == ["long-1"] and aborts[1 - holder] == ["long-0"], aborts


def _aborted(path: str) -> list[str]:
    run = RecordedRun(path)
    return [rid for record in run.records for message in run.frontend_messages(record)
            if isinstance(message, AbortRequests) for rid in message.request_ids]


def test_a_dead_replica_fails_its_requests_and_the_other_serves_on():
    engine = AsyncLLM(MODEL, data_parallel_size=2)
    pids = _pids(engine.engine)

    async def main() -> tuple[BaseException | None, int]:
        streams = {f"r{i}": engine.generate(p, LONG, f"r{i}") for i, p in
                   enumerate(PROMPTS[:2])}
        for stream in streams.values():
            await stream.__anext__()
        victim = engine.engine.owner["r1"]
        os.kill(engine.engine.replicas[victim].proc.pid, signal.SIGKILL)
        error = None
        try:
            async for _ in streams["r1"]:
                pass
        except EngineDeadError as e:
            error = e
        survivor = 0
        async for out in streams["r0"]:
            survivor = len(out.outputs[0].token_ids)
        after = [out async for out in engine.generate("y", GREEDY, "after")]
        assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 12
        return error, victim, survivor
    try:
        error, victim, survivor = asyncio.run(main())
        assert isinstance(error, EngineDeadError) and error.replica == victim
        assert f"replica {victim}: engine_core (pid" in str(error) and "SIGKILL" in str(error)
        assert survivor == 900 and engine.dead is None
    finally:
        engine.shutdown()
    assert not wait_gone(pids, 10.0)


def _runtime_dirs(pid: int) -> set[str]:
    dirs = set()
    for conn in psutil.Process(pid).net_connections(kind="unix"):
        if conn.laddr and os.path.basename(os.path.dirname(conn.laddr)).startswith("deltaserve-"):
            dirs.add(os.path.dirname(conn.laddr))
    return dirs


def test_server_with_two_replicas_labels_metrics_and_stops_clean():
    server = Server(MODEL, "--data-parallel-size", "2", "--served-model-name", "default_model")
    try:
        dirs = _runtime_dirs(server.proc.pid)
        for i in range(4):
            body = {"model": "default_model", "prompt": f"x{i}", "max_tokens": 4}
            assert httpx.post(server.url + "/v1/completions", json=body,
                              timeout=60).status_code == 200
        m = server.metrics(engine=None)
        for rank in ("0", "1"):
            assert f'vllm:num_requests_running{{engine="{rank}"}}' in m
            info = [k for k in m if k.startswith("vllm:cache_config_info") and
                    f'engine="{rank}"' in k]
            assert len(info) == 1 and 'block_size="16"' in info[0] and m[info[0]] == 1
            assert 'enable_prefix_caching="True"' in info[0] and "num_gpu_blocks=" in info[0]
        assert sum(m[f'vllm:request_success_total{{engine="{r}",finished_reason="length"}}']
                   for r in "01") == 4
        children = [c.pid for c in server.children]
        titles = sorted(" ".join(psutil.Process(p).cmdline()).strip() for p in children)
        assert "deltaserve::engine_core_dp0" in titles and "deltaserve::engine_core_dp1" in titles
    finally:
        assert server.stop(signal.SIGTERM) == 0
    assert len(dirs) == 2 and not any(os.path.exists(d) for d in dirs)
    assert not wait_gone(children, 5.0)


def test_offline_a_dead_replica_fails_one_call_and_the_next_runs_on_the_other():
    with LLM(MODEL, data_parallel_size=2) as llm:
        kill = threading.Timer(1.0, os.kill, (llm.engine.replicas[1].proc.pid, signal.SIGKILL))
        kill.start()
        with pytest.raises(EngineDeadError, match="replica 1: engine_core") as dead:
            llm.generate(PROMPTS, LONG, use_tqdm=False)  # on both replicas when it dies
        assert dead.value.replica == 1
        outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 4
        assert llm.engine.live == [0]
