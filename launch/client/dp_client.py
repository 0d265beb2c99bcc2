"""Data-parallel replicas behind one front-end: N engine clients, one request balancer.

Each replica is a whole engine (engine core, workers, KV cache) with its own pair of ipc
sockets, so with `data_parallel_size == 1` none of this runs: the front-end talks to its one
`EngineClient` directly.

Balancing is vLLM's (DPLBAsyncMPClient): a new request goes to the live replica with the
lowest 4 x waiting + running, from the replica's latest `SchedulerStats` plus the requests
sent to it since that report; ties go to the lowest rank. A LoRA request's adapter is part of
the choice: a replica already holding requests of that adapter counts `ADAPTER_AFFINITY`
lighter for it. A request's n sequences go to one
replica (they share a prompt, hence its cached blocks). Aborts go to the replica holding the
request.

A replica that dies takes only its own requests with it: they fail with an EngineDeadError
naming the replica and its process, and the others keep serving (they share nothing with
it). Once every replica is dead, the client is dead.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence

import msgspec
import zmq

from launch.client.engine_client import POLL_MS, EngineClient, OutputBatch
from launch.errors import EngineDeadError
from protocol import AddRequest, EngineConfig, EngineCoreOutput, EngineReady
from protocol.lora import AddLoRA, LoRARequest, RemoveLoRA

logger = logging.getLogger("deltaserve")
WAITING_WEIGHT = 4  # vLLM's: a waiting request costs four running ones
# A replica already holding requests of a request's LoRA adapter counts this much lighter
# for it: the adapter is loaded there, shares a --max-loras slot, and its prefix cache
# holds that adapter's blocks (blocks of other adapters never match).
ADAPTER_AFFINITY = WAITING_WEIGHT


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s options: its own data-parallel rank and journal."""
    rank = config.data_parallel_rank + index
    return msgspec.structs.replace(config, data_parallel_rank=rank,
                                   record_path=replica_journal(config.record_path, rank))


def replica_journal(path: str | None, rank: int) -> str | None:
    """`run.journal` -> `run.dp{rank}.journal` (a path without extension gets `.dp{rank}`)."""
    if path is None:
        return None
    root, ext = os.path.splitext(path)
    return f"{root}.dp{rank}{ext}"


