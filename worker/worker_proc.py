"""A worker process: one rank, connected to the engine core, running steps in order."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import traceback

import msgspec
import torch
import zmq

from launch.process import become_child, configure_logging, set_title
from protocol import (Channel, Codec, ModelRunnerOutput, ProtocolError, SchedulerOutput,
                      WorkerConfig, WorkerError, WorkerHello, WorkerInit, WorkerReady,
                      WorkerShutdown)
from worker.model_runner import ModelRunner, resolve_device
from worker.tensor_parallel import TensorParallel

logger = logging.getLogger("deltaserve")


class WorkerProc:
    """Hello -> Init -> load model and KV cache -> Ready, then one step per message.

    Only rank 0 answers steps. Any failure is reported as `WorkerError` before exiting. The
    process also exits when the engine core's connection drops (e.g. it was killed).
    """

    def __init__(self, address: str, rank: int) -> None:
        self.rank = rank
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, f"rank-{rank}-{os.getpid()}".encode())
        self.socket.setsockopt(zmq.LINGER, 2000)  # deliver a last WorkerError before exiting
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.encoder, self.decoder = Codec(Channel.WORKER_TO_CORE), Codec(Channel.CORE_TO_WORKER)
        self.step = 0  # the step being run, for error reports

    def run(self) -> int:
        try:
            self._send(WorkerHello(self.rank, os.getpid(), socket.gethostname()))
            init = self._receive()
            if not isinstance(init, WorkerInit):
                return 0  # refused, or shut down before starting
            runner = self._start(init.config)
            return self._serve(runner)
        except Exception as e:
            logger.error("worker_%d failed:\n%s", self.rank, traceback.format_exc())
            self._send(WorkerError(self.rank, f"{type(e).__name__}: {e}", self.step))
            return 1
        finally:
            self.monitor.close(linger=0)
            self.socket.close()
            self.context.term()

    def _start(self, config: WorkerConfig) -> ModelRunner:
        world = config.tensor_parallel_size
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // world))
        device = resolve_device(config.device)
        if device.type == "cuda" and config.device in ("auto", "cuda"):
            device = torch.device("cuda", self.rank % torch.cuda.device_count())
            config = msgspec.structs.replace(config, device=str(device))
        tp = TensorParallel.initialize(self.rank, world, config.dist_init_method, device)
        runner = ModelRunner(config, tp)
        self._send(WorkerReady(self.rank, runner.num_blocks, runner.max_model_len,
                               str(runner.device), runner.attention.name,
                               runner.model_config.vocab_size,
                               str(runner.dtype).removeprefix("torch.")))
        return runner

    def _serve(self, runner: ModelRunner) -> int:
        while True:
            message = self._receive()
            if message is None or isinstance(message, WorkerShutdown):
                runner.tp.shutdown()
                return 0
            if isinstance(message, SchedulerOutput):
                self.step = message.step
                output: ModelRunnerOutput = runner.execute_model(message)
                if self.rank == 0:
                    self._send(output)

    def _send(self, message) -> None:
        self.socket.send(self.encoder.encode(message), copy=False)

    def _receive(self):
        """The next valid message; None if the engine core went away. Malformed frames are
        logged and dropped."""
        while True:
            events = dict(self.poller.poll())
            if self.monitor in events:
                logger.error("worker_%d: the engine core disconnected; exiting", self.rank)
                return None
            try:
                return self.decoder.decode(self.socket.recv())
            except ProtocolError as e:
                logger.warning("worker_%d dropped a frame: %s", self.rank, e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve worker",
                                     description="Run one worker rank and join an engine.")
    parser.add_argument("--connect", required=True, help="the engine core's worker address")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    if os.environ.get("DELTASERVE_PARENT_PID"):
        become_child(f"deltaserve::worker_{args.rank}")
    else:
        set_title(f"deltaserve::worker_{args.rank}")
    configure_logging()
    return WorkerProc(args.connect, args.rank).run()


if __name__ == "__main__":
    sys.exit(main())
