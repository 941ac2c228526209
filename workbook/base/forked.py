"""Forked worker processes that run one function over messages and answer in the order the
messages were put, so a pass split across cores adds up as it would on one. Forked, not
spawned: the function may be a closure over the user's task (a lambda from a notebook cell),
which spawning would have to pickle. Messages and answers travel as plain pickles (a tensor
as its bytes, not through shared memory). Nothing waits without a limit, a worker that dies or
sticks is named, and every worker is gone when the pool closes."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections import deque
from typing import Any, Callable, Iterator

from .errors import WorkbookError

WAIT_S = 600.0  # an answer longer than this names its worker as stuck
STOP_S = 5.0  # a worker asked to stop that is still there after this is terminated


def fork_available() -> bool:
    """Whether workers can be forked here (Linux; fork on macOS is unsafe with its frameworks)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, as its cause in this process."""


def _die_with(parent: int) -> None:
    """End this worker when its parent ends, however it ends (a kernel killed by the pilot):
    Linux's parent-death signal, and a check that the parent was not gone before it was set."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _serve(work: Callable[[Any], Any], tasks, answers, parent: int) -> None:
    """A worker's loop: a message in, an answer (or the exception, with its traceback) out."""
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is the parent's to handle
    gc.freeze()  # what the fork brought along is never collected here: no pass walks it
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # its threads did not fork along
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    while True:
        message = tasks.get()
        if message is None:
            return
        try:
            answer = (True, work(pickle.loads(message)))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to be raised
            text = "".join(traceback.format_exception(exc))
            try:
                pickle.loads(pickle.dumps(exc))
            except Exception:  # noqa: BLE001 - an exception that does not pickle goes as words
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            answer = (False, (exc, text))
        answers.send_bytes(pickle.dumps(answer, pickle.HIGHEST_PROTOCOL))


class ForkedWorkers:
    """`count` forked processes running `work` on what `put` is given; answers are taken as
    (meta, answer) in the order of the puts. `what` names the work in errors ("notebook 01's
    scan"), `fix` says what to change when a worker dies or sticks."""

    def __init__(self, work: Callable[[Any], Any], count: int, what: str, fix: str,
                 wait_s: float = WAIT_S):
        if not fork_available():
            raise WorkbookError(f"{what} cannot fork worker processes on {sys.platform}",
                                fix)
        self.what, self.fix, self.wait_s = what, fix, wait_s
        context = multiprocessing.get_context("fork")
        self._workers: list[tuple[Any, Any, Any]] = []  # (process, task queue, answer pipe)
        self._pending: deque[tuple[int, Any]] = deque()  # (worker, meta) of each put
        self._turn = 0
        try:
            for i in range(count):
                tasks = context.Queue()  # its feeder thread: a put never blocks on the pipe
                read, write = context.Pipe(duplex=False)
                with warnings.catch_warnings():  # Python 3.12+ warns on a fork with threads
                    warnings.filterwarnings("ignore", message=".*fork.*",
                                            category=DeprecationWarning)
                    process = context.Process(target=_serve,
                                              args=(work, tasks, write, os.getpid()),
                                              name=f"{what} worker {i}", daemon=True)
                    process.start()
                write.close()  # the worker holds the only writing end: its death reads as EOF
                self._workers.append((process, tasks, read))
        except BaseException:
            self.close(abort=True)
            raise

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def in_flight(self) -> int:
        """Messages put whose answers have not been taken."""
        return len(self._pending)

    def put(self, message: Any, meta: Any = None) -> None:
        """Queue a message for the next worker in turn (never waits: a thread feeds it)."""
        worker = self._turn % len(self._workers)
        self._turn += 1
        self._workers[worker][1].put(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        self._pending.append((worker, meta))

    def ready(self) -> bool:
        """Whether the oldest answer is back (taking it will not wait)."""
        return bool(self._pending) and self._workers[self._pending[0][0]][2].poll(0)

    def take(self) -> tuple[Any, Any]:
        """The oldest answer as (meta, answer), waiting for it (at most `wait_s`); an exception
        the worker raised is raised here, with the worker's traceback as its cause."""
        return self._answer()

    def drain(self) -> Iterator[tuple[Any, Any]]:
        """Every answer still out, in order."""
        while self._pending:
            yield self._answer()

    def _answer(self) -> tuple[Any, Any]:
        worker, meta = self._pending.popleft()
        process, _, pipe = self._workers[worker]
        deadline = time.monotonic() + self.wait_s
        while not pipe.poll(1.0):
            if not process.is_alive():
                break  # an answer it sent before dying is read below
            if time.monotonic() > deadline:
                raise WorkbookError(
                    f"{self.what}: worker {worker} (pid {process.pid}) gave no answer in "
                    f"{self.wait_s:g} s (a task that never returns, or a lock held at the fork)",
                    self.fix)
        try:
            ok, answer = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            process.join(1.0)
            code = process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else \
                f"exit code {code}"
            raise WorkbookError(f"{self.what}: worker {worker} (pid {process.pid}) died "
                                f"({how}{', out of memory?' if code == -9 else ''})",
                                self.fix) from None
        if not ok:
            exc, text = answer
            raise exc from WorkerTraceback(f"in worker {worker} (pid {process.pid}):\n{text}")
        return meta, answer

    def close(self, abort: bool = False) -> None:
        """Stop every worker (at once when `abort`, else after its queue), and wait for each."""
        for process, tasks, _ in self._workers:
            if not abort and process.is_alive():
                tasks.put(None)
        deadline = time.monotonic() + (0 if abort else STOP_S)
        for process, tasks, pipe in self._workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
            tasks.cancel_join_thread()  # nothing left to deliver to a worker that is gone
            tasks.close()
            pipe.close()
        self._workers, self._pending = [], deque()

    def __enter__(self) -> ForkedWorkers:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(abort=kind is not None)
