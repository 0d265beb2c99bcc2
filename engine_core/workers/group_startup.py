"""A worker group's start: launch the ranks, greet each (only peers that prove they hold
the worker secret), hand them where their torch.distributed group meets, and gather their
capacities once every rank is ready."""
from __future__ import annotations

import logging
import socket as pysocket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import psutil

from common.byte_size import byte_size
from common.process import POLL_MS, free_port
from common.worker_auth import SECRET_ENV, proof_is_valid
from engine_core.workers.worker_failure import WorkerFailure
from protocol import WorkerError, WorkerHello, WorkerInit, WorkerReady, WorkerShutdown

logger = logging.getLogger("deltaserve")


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    num_blocks: int  # the minimum over ranks
    max_model_len: int
    vocab_size: int
    attention_backend: str
    dtype: str = ""
    quantization: str = ""
    sliding_windows: tuple[int, ...] = ()  # per KV layer group (empty: one full group)
    block_bytes: int = 0  # one block id's KV bytes over every rank (0: a rank did not say)

    def kv_size(self, world_size: int) -> str:
        """The ready line's KV cache bytes: every block, and one block over every rank (""
        where the workers did not say a block's bytes)."""
        if not self.block_bytes:
            return ""
        ranks = f" over {world_size} ranks" if world_size > 1 else ""
        return (f", {byte_size(self.num_blocks * self.block_bytes)} "
                f"({byte_size(self.block_bytes)} a block{ranks})")

    def group_sizes(self, blocks: list[int]) -> str:
        """The bytes of `blocks[g]` blocks of each KV layer group g (a block id holds one
        group's layers, every group's the same bytes); "" where the workers did not say."""
        if not self.block_bytes:
            return ""
        return f" ({', '.join(byte_size(n * self.block_bytes) for n in blocks)})"


class GroupStartup:
    """`WorkerGroup`'s start-up. Needs `config`, `world_size`, `launcher`, `address`,
    `runtime_dir`, `secret`, `socket`, `peers`, `_send`, `_receive`, `_blame` and
    `_failure_of`."""

    def start(self) -> WorkerCapacity:
        all_local = self.launcher.ranks_are_local(self.address)
        env = {SECRET_ENV: self.secret, **({"GLOO_SOCKET_IFNAME": "lo"} if all_local else {})}
        self.local = self.launcher.launch(self.address, env)
        init = WorkerInit(self.config, self._rendezvous(all_local))
        ready: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + self.config.startup_timeout_s
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(ready))
                raise WorkerFailure(f"worker_{missing[0]}",
                                    f"workers {missing} were not ready within "
                                    f"{self.config.startup_timeout_s:.0f} s")
            message, identity = self._receive(POLL_MS)
            if isinstance(message, WorkerHello):
                self._greet(message, identity, init)
            elif isinstance(message, WorkerReady) and self.peers.get(message.rank) == identity:
                ready[message.rank] = message
            elif isinstance(message, WorkerError):
                raise self._blame(self._failure_of(message, identity))
        self.started = True
        logger.info("workers ready: %s", ", ".join(
            f"rank {r}: {m.num_blocks} blocks on {m.device} ({m.attention_backend}, {m.dtype}, "
            f"{m.quantization}){'; ' + m.host if m.host else ''}"
            for r, m in sorted(ready.items())))
        return WorkerCapacity(min(m.num_blocks for m in ready.values()),
                              min(m.max_model_len for m in ready.values()),
                              min(m.vocab_size for m in ready.values()),
                              ready[0].attention_backend, ready[0].dtype,
                              ready[0].quantization, tuple(ready[0].sliding_windows),
                              _block_bytes(list(ready.values())))

    def _rendezvous(self, all_local: bool) -> str:
        """Where the ranks' torch.distributed group meets: a file in the private runtime
        directory when every rank is local (nothing listens on the network), else a TCP store
        on the host the workers reach us on."""
        if all_local:
            return f"file://{self.runtime_dir}/rendezvous"
        host = urlparse(self.address).hostname or ""
        if host in ("", "0.0.0.0", "*", "::"):
            host = _outward_address()
        return f"tcp://{host}:{free_port(host)}"

    def _greet(self, hello: WorkerHello, identity: bytes, init: WorkerInit) -> None:
        if not proof_is_valid(self.secret, hello.proof, hello.rank, hello.pid, identity):
            self.socket.strangers.warn(f"ignored a hello without a valid proof (claims rank "
                                       f"{hello.rank}, pid {hello.pid}, host "
                                       f"{hello.hostname!r})")
            return
        if not 0 <= hello.rank < self.world_size or hello.rank in self.peers:
            logger.error("refusing worker with rank %d (pid %d, %s): already present or "
                         "outside world size %d", hello.rank, hello.pid, hello.hostname,
                         self.world_size)
            self._send(identity, self.socket.encoder.encode(WorkerShutdown()))
            return
        self.peers[hello.rank] = identity
        self._send(identity, self.socket.encoder.encode(init))


def _block_bytes(ready: list[WorkerReady]) -> int:
    """A block id's KV bytes summed over the ranks (each holds its heads' share), or 0."""
    return 0 if any(m.block_bytes == 0 for m in ready) else sum(m.block_bytes for m in ready)


def _outward_address() -> str:
    """This host's first non-loopback IPv4 address (what other hosts reach it by), else
    whatever its name resolves to."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == pysocket.AF_INET and not address.address.startswith("127."):
                return address.address
    return pysocket.gethostbyname(pysocket.gethostname())
