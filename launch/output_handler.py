"""`AsyncLLM`'s output handler: one asyncio task reads the engine core's output sockets and
routes each output to its request's `RequestStream`; it notices the engine's death (or a
data-parallel replica's) and fails the streams that lose their engine with `EngineDeadError`."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from launch.client.engine_client import POLL_MS, OutputBatch
from launch.errors import EngineDeadError
from launch.metrics.stats import IterationStats
from protocol import SchedulerStats

logger = logging.getLogger("deltaserve")


class OutputHandlerMixin:
    """Needs `engine`, `output_processor`, `streams`, `stat_loggers`, `dead`, `_handler` and
    `_check_alive`."""

    def start(self) -> None:
        """Start the output handler on the running event loop (done by the first request)."""
        if self._handler is None or self._handler.done():
            self._check_alive()
            self._handler = asyncio.get_running_loop().create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        try:
            sockets, wait = self._waiter()
            while True:
                await wait()
                # Also checks the engine is alive (with data parallelism: each replica).
                for batch in self.engine.get_output_batches(0):
                    self._process(batch)
                if len(self.engine.output_sockets) != len(sockets):  # a replica died
                    sockets, wait = self._waiter()
        except EngineDeadError as e:
            self.fail_all(e)
        except Exception as e:  # a bug here must not leave streams hanging
            logger.exception("the output handler failed")
            self.fail_all(EngineDeadError(f"the front-end's output handler failed: {e!r}",
                                          "front-end"))

    def _waiter(self) -> tuple[list[zmq.Socket], Callable[[], Awaitable[object]]]:
        """The engine's output sockets, and a wait until one is readable (or POLL_MS)."""
        sockets = self.engine.output_sockets
        if len(sockets) == 1:
            socket = zmq.asyncio.Socket.shadow(sockets[0].underlying)
            return sockets, lambda: socket.poll(POLL_MS, zmq.POLLIN)
        poller = zmq.asyncio.Poller()
        for socket in sockets:
            poller.register(zmq.asyncio.Socket.shadow(socket.underlying), zmq.POLLIN)
        return sockets, lambda: poller.poll(POLL_MS)

    def _process(self, batch: OutputBatch) -> None:
        if batch.error is not None:
            self._fail_lost(batch)
            return
        stats = IterationStats(time.time(), scheduler=batch.stats, engine=batch.engine)
        result = self.output_processor.process_outputs(batch.outputs, stats)
        for state in result.updated:
            self.streams[state.request_id].notify()
        for state in result.finished:
            del self.streams[state.request_id]
        if result.aborts:
            self.engine.abort_requests(result.aborts)
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)

    # --- death and shutdown ---------------------------------------------------------------

    def _fail_lost(self, batch: OutputBatch) -> None:
        """One replica died: its requests end with its error; the others go on."""
        for state in self.output_processor.drop_requests_of(batch.lost):
            stream = self.streams.pop(state.request_id, None)
            if stream is not None:
                stream.fail(batch.error)
        for stat_logger in self.stat_loggers:
            stat_logger.record(IterationStats(time.time(), scheduler=SchedulerStats(),
                                              engine=batch.engine))

    def fail_all(self, error: EngineDeadError) -> None:
        """End every pending stream with `error`; later calls raise it at once."""
        self.dead = self.dead or error
        self.output_processor.drop_all()
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream.fail(error)
        # The engine holds nothing any more: gauges read zero, not its last busy report.
        for stat_logger in self.stat_loggers:
            for rank in self.engine.ranks:
                stat_logger.record(IterationStats(time.time(), scheduler=SchedulerStats(),
                                                  engine=rank))
