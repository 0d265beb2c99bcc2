"""Starting, naming, watching and stopping deltaserve's processes."""
from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("deltaserve")
# Liveness of peers (a child process, the engine core, the workers) is checked at least this
# often while a process waits for messages.
POLL_MS = 100


def make_runtime_dir() -> str:
    """A fresh private directory (mode 0700) for one engine's ipc sockets."""
    return tempfile.mkdtemp(prefix="deltaserve-")


def spawn(module: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m module args...` as a child that survives neither us nor a Ctrl-C of its own:
    it ignores SIGINT (the parent orchestrates shutdown) and watches its parent. `env` adds to
    our environment (secrets go there, never into argv, which every user can read)."""
    env = dict(os.environ, **(env or {}), DELTASERVE_PARENT_PID=str(os.getpid()))
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env)


def become_child(title: str, on_orphaned: Callable[[], None] | None = None) -> None:
    """Process-start ritual of a spawned child: name, SIGINT policy, parent watch."""
    set_title(title)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.environ.get("DELTASERVE_PARENT_PID")
    if parent:
        watch_parent(int(parent), on_orphaned)


def set_title(title: str) -> None:
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - setproctitle is a dependency
        pass


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None] | None = None,
                 interval_s: float = 0.1) -> None:
    """Exit as soon as the parent is gone (no orphans), after `on_orphaned` (quick cleanup:
    what the parent can no longer do, e.g. removing its runtime directory). The watch blocks on
    the parent's pidfd where Linux has one (no wake-ups until the parent exits), else checks
    every `interval_s`."""
    def leave() -> None:
        try:
            if on_orphaned is not None:
                on_orphaned()
        finally:
            os._exit(1)

    def watch() -> None:
        exited = parent_exit_fd(parent_pid)
        if exited is not None:
            waiter = select.poll()
            waiter.register(exited, select.POLLIN)
            while not waiter.poll():  # readable once the parent has exited
                pass
            leave()
        while True:
            if os.getppid() != parent_pid:
                leave()
            time.sleep(interval_s)
    if os.getppid() != parent_pid:
        leave()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def parent_exit_fd(parent_pid: int) -> int | None:
    """A pidfd of our parent (readable once it exits), or None where there is none (no
    pidfd_open, or the parent is already gone)."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        return None
    if os.getppid() != parent_pid:  # gone before the fd was opened: the pid may be another's
        os.close(fd)
        return None
    return fd


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 2.0) -> None:
    """Wait up to `grace_s` for the processes to exit, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for signum in (None, signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            if signum is not None:
                p.send_signal(signum)
        for p in alive:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 1.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def configure_logging(level: int = logging.INFO) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(processName)s %(levelname)s "
                                               "%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
