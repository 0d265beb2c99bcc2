"""The engine-core process: sockets and a busy loop around an `EngineCore`."""
from __future__ import annotations

import argparse
import logging
import shutil
import time
import traceback

import msgspec
import zmq

from common.process import POLL_MS, become_child, configure_logging
from engine_core.engine_core import EngineCore
from engine_core.kv_event_publisher import KVEventPublisher
from engine_core.workers.worker_failure import WorkerFailure
from engine_core.workers.worker_group import WorkerGroup
from protocol import (
    AbortRequests,
    AddRequest,
    Channel,
    Codec,
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    GrammarsCompiled,
    ProtocolError,
    ShutdownEngine,
)
from protocol.journal import ENGINE_CORE
from protocol.journal_header import open_journal
from protocol.lora import AddLoRA, LoadLoRA, RemoveLoRA, UnloadLoRA
from protocol.request_salvage import readable_request_ids

logger = logging.getLogger("deltaserve")
# One generate call is one frame; the front-end refuses to send a bigger one. This bounds
# what the input socket can make us buffer.
MAX_FRONTEND_FRAME = 1 << 30
HEARTBEAT_S = 1.0  # while busy, the front-end hears from us at least this often


class EngineCoreProc:
    """Single-threaded: drain the front-end's messages, run a step whenever there is work,
    send its outputs; while idle, block on the front-end socket for at most POLL_MS and check
    the workers. Every frame goes through `_send`/`_receive`, the journal's one hook."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 runtime_dir: str) -> None:
        self.config = config
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PAIR)
        self.input.setsockopt(zmq.MAXMSGSIZE, MAX_FRONTEND_FRAME)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PAIR)
        self.output.setsockopt(zmq.LINGER, 2000)
        # Never block the step loop on a front-end that is not reading (between two offline
        # calls, or busy sending): what queues is bounded by the requests it sent.
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.connect(output_address)
        self.decoder, self.encoder = Codec(Channel.FRONTEND_TO_CORE), Codec(Channel.CORE_TO_FRONTEND)
        self.poller = zmq.Poller()  # the input socket, and the engine's wakeup fd once started
        self.poller.register(self.input, zmq.POLLIN)
        self.journal = open_journal(config) if config.record_path else None
        self.workers = WorkerGroup(config, self.context, runtime_dir,
                                   self.journal.record if self.journal else None)
        self.engine: EngineCore | None = None
        self.kv_events: KVEventPublisher | None = None
        self.last_sent = time.monotonic()
        self.refused: list[EngineCoreOutput] = []  # answers to frames we could not decode

    def run(self) -> int:
        try:
            events = self.config.kv_events_config
            if events is not None and events.enabled:
                self.kv_events = KVEventPublisher(events, self.config.data_parallel_rank,
                                                  self.context)
            self.engine = self._start()
            self._loop()
            return 0
        except WorkerFailure as e:
            logger.error("%s", e)
            self._send(EngineFailed(str(e), e.process))
        except Exception as e:  # report, then die: the front-end raises EngineDeadError
            logger.error("engine core failed:\n%s", traceback.format_exc())
            self._send(EngineFailed(f"engine_core failed: {type(e).__name__}: {e}"))
        finally:
            if self.engine is not None:
                self.engine.structured_output.shutdown()
            self.workers.shutdown()
            if self.kv_events is not None:
                self.kv_events.close()
            if self.journal is not None:
                self.journal.close()
            self.input.close(linger=0)
            self.output.close()
            self.context.term()
        return 1

    def _start(self) -> EngineCore:
        ready = self.workers.start()
        c = self.config
        engine = EngineCore.from_config(c, self.workers, ready.num_blocks, ready.max_model_len,
                                        ready.vocab_size, ready.sliding_windows)
        if self.kv_events is not None:
            engine.record_kv_events()
        logger.info("engine core ready: max_model_len %d, %d KV blocks of %d tokens%s",
                    ready.max_model_len, ready.num_blocks, c.block_size,
                    ready.kv_size(c.tensor_parallel_size))
        if ready.sliding_windows:
            blocks = engine.scheduler.kv_cache_manager.blocks_for_sequence(ready.max_model_len)
            logger.info("KV cache groups (window, 0: full): %s; one %d-token sequence holds "
                        "%s blocks%s", list(ready.sliding_windows), ready.max_model_len,
                        blocks, ready.group_sizes(blocks))
        logger.info("model_config_info: model=%s quantization=%s dtype=%s "
                    "tensor_parallel_size=%d attention_backend=%s", c.model,
                    ready.quantization, ready.dtype, c.tensor_parallel_size,
                    ready.attention_backend)
        # after its lines: a front-end told "ready" finds them written
        self._send(EngineReady(ready.max_model_len, ready.num_blocks, c.block_size,
                               c.tensor_parallel_size, ready.vocab_size,
                               ready.attention_backend, ready.dtype, ready.quantization,
                               list(ready.sliding_windows),
                               engine.scheduler.max_kv_tokens if ready.sliding_windows else 0))
        self.poller.register(engine.structured_output.wakeup_fd, zmq.POLLIN)
        return engine

    def _loop(self) -> None:
        engine = self.engine
        was_busy = False
        while True:
            busy = engine.has_work()
            outputs: list[EngineCoreOutput] = []
            for message in self._receive(0 if busy else POLL_MS):
                if isinstance(message, ShutdownEngine):
                    engine.finish_in_flight()
                    return
                if isinstance(message, GrammarsCompiled):  # ours to say, never the front-end's
                    self.decoder.dropped.warn("dropped a GrammarsCompiled from the front-end")
                    continue
                if isinstance(message, (AddLoRA, RemoveLoRA)):
                    self._forward_lora(message)
                outputs += engine.handle(message)
            compiled = engine.poll_grammars()
            if compiled is not None:  # an input like any other: journaled, then applied
                if self.journal is not None:
                    self.journal.record(Channel.FRONTEND_TO_CORE, self.decoder.encode(compiled),
                                        self._step(), ENGINE_CORE)
                outputs += engine.handle(compiled)
            outputs += self.refused
            self.refused = []
            if engine.has_work():
                outputs += engine.step_with_batch_queue()
            else:
                self.workers.poll_idle()
                if was_busy:  # audit the block pool whenever the engine goes idle
                    engine.scheduler.check_integrity()
            was_busy = busy
            if self.kv_events is not None:
                events = engine.take_kv_events()
                if events:
                    self.kv_events.publish(events)
            # Requests waiting for grammar work are not `busy` but still pending: the front-end
            # hears from us while any request is unfinished.
            if outputs or (engine.scheduler.has_unfinished_requests()
                           and time.monotonic() - self.last_sent > HEARTBEAT_S):
                self._send(EngineCoreOutputs(outputs, engine.scheduler.step,
                                             engine.scheduler.get_stats()))

    def _forward_lora(self, message: AddLoRA | RemoveLoRA) -> None:
        """Have the workers load (in the background) or drop an adapter; refused without
        --enable-lora (a request naming it is refused then too)."""
        if not self.config.enable_lora:
            self.decoder.dropped.warn("dropped a LoRA adapter message: LoRA is not enabled")
        elif isinstance(message, AddLoRA):
            self.workers.send_control(LoadLoRA(message.lora_request))
        else:
            self.workers.send_control(UnloadLoRA(message.lora_int_id))

    def _send(self, message: msgspec.Struct) -> None:
        frame = self.encoder.encode(message)
        if self.journal is not None:
            self.journal.record(Channel.CORE_TO_FRONTEND, frame, self._step())
        self.output.send(frame, copy=False)
        self.last_sent = time.monotonic()

    def _receive(self, timeout_ms: int) -> list[AddRequest | AbortRequests | ShutdownEngine]:
        """The front-end's messages, waiting up to timeout_ms for the first one or for a
        grammar compile to end."""
        if timeout_ms:
            self.poller.poll(timeout_ms)
        return self.decoder.receive_all(self.input, 0, self._record_input, self._refuse)

    def _refuse(self, frame: bytes, error: ProtocolError) -> None:
        """An undecodable frame: every request id we can still read gets an error answer."""
        ids = readable_request_ids(frame)
        self.decoder.dropped.warn(f"dropped a frame ({len(ids)} request ids answered with an "
                                  f"error): {error}")
        self.refused += [EngineCoreOutput(request_id, [], "error", error=f"the engine core "
                                          f"could not decode the request: {error}")
                         for request_id in ids]

    def _record_input(self, frame: bytes) -> None:
        if self.journal is not None:
            self.journal.record(Channel.FRONTEND_TO_CORE, frame, self._step())

    def _step(self) -> int:
        return self.engine.scheduler.step if self.engine is not None else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_core")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True, help="front-end -> engine core address")
    parser.add_argument("--output", required=True, help="engine core -> front-end address")
    parser.add_argument("--runtime-dir", required=True)
    args = parser.parse_args(argv)
    config = msgspec.json.decode(args.config, type=EngineConfig)
    holder: list[EngineCoreProc] = []

    def orphaned() -> None:  # the front-end is gone: do what it no longer can
        if holder:
            holder[0].workers.kill_local()
        shutil.rmtree(args.runtime_dir, ignore_errors=True)

    replica = f"_dp{config.data_parallel_rank}" if config.data_parallel_size > 1 else ""
    become_child(f"deltaserve::engine_core{replica}", orphaned)
    configure_logging()
    try:
        holder.append(EngineCoreProc(config, args.input, args.output, args.runtime_dir))
    except ValueError as e:  # e.g. an unreadable worker secret file: one line, no traceback
        logger.error("engine core cannot start: %s", e)
        return 2
    return holder[0].run()
