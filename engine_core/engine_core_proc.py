"""The engine-core process: sockets and a busy loop around an `EngineCore`."""
from __future__ import annotations

import argparse
import logging
import traceback

import msgspec
import zmq

from engine_core.engine_core import EngineCore
from engine_core.worker_group import WorkerFailure, WorkerGroup
from protocol.journal_header import open_journal
from common.process import POLL_MS, become_child, configure_logging
from protocol import (AbortRequests, AddRequest, Channel, Codec, EngineConfig, EngineCoreOutput,
                      EngineCoreOutputs, EngineFailed, EngineReady, ShutdownEngine)

logger = logging.getLogger("deltaserve")


class EngineCoreProc:
    """Single-threaded: drain the front-end's messages, run a step whenever there is work,
    send its outputs; while idle, block on the front-end socket for at most POLL_MS and check
    the workers. Every frame goes through `_send`/`_receive`, the journal's one hook."""

    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 runtime_dir: str) -> None:
        self.config = config
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_address)
        self.decoder, self.encoder = Codec(Channel.FRONTEND_TO_CORE), Codec(Channel.CORE_TO_FRONTEND)
        self.journal = open_journal(config) if config.record_path else None
        self.workers = WorkerGroup(config, self.context, runtime_dir,
                                   self.journal.record if self.journal else None)
        self.engine: EngineCore | None = None

    def run(self) -> int:
        try:
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
            self.workers.shutdown()
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
                                        ready.vocab_size)
        self._send(EngineReady(ready.max_model_len, ready.num_blocks, c.block_size,
                               c.tensor_parallel_size, ready.vocab_size,
                               ready.attention_backend))
        logger.info("engine core ready: max_model_len %d, %d KV blocks of %d tokens",
                    ready.max_model_len, ready.num_blocks, c.block_size)
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
                outputs += engine.handle(message)
            if engine.has_work():
                outputs += engine.step_with_batch_queue()
            else:
                self.workers.check_alive()
                if was_busy:  # audit the block pool whenever the engine goes idle
                    engine.scheduler.check_integrity()
            was_busy = busy
            if outputs:
                self._send(EngineCoreOutputs(outputs, engine.scheduler.step,
                                             engine.scheduler.get_stats()))

    def _send(self, message: msgspec.Struct) -> None:
        frame = self.encoder.encode(message)
        if self.journal is not None:
            self.journal.record(Channel.CORE_TO_FRONTEND, frame, self._step())
        self.output.send(frame, copy=False)

    def _receive(self, timeout_ms: int) -> list[AddRequest | AbortRequests | ShutdownEngine]:
        return self.decoder.receive_all(self.input, timeout_ms, self._record_input)

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
    become_child("deltaserve::engine_core")
    configure_logging()
    config = msgspec.json.decode(args.config, type=EngineConfig)
    return EngineCoreProc(config, args.input, args.output, args.runtime_dir).run()
