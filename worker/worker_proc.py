"""A worker process: one rank, connected to the engine core, running steps in order."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
import traceback

import zmq

from common.process import become_child, configure_logging, set_title
from common.worker_auth import (
    SECRET_ENV,
    hello_proof,
    read_secret_file,
    secret_from_environment,
    secure_client,
)
from protocol import (
    Channel,
    Codec,
    EngineConfig,
    ModelRunnerOutput,
    ProtocolError,
    SchedulerOutput,
    WorkerError,
    WorkerHello,
    WorkerInit,
    WorkerReady,
    WorkerShutdown,
)
from protocol.lora import LoadLoRA, UnloadLoRA
from protocol.scheduler_output import MAX_STEP_FRAME
from worker.device import resolve_device
from worker.distributed.tensor_parallel import TensorParallel
from worker.host.setup import HostSetup, set_up_host
from worker.model_runner import ModelRunner
from worker.worker_args import add_worker_args

logger = logging.getLogger("deltaserve")


class WorkerProc:
    """Hello -> Init -> load model and KV cache -> Ready, then one step per message.

    Only rank 0 answers steps. Any failure is reported as `WorkerError` before exiting. The
    process also exits when the engine core's connection drops (e.g. it was killed).
    """

    def __init__(self, address: str, rank: int, secret: str) -> None:
        self.rank = rank
        self.secret = secret
        self.identity = f"rank-{rank}-{os.getpid()}".encode()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.identity)
        self.socket.setsockopt(zmq.LINGER, 2000)  # deliver a last WorkerError before exiting
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_STEP_FRAME)
        if address.startswith("tcp://"):
            secure_client(self.socket, secret)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.encoder, self.decoder = Codec(Channel.WORKER_TO_CORE), Codec(Channel.CORE_TO_WORKER)
        self.current_step = 0  # the step being run, for error reports
        self.orphaned = False  # the engine core went away
        self.host: HostSetup | None = None  # a CPU rank's threads, adapted between steps

    def run(self) -> int:
        try:
            pid = os.getpid()
            self._send(WorkerHello(self.rank, pid, socket.gethostname(),
                                   hello_proof(self.secret, self.rank, pid, self.identity)))
            init = self._receive()
            if not isinstance(init, WorkerInit):
                return 0  # refused, or shut down before starting
            runner = self._start(init.config, init.dist_init_method)
            return self._serve(runner)
        except Exception as e:
            logger.error("worker_%d failed:\n%s", self.rank, traceback.format_exc())
            self._send(WorkerError(self.rank, f"{type(e).__name__}: {e}", self.current_step))
            return 1
        finally:
            self.monitor.close(linger=0)
            self.socket.close()
            self.context.term()

    def _start(self, config: EngineConfig, dist_init_method: str) -> ModelRunner:
        world = config.tensor_parallel_size
        device = resolve_device(config.device, self.rank)  # the ModelRunner's too
        self.host = set_up_host(config, self.rank) if device.type == "cpu" else None
        tp = TensorParallel.initialize(self.rank, world, dist_init_method, device)
        runner = ModelRunner(config, tp)
        self._send(WorkerReady(self.rank, runner.num_blocks, runner.max_model_len,
                               str(runner.device), runner.attention.name,
                               runner.model_config.vocab_size,
                               str(runner.dtype).removeprefix("torch."),
                               runner.weights_summary, runner.sliding_windows,
                               self.host.description if self.host else "",
                               runner.kv_block_bytes))
        return runner

    def _serve(self, runner: ModelRunner) -> int:
        while True:
            message = self._receive()
            if message is None:
                return 0  # no collective teardown: the other ranks may be gone too
            if isinstance(message, WorkerShutdown):
                runner.tp.shutdown()
                return 0
            if isinstance(message, SchedulerOutput):  # (a WorkerPing needs nothing)
                self.current_step = message.step
                if self.host is not None:
                    self.host.before_step(message.total_num_scheduled_tokens)
                start = time.perf_counter()
                output: ModelRunnerOutput = runner.execute_model(message)
                if self.host is not None:
                    self.host.after_step(message.total_num_scheduled_tokens,
                                         time.perf_counter() - start)
                if self.rank == 0:
                    self._send(output)
                if self.host is not None:
                    self.host.after_send()  # /proc read here, not before the next step
            elif isinstance(message, LoadLoRA):
                runner.lora.preload(message.lora_request)
            elif isinstance(message, UnloadLoRA):
                runner.lora.unload(message.lora_int_id)

    def _send(self, message) -> None:
        self.socket.send(self.encoder.encode(message), copy=False)

    def _receive(self):
        """The next valid message; None if the engine core went away. Malformed frames are
        logged and dropped."""
        while True:
            events = dict(self.poller.poll())
            if self.monitor in events:
                logger.error("worker_%d: the engine core disconnected; exiting", self.rank)
                self.orphaned = True
                return None
            try:
                return self.decoder.decode(self.socket.recv())
            except ProtocolError as e:
                logger.warning("worker_%d dropped a frame: %s", self.rank, e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve worker",
                                     description="Run one worker rank and join an engine.")
    add_worker_args(parser)
    return run_worker(parser.parse_args(argv), parser)


def run_worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the rank that `args` (parsed with `add_worker_args`' flags) names until the engine
    lets it go; `parser` reports a missing secret."""
    try:
        secret = (read_secret_file(args.worker_secret_file) if args.worker_secret_file
                  else secret_from_environment())
    except ValueError as e:
        parser.error(str(e))
    if secret is None:
        parser.error(f"a worker needs the engine's secret: --worker-secret-file or ${SECRET_ENV}")
    if os.environ.get("DELTASERVE_PARENT_PID"):
        become_child(f"deltaserve::worker_{args.rank}")
    else:
        set_title(f"deltaserve::worker_{args.rank}")
    configure_logging()
    worker = WorkerProc(args.connect, args.rank, secret)
    code = worker.run()
    if worker.orphaned:  # skip interpreter teardown (torch's can take seconds): just go
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
