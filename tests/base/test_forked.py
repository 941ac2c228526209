"""The forked pool (base/forked.py): answers in the order put; an exception in a worker raised
here with its traceback; a worker that sticks, dies (even halfway through an answer) or is
interrupted is named and stopped, and no worker outlives the pool or its parent."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from workbook.base.errors import WorkbookError
from workbook.base.forked import ForkedWorkers, fork_available

pytestmark = pytest.mark.skipif(not fork_available(), reason="workers are forked (Linux)")


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture
def no_worker_left():
    """The processes started since the test began, none of them left at its end."""
    before = children()
    yield lambda: children() - before
    assert children() - before == set()


def slow_square(x: int) -> int:
    time.sleep(0.02 * (x % 3))
    return x * x


def test_answers_come_back_in_the_order_put(no_worker_left):
    with ForkedWorkers(slow_square, 3, what="a test", fix="-") as pool:
        assert len(pool) == 3
        for x in range(12):
            pool.put(x, meta=x)
        assert pool.in_flight == 12
        assert list(pool.drain()) == [(x, x * x) for x in range(12)]
        with pytest.raises(AttributeError):  # a message that cannot travel fails its put
            pool.put(lambda: None)
        assert pool.in_flight == 0


def test_a_tensor_comes_back_as_its_bytes_not_through_shared_memory(no_worker_left):
    with ForkedWorkers(torch.arange, 1, what="a test", fix="-") as pool:
        pool.put(5)
        back = pool.take()[1]
    assert torch.equal(back, torch.arange(5)) and not back.is_shared()


class Unpicklable(Exception):
    def __init__(self, what, handle):
        super().__init__(what)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("not this one")


def raising(kind: str):
    if kind == "value":
        raise ValueError("bad value 3")
    raise Unpicklable("odd", lambda: None)


def test_an_exception_in_a_worker_is_raised_here_with_its_traceback(no_worker_left):
    with ForkedWorkers(raising, 1, what="a test", fix="-") as pool:
        pool.put("value")
        with pytest.raises(ValueError, match="bad value 3") as raised:
            pool.take()
        assert "in raising" in str(raised.value.__cause__)
        pool.put("odd")  # the worker is still there; an exception that does not pickle
        with pytest.raises(RuntimeError, match="Unpicklable: odd"):
            pool.take()


def test_a_stuck_worker_is_named_and_stopped(no_worker_left):
    start = time.monotonic()
    with ForkedWorkers(time.sleep, 2, what="a test", fix="do less", wait_s=1.5) as pool:
        pool.put(0.1)
        pool.put(600)
        pool.take()
        with pytest.raises(WorkbookError, match=r"(?s)a test: a worker gave no answer in 1.5 s"
                                                r".*every worker was stopped.*do less"):
            pool.take()
        assert no_worker_left() == set()  # stopped at once, before the pool is closed
    assert time.monotonic() - start < 10


def dying(how: str):
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return how


@pytest.mark.parametrize("how, said", [("exit", r"died \(exit code 3\)"),
                                       ("kill", r"died \(killed by signal 9, out of memory\?\)")])
def test_a_worker_that_dies_is_named_with_its_exit_code(no_worker_left, how, said):
    start = time.monotonic()
    with ForkedWorkers(dying, 2, what="a test", fix="run with one worker") as pool:
        pool.put("fine")
        pool.put(how)
        assert pool.take() == (None, "fine")
        with pytest.raises(WorkbookError, match=r"(?s)a test: worker \d \(pid \d+\) " + said +
                                                ".*run with one worker") as raised:
            pool.take()
        assert raised.value.problem.count("died") == 1  # the other was stopped, not dead
        assert no_worker_left() == set()
        with pytest.raises(WorkbookError, match="died"):  # and the pool takes nothing more
            pool.put("fine")
    assert time.monotonic() - start < 10


def test_a_worker_that_dies_halfway_through_an_answer_is_named_and_nothing_hangs():
    """A worker killed while it sends (out of memory, or stopped by an interrupt here) leaves
    part of an answer in the pipe: the executor's reader would wait for the rest forever, and
    Python's exit with it."""
    code = """if True:
        import multiprocessing, os, struct
        from workbook.base.forked import ForkedWorkers
        def half(_):  # a length that promises 1000 bytes, 10 of them, and an end
            answers = multiprocessing.current_process()._args[1]
            os.write(answers._writer.fileno(), struct.pack("!i", 1000) + bytes(10))
            os._exit(3)
        with ForkedWorkers(half, 2, "a test", "-") as pool:
            pool.put(0)
            try:
                pool.take()
            except Exception as exc:
                print(exc)
        """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert "died (exit code 3)" in done.stdout


def test_an_interrupt_while_waiting_stops_the_pool_at_once(no_worker_left):
    main = threading.main_thread().ident
    timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ForkedWorkers(time.sleep, 2, what="a test", fix="-") as pool:
            pool.put(600)
            timer.start()
            pool.take()
    assert time.monotonic() - start < 5


def test_workers_end_with_a_parent_that_is_killed():
    """A kernel killed by the pilot (SIGKILL: no atexit, no finally) leaves no worker."""
    code = ("import time, psutil\nfrom workbook.base.forked import ForkedWorkers\n"
            "pool = ForkedWorkers(time.sleep, 2, 'a test', '-')\n"
            "print(' '.join(str(p.pid) for p in psutil.Process().children()), flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
    finally:
        parent.kill()
        parent.wait(10)
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 5
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, pids))
