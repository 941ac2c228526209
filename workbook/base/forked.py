"""Forked worker processes that run one function over messages and answer in the order the
messages were put, so a pass split across cores adds up as it would on one. Forked, not
spawned: the function may be a closure over the user's task (a lambda from a notebook cell),
which spawning would have to pickle; a fork inherits it, and each worker's initializer holds it.
Built on `concurrent.futures.ProcessPoolExecutor`: a worker that dies breaks it at once, where a
`multiprocessing.Pool` replaces the worker and the answer it owed never comes. A message is
pickled at `put`, so one that cannot travel is named there, and both ways travel as plain pickles
(a tensor as its bytes, not through shared memory). Nothing waits without a limit, a
worker that dies or sticks is named, and every worker is gone when the pool closes."""

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
from concurrent import futures
from typing import Any, Callable, Iterator

from .errors import WorkbookError

WAIT_S = 600.0  # an answer longer than this names the workers as stuck
STOP_S = 5.0  # a worker asked to stop that is still there after this is terminated
_work: Callable[[Any], Any] | None = None  # in a worker: the function, set by `_start`


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


def _start(work: Callable[[Any], Any], parent: int) -> None:
    """A worker's set-up: it ends with its parent however that ends (a kernel killed by the
    pilot: Linux's parent-death signal, and a check that the parent was not gone before), leaves
    an interrupt to the parent, and holds `work`."""
    global _work
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()  # what the fork brought along is never collected here: no pass walks it
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # its threads did not fork along
    if "torch" in sys.modules:  # torch, where it is loaded, on one thread in each worker
        sys.modules["torch"].set_num_threads(1)
    _work = work


def _run(message: bytes) -> bytes:
    """In a worker: (True, the answer) or (False, (the exception, its traceback's text)), as a
    plain pickle (the executor's own pickler would send a tensor through shared memory)."""
    try:
        return pickle.dumps((True, _work(pickle.loads(message))), pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to be raised
        text = f"in the worker of pid {os.getpid()}:\n" + "".join(traceback.format_exception(exc))
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle goes as words
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return pickle.dumps((False, (exc, text)), pickle.HIGHEST_PROTOCOL)


class ForkedWorkers:
    """`count` forked processes running `work` on what `put` is given; answers are taken as
    (meta, answer) in the order of the puts. `what` names the work in errors ("notebook 01's
    scan"), `fix` says what to change when a worker dies or sticks. Close it (or use it in a
    `with`) on every way out: an interrupt included."""

    def __init__(self, work: Callable[[Any], Any], count: int, what: str, fix: str,
                 wait_s: float = WAIT_S):
        if not fork_available():
            raise WorkbookError(f"{what} cannot fork worker processes on {sys.platform}",
                                fix)
        self.what, self.fix, self.wait_s = what, fix, wait_s
        self._pool = futures.ProcessPoolExecutor(
            count, multiprocessing.get_context("fork"), _start, (work, os.getpid()))
        # the executor's own pid -> process: to tell a death and its exit code, to stop a worker
        # that is stuck (Python 3.14's kill_workers reads the same)
        self._workers = self._pool._processes
        self._pending: deque[tuple[futures.Future, Any]] = deque()  # (future, meta) of each put
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns on a fork with threads
                warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
                self._pool.submit(int)  # the executor forks every worker at its first call
        except BaseException:
            self.close(abort=True)
            raise
        # this process's end of the answers' pipe, never written here: with it closed, a worker
        # killed halfway through an answer reads as an end, not as a wait for the rest
        self._pool._result_queue._writer.close()

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def in_flight(self) -> int:
        """Messages put whose answers have not been taken."""
        return len(self._pending)

    def put(self, message: Any, meta: Any = None) -> None:
        """Queue a message for the next free worker (never waits: a thread feeds it)."""
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            self._pending.append((self._pool.submit(_run, data), meta))
        except futures.BrokenExecutor as broken:
            raise self._died() from broken

    def ready(self) -> bool:
        """Whether the oldest answer is back (taking it will not wait)."""
        return bool(self._pending) and self._pending[0][0].done()

    def take(self) -> tuple[Any, Any]:
        """The oldest answer as (meta, answer), waiting for it (at most `wait_s`); an exception
        the worker raised is raised here, with the worker's traceback as its cause."""
        future, meta = self._pending.popleft()
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                ok, answer = pickle.loads(future.result(timeout=min(1.0, self.wait_s)))
                break
            except (futures.BrokenExecutor, futures.TimeoutError):
                # a worker's death breaks the executor - or leaves it waiting, when the worker
                # died halfway through an answer
                if any(p.exitcode is not None for p in list(self._workers.values())):
                    raise self._died() from None
                if time.monotonic() > deadline:
                    self.close(abort=True)
                    raise WorkbookError(
                        f"{self.what}: a worker gave no answer in {self.wait_s:g} s (a task "
                        "that never returns, or a lock held at the fork); every worker was "
                        "stopped", self.fix) from None
        if not ok:
            exc, text = answer
            raise exc from WorkerTraceback(text)
        return meta, answer

    def drain(self) -> Iterator[tuple[Any, Any]]:
        """Every answer still out, in order."""
        while self._pending:
            yield self.take()

    def _died(self) -> WorkbookError:
        """Every worker stopped, and the error naming the one that died by its exit code (the
        others end by the SIGTERM the executor and `close` send)."""
        workers = list(self._workers.values())
        self.close(abort=True)
        deadline = time.monotonic() + 1.0  # a code the executor's thread is reaping comes soon
        while any(p.exitcode is None for p in workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        died = "; ".join(f"worker {i} (pid {p.pid}) died (" + (
            f"exit code {p.exitcode}" if p.exitcode >= 0 else f"killed by signal {-p.exitcode}" +
            (", out of memory?" if p.exitcode == -signal.SIGKILL else "")) + ")"
            for i, p in enumerate(workers) if p.exitcode not in (None, -signal.SIGTERM))
        return WorkbookError(f"{self.what}: {died or 'a worker died (its exit code is unknown)'}",
                             self.fix)

    def close(self, abort: bool = False) -> None:
        """Stop every worker (at once when `abort`, else once it is idle, within STOP_S), and
        wait for each."""
        workers = list(self._workers.values())
        self._pool.shutdown(wait=False, cancel_futures=True)  # sends each worker its stop
        deadline = time.monotonic() + (0 if abort else STOP_S)
        for process in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()  # the signal the executor stops workers with
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        self._pending.clear()

    def __enter__(self) -> ForkedWorkers:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(abort=kind is not None)
