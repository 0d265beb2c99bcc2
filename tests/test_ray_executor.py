"""Workers placed by Ray (`distributed_executor_backend="ray"`): the same tokens as mp, a dead
actor named by its rank, nothing of ours left in the cluster. Ray starts slowly on two cores:
two tests, each bounded."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from engine_utils import wait_gone

from common.process import free_port
from launch import LLM, EngineDeadError, SamplingParams

ray = pytest.importorskip("ray", reason="Ray is the optional extra deltaserve[ray]")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "launch", "model_cache", "default_model")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "import os\n", "The quick brown"]


def _tree(pid: int) -> list[int]:
    return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]


def test_ray_tp2_gives_mp_tp2s_tokens_and_stops_its_local_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with LLM(MODEL, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        on_ray = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        started = _tree(llm.engine.proc.pid)  # the engine core, its Ray cluster and actors
    with LLM(MODEL, tensor_parallel_size=2) as llm:
        on_mp = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert on_ray == on_mp
    assert len(started) > 3 and not wait_gone(started, 15.0)


@pytest.fixture
def ray_cluster(monkeypatch):
    """A `ray start --head` cluster of two CPUs, ours alone (own temp dir), on 127.0.0.2:
    Ray rewrites 127.0.0.1 and localhost to the host's outward address, not other loopback
    addresses. Ray's token authentication is on, so clients say so (RAY_AUTH_MODE=token)."""
    temp = tempfile.mkdtemp(prefix="ray")
    port = free_port("127.0.0.2")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--port", str(port),
                    "--node-ip-address", "127.0.0.2", "--include-dashboard", "false",
                    "--disable-usage-stats", "--temp-dir", temp], check=True, timeout=120,
                   capture_output=True)
    address = f"127.0.0.2:{port}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    try:
        yield address
    finally:  # the cluster's daemons, and the agents they started
        ours = [p for p in psutil.process_iter(["cmdline"])
                if any(temp in part for part in p.info["cmdline"] or ())]
        for proc in ours + [c for p in ours for c in p.children(recursive=True)]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def _ask_cluster(expression: str) -> object:
    """`expression` evaluated by a fresh driver of the cluster at $RAY_ADDRESS (a process of
    its own: Ray reads its authentication mode once per process). `live(name)`: the pid of
    the live actor of that name, else None, from the GCS's actor table (Ray's public state
    API needs the dashboard, which this cluster runs without)."""
    script = ("import json, ray\nfrom ray._private import state\n"
              "ray.init(namespace='deltaserve', log_to_driver=False)\n"
              "def live(name):\n"
              "    return next((a['Pid'] for a in state.actors().values()\n"
              "                 if a['Name'] == name and a['State'] == 'ALIVE'), None)\n"
              f"print(json.dumps({expression}))\nray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_killed_actor_is_a_dead_engine_naming_its_rank(ray_cluster):
    with LLM(MODEL, tensor_parallel_size=2, distributed_executor_backend="ray",
             step_timeout_s=20) as llm:
        assert llm.generate("x", GREEDY, use_tqdm=False)[0].outputs
        names = [f"worker_{rank}.{llm.engine.proc.pid}" for rank in (0, 1)]
        os.kill(_ask_cluster(f"live({names[1]!r})"), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError) as dead:
            llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
        noticed = time.monotonic() - killed
    assert dead.value.process == "worker_1" and "Ray actor" in str(dead.value), dead.value
    assert noticed < 5.0, f"the dead actor was noticed after {noticed:.1f} s"
    groups, alive = _ask_cluster(
        "[[g['state'] for g in ray.util.placement_group_table().values()], "
        f"[live(n) for n in {names!r}]]")
    assert groups and all(state == "REMOVED" for state in groups), groups
    assert alive == [None, None], alive
