"""The ray backend: Ray places and starts the workers; it carries none of their messages.

The engine core connects to the Ray cluster at $RAY_ADDRESS, else to one started with
`ray start` on this host, else starts a local one on loopback (as many CPUs as this host has,
at least one per rank). It reserves a placement group with one bundle per rank (a GPU each
when the workers run on CUDA, else a CPU) and starts one `WorkerActor` per bundle, whose
`run()` is `python -m worker --connect ADDRESS --rank R` inside the actor's process: today's
worker loop, joining the engine core over the authenticated tcp link (CURVE + HMAC hello; the
secret is an argument of `run()`) and torch.distributed as ever. Steps never pass through Ray.

A worker is watched through its actor's pid while it lives on this host (as fast as an mp
worker: the pid's exit or stop), and always through its `run()` reference. Shutdown waits
briefly for the actors' loops to end, kills them, removes the placement group and, if the
engine started the cluster, stops it.
"""
from __future__ import annotations

import ipaddress
import os
import runpy
import sys
from urllib.parse import urlparse

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.process import describe_exit
from engine_core.workers.worker_failure import WorkerFailure

# The tree holding engine_core/ and worker/: actors import this module and the worker from it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerActor:
    """One rank's process, placed by Ray."""

    def where(self) -> tuple[int, str]:
        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """The worker loop, as `python -m worker ARGV` would run it; its exit code."""
        os.environ.pop("DELTASERVE_PARENT_PID", None)  # Ray's raylet, not us, is the parent
        os.environ.update(env)
        sys.argv = ["worker", *argv]
        try:
            runpy.run_module("worker", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0


class RayWorker:
    """A rank's actor: gone, stopped or finished is a failure while the engine runs."""

    def __init__(self, rank: int, actor: ray.actor.ActorHandle, run: ray.ObjectRef, pid: int,
                 node: str, local: bool) -> None:
        self.rank, self.actor, self.run, self.pid, self.node = rank, actor, run, pid, node
        self.process = psutil.Process(pid) if local else None

    @property
    def name(self) -> str:
        return f"worker_{self.rank}"

    def state(self) -> str:
        if self.process is not None:
            try:
                return self.process.status()
            except psutil.NoSuchProcess:
                return "gone"
        return "running" if not ray.wait([self.run], timeout=0)[0] else "gone"

    def failure(self) -> WorkerFailure | None:
        where = f"{self.name} (Ray actor, pid {self.pid} on {self.node})"
        state = self.state()
        if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return WorkerFailure(self.name, f"{where} is {state} and cannot make progress")
        if state != "gone" and not ray.wait([self.run], timeout=0)[0]:
            return None
        return WorkerFailure(self.name, f"{where} {self._how_it_ended()}")

    def _how_it_ended(self) -> str:
        if not ray.wait([self.run], timeout=0.2)[0]:
            return "is gone"
        try:
            return describe_exit(ray.get(self.run))
        except ray.exceptions.RayError as e:
            return f"died: {str(e).splitlines()[0]}"


class RayLauncher:
    def __init__(self, world_size: int, device: str, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.started_cluster = _connect(world_size)
        self.node = ray.util.get_node_ip_address()
        use_gpu = device.startswith("cuda") or (
            device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        self.bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
        self.group = None
        self.workers: dict[int, RayWorker] = {}

    def default_address(self, runtime_dir: str) -> str:
        """tcp on this node's Ray address (port chosen at bind): where actors reach us."""
        return f"tcp://{self.node}:0"

    def ranks_are_local(self, address: str) -> bool:
        """A loopback address means a one-host cluster: the ranks meet through a file."""
        try:
            return ipaddress.ip_address(urlparse(address).hostname or "").is_loopback
        except ValueError:
            return False

    def launch(self, address: str, env: dict[str, str]) -> dict[int, RayWorker]:
        self.group = placement_group([self.bundle] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=self.timeout_s)
        if not ready:
            raise WorkerFailure("worker_0", f"Ray could not place {self.world_size} bundles of "
                                f"{self.bundle} within {self.timeout_s:.0f} s (cluster: "
                                f"{ray.available_resources()})")
        paths = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        actor_class = ray.remote(WorkerActor)
        for rank in range(self.world_size):
            actor = actor_class.options(
                num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
                name=f"worker_{rank}.{os.getpid()}",  # unique per engine core in the cluster
                max_restarts=0, runtime_env={"env_vars": {"PYTHONPATH": paths}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=rank)).remote()
            pid, node = ray.get(actor.where.remote(), timeout=self.timeout_s)
            run = actor.run.remote(["--connect", address, "--rank", str(rank)], env)
            self.workers[rank] = RayWorker(rank, actor, run, pid, node, node == self.node)
        return self.workers

    def stop(self, grace_s: float = 2.0) -> None:
        runs = [w.run for w in self.workers.values()]
        if runs:
            ray.wait(runs, num_returns=len(runs), timeout=grace_s)
        self._release()
        if self.started_cluster:
            ray.shutdown()

    def kill(self) -> None:
        """Last resort (the engine core's parent is gone, we exit next): release the actors
        and the group, and SIGKILL a cluster we started (our descendants: its daemons and
        their agents, which outlive a driver that exits without ray.shutdown)."""
        try:
            self._release()
        finally:
            if self.started_cluster:
                for process in psutil.Process().children(recursive=True):
                    try:
                        process.kill()
                    except psutil.NoSuchProcess:
                        pass

    def _release(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker.actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


def _connect(world_size: int) -> bool:
    """Join $RAY_ADDRESS's cluster, else a `ray start` one on this host, else start a local
    one on loopback; True if we started it (and so stop it)."""
    options = {"log_to_driver": True, "namespace": "deltaserve"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **options)
        return False
    try:
        ray.init(address="auto", **options)
        return False
    except ConnectionError:
        pass
    ray.init(num_cpus=max(world_size, os.cpu_count() or 1), _node_ip_address="127.0.0.1",
             include_dashboard=False, **options)
    return True