class DPEngineClient:
    """`EngineClient`'s interface over `config.data_parallel_size` replicas."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.replicas: list[EngineClient] = []
        try:
            for index in range(config.data_parallel_size):
                self.replicas.append(EngineClient(replica_config(config, index)))
        except BaseException:
            self.shutdown()
            raise
        n = len(self.replicas)
        self.live = list(range(n))  # indices of replicas not known to be dead
        self.sent = [0] * n  # requests sent since the replica's last stats report
        self.seen_stats = [r.stats for r in self.replicas]
        self.owner: dict[str, int] = {}  # engine request id -> replica index, until finished
        self.adapter_of: dict[str, int] = {}  # engine request id -> its LoRA adapter's id
        self.adapters: list[Counter[int]] = [Counter() for _ in range(n)]  # unfinished, by id
        self.dead: EngineDeadError | None = None
        self.deaths: list[OutputBatch] = []  # replicas lost while sending, not yet reported
        self.poller = zmq.Poller()
        for replica in self.replicas:
            self.poller.register(replica.output, zmq.POLLIN)

    # --- what the front-end reads ---------------------------------------------------------

    @property
    def ready(self) -> EngineReady | None:
        return self.replicas[0].ready

    @property
    def readies(self) -> list[EngineReady]:
        return [r for replica in self.replicas for r in replica.readies]

    @property
    def ranks(self) -> list[int]:
        return [replica.rank for replica in self.replicas]

    @property
    def output_sockets(self) -> list[zmq.Socket]:
        return [self.replicas[i].output for i in self.live]

    def engine_of(self, request_id: str) -> int:
        return self.replicas[self.owner.get(request_id, 0)].rank

    def wait_ready(self) -> EngineReady:
        """Every replica ready (they start in parallel); on any failure, stop all, raise."""
        try:
            for index, replica in enumerate(self.replicas):
                try:
                    replica.wait_ready()
                except EngineDeadError as e:
                    raise self._named(index, e) from None
            return self.replicas[0].ready
        except BaseException:
            self.shutdown()
            raise

    # --- requests ---------------------------------------------------------------------------

    def add_requests(self, requests: list[AddRequest],
                     group_sizes: Sequence[int] | None = None) -> None:
        """Each group (default: all of them) to the least loaded live replica; one frame per
        replica."""
        batches: dict[int, list[AddRequest]] = {}
        start = 0
        for size in group_sizes if group_sizes is not None else [len(requests)]:
            group = requests[start:start + size]
            start += size
            index = self._choose(group[0].lora_request if group else None)
            self.sent[index] += len(group)
            batches.setdefault(index, []).extend(group)
        for index, batch in batches.items():
            self._add_to(index, batch)

    def send_lora(self, message: AddLoRA | RemoveLoRA) -> None:
        """Every live replica registers (or drops) the adapter: any may be chosen."""
        for index in list(self.live):
            try:
                self.replicas[index].send_lora(message)
            except EngineDeadError as e:
                self.deaths.append(self._lose(index, e))

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.owner.get(request_id)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            try:
                self.replicas[index].abort_requests(ids)
            except EngineDeadError as e:
                logger.error("%s", self._named(index, e))  # its requests fail with it

    def get_outputs(self, timeout_ms: int = POLL_MS) -> list[EngineCoreOutput]:
        """Outputs of every replica; the death of a replica that held requests raises its
        EngineDeadError (once: the others go on serving later calls)."""
        outputs: list[EngineCoreOutput] = []
        for batch in self.get_output_batches(timeout_ms):
            if batch.error is not None and batch.lost:
                raise batch.error
            outputs += batch.outputs
        return outputs

    def get_output_batches(self, timeout_ms: int = POLL_MS) -> list[OutputBatch]:
        """One batch per replica that sent something or died, after waiting up to
        `timeout_ms` for any of them. Raises EngineDeadError once every replica is dead."""
        batches, self.deaths = self.deaths, []
        if self.dead is not None and not batches:
            raise self.dead
        if timeout_ms and self.live and not batches:
            self.poller.poll(timeout_ms)
        for index in list(self.live):
            replica = self.replicas[index]
            try:
                outputs = replica.get_outputs(0)
            except EngineDeadError as e:
                batches.append(self._lose(index, e))
                continue
            if replica.stats is not self.seen_stats[index]:  # a fresh report counts our sends
                self.seen_stats[index], self.sent[index] = replica.stats, 0
            for out in outputs:
                if out.finish_reason is not None:
                    self._forget(out.request_id)
            if outputs:
                batches.append(OutputBatch(replica.rank, outputs, replica.stats))
        return batches

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    # --- balancing and failures -------------------------------------------------------------

    def _choose(self, lora: LoRARequest | None = None) -> int:
        if not self.live:
            raise self.dead or EngineDeadError("no engine replica is alive")
        lora_id = lora.lora_int_id if lora is not None else 0

        def load(index: int) -> int:
            stats = self.replicas[index].stats
            cost = WAITING_WEIGHT * (stats.num_waiting + self.sent[index]) + stats.num_running
            return cost - ADAPTER_AFFINITY if lora_id and self.adapters[index][lora_id] else cost
        return min(self.live, key=load)

    def _forget(self, request_id: str) -> None:
        """A request finished: it no longer counts for its replica or adapter."""
        index = self.owner.pop(request_id, None)
        lora_id = self.adapter_of.pop(request_id, 0)
        if index is not None and lora_id:
            self.adapters[index][lora_id] -= 1
            if self.adapters[index][lora_id] <= 0:
                del self.adapters[index][lora_id]

    def _add_to(self, index: int, batch: list[AddRequest]) -> None:
        """Send a replica its batch; one that turns out dead hands it to the next choice."""
        while True:
            try:
                self.replicas[index].add_requests(batch)
                break
            except EngineDeadError as e:
                self.deaths.append(self._lose(index, e))
                index = self._choose(batch[0].lora_request)
        for request in batch:
            self.owner[request.request_id] = index
            if request.lora_request is not None:
                self.adapter_of[request.request_id] = request.lora_request.lora_int_id
                self.adapters[index][request.lora_request.lora_int_id] += 1

    def _lose(self, index: int, error: EngineDeadError) -> OutputBatch:
        """Replica `index` is dead: forget it and the requests it held."""
        named = self._named(index, error)
        if index in self.live:
            self.live.remove(index)
            self.poller.unregister(self.replicas[index].output)
            logger.error("%s; %d replica(s) still serving", named, len(self.live))
        lost = [rid for rid, owner in self.owner.items() if owner == index]
        for request_id in lost:
            self._forget(request_id)
        if not self.live:
            self.dead = named
        return OutputBatch(self.replicas[index].rank, [], None, lost, named)

    def _named(self, index: int, error: EngineDeadError) -> EngineDeadError:
        rank = self.replicas[index].rank
        return EngineDeadError(f"replica {rank}: {error}", error.process, rank)
