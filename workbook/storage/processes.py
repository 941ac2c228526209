"""Child processes: a workbook command run in a fresh process within a time limit, never
outliving the one that started it, its outcome handed back in a file; a process tree stopped."""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import psutil

from ..base.errors import WorkbookError
from .files import open_plain, write_error, write_json

# The option a fresh process writes its outcome to (a new file the parent named): commands talk
# to each other through files, never stdout, which the task's own prints share.
RESULT_OPTION = "--result"


def command_line(args: list[Any]) -> str:
    """A command as a line to paste into a shell: every word quoted (`shlex.quote`), so a task
    name, path or option such as `x$(rm -rf ~):task` stays one inert word; a path from the
    home folder (`~/...`, as `runs.shown` writes it) keeps its `~/` outside the quotes."""
    return " ".join("~/" + shlex.quote(w[2:]) if w.startswith("~/") and len(w) > 2 else
                    shlex.quote(w) for w in map(str, args))


def workbook_command(args: list[Any], launcher: tuple[str, ...] = ()) -> str:
    """`python [LAUNCHER] -m workbook ARGS`, quoted for a shell (see `command_line`)."""
    return command_line(["python", *launcher, "-m", "workbook", *args])


def fresh_process(args: list[str], timeout: float, what: str = "the command",
                  launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python [LAUNCHER] -m workbook ARGS` in a new process (nothing shared with this one),
    within `timeout` seconds; the working folder is importable, as it is for the pilot's
    kernels. The process gets its own session, so a timeout kills it with every process it
    started (torchrun's workers included). Its output is only for people (whatever bytes the
    task prints are read, undecodable ones replaced); results come back in files
    (`fresh_result`). It reads no input: a task asking for some gets end-of-file, not a hang."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, *launcher, "-m", "workbook", *args]
    proc = start_child(command, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:
        stop_tree(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise WorkbookError(f"{what} did not finish within {timeout:.0f} s",
                                "the machine may be overloaded or the task stuck; run "
                                f"{workbook_command(args, launcher)} by hand to see "
                                "where") from None
        raise
    finally:
        _CHILDREN.discard(proc)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


# Run by a child before it becomes the command it was started for (os.execv keeps its pid):
# on Linux it asks for SIGTERM when its parent ends (PR_SET_PDEATHSIG), so a child outlives
# neither a parent killed by SIGKILL nor a kernel the pilot shut down; SIGTERM reaches torchrun,
# which stops its workers, and `python -m workbook` ends through its cleanup (exit 130).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(130)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")
_CHILDREN: set[subprocess.Popen] = set()


def start_child(command: list[str], **popen: Any) -> subprocess.Popen:
    """Start `command` (its first word an executable path) so that it never outlives this
    process: in a session of its own (a timeout or an exit stops it with everything it started,
    `stop_tree`), ended by SIGTERM when this process ends however it ends (on Linux, through
    PR_SET_PDEATHSIG, set when it is started from the main thread: the signal follows the
    thread that started it), and stopped at this process's normal exit. It reads no input; its
    output comes back through pipes (text, undecodable bytes replaced). The helper for every
    child process the workbook starts (`fresh_process`; notebook 09's torchrun launches go
    through it too)."""
    wrap = sys.platform.startswith("linux") and \
        threading.current_thread() is threading.main_thread()
    argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command] if wrap \
        else list(command)
    popen = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
             "encoding": "utf-8", "errors": "replace", **popen}
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    proc.args = list(command)
    _CHILDREN.add(proc)
    return proc


@atexit.register
def stop_children() -> None:
    """Stop every child `start_child` started that still runs (at exit, or on a signal)."""
    for proc in list(_CHILDREN):
        if proc.poll() is None:
            stop_tree(proc, grace=2.0)
        _CHILDREN.discard(proc)


def fresh_result(args: list[str], timeout: float, what: str = "the command",
                 launcher: tuple[str, ...] = ()) -> tuple[dict | None, subprocess.CompletedProcess]:
    """`fresh_process` for a command that hands back its outcome in a file: the process is
    given `--result PATH`, a new name in a private folder made for it (mode 0700), and writes
    its outcome there atomically (`hand_back`). Returns that outcome (None when the process
    wrote none, e.g. it crashed) and the finished process; the folder is removed."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="workbook-result-"))
    except OSError as exc:
        raise write_error("the result folder in", Path(tempfile.gettempdir()), exc) from exc
    path = folder / "result.json"
    try:
        done = fresh_process([*args, RESULT_OPTION, str(path)], timeout, what, launcher)
        return read_result(path), done
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_result(path: Path) -> dict | None:
    """The outcome a command handed back in `path`, or None when there is none in our format."""
    from . import schemas

    try:
        with open_plain(Path(path)) as handle:
            outcome = schemas.parse_json(handle.read(), path, "result")
        schemas.check(schemas.Outcome, outcome, path, "result")
    except (OSError, WorkbookError):
        return None
    return outcome


def hand_back(path: str | Path | None, command: str, exit_code: int, result: dict | None = None,
              error: WorkbookError | None = None) -> None:
    """Write a command's outcome to the result file its parent named (atomically, never over an
    existing file): `{"command", "exit_code", "result", "error": {"problem", "fix"}}`."""
    if path is None:
        return
    write_json(path, {"command": command, "exit_code": exit_code, "result": result,
                      "error": None if error is None else {"problem": error.problem,
                                                           "fix": error.fix}},
               overwrite=False)


def outcome_error(outcome: dict | None, done: subprocess.CompletedProcess, what: str) -> str:
    """What went wrong in a fresh process, for a table: its handed-back error, else the end of
    its error output, else its exit code."""
    error = (outcome or {}).get("error")
    if isinstance(error, dict):
        return f"{error.get('problem')}\n  -> fix: {error.get('fix')}"
    return done.stderr.strip()[-600:] or f"{what} exited with code {done.returncode} and " \
        "handed back no result"


@contextlib.contextmanager
def signals_as_interrupt(interrupted: threading.Event | None = None) -> Iterator[None]:
    """SIGTERM (a CI job cancelled, `kill`, the parent ended: `start_child`), SIGHUP (the
    terminal closed) and Ctrl-C's SIGINT (where Python's own handler is in place) end a command
    as KeyboardInterrupt, so every writer's cleanup runs (no temporary file, folder or process
    is left) and it exits 130; `interrupted` is set first (the pilot then interrupts its
    kernel's running cell before shutting it down, so the cell's own cleanup runs too)."""
    def interrupt(signum, frame):
        if interrupted is not None:
            interrupted.set()
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is None or (sig == signal.SIGINT and
                           signal.getsignal(sig) is not signal.default_int_handler):
            continue  # Ctrl-C ignored (a background job): left so
        with contextlib.suppress(ValueError, OSError):  # not the main thread: left alone
            previous[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop a process and everything it started, including children that moved to their own
    session (torchrun's workers do): SIGTERM first, so a launcher can stop its workers, then
    SIGKILL to whatever is left. Its pipes are drained with a time limit."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):  # not yet reaped: its pid is still its own
        if proc.returncode is None:
            tree.append(psutil.Process(proc.pid))
            tree += tree[0].children(recursive=True)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in tree:
            with contextlib.suppress(psutil.Error):  # ended, or its pid reused: not signalled
                process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=grace)
            if sig == signal.SIGTERM and not psutil.wait_procs(tree[1:], timeout=0)[1]:
                return
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def process_alive(pid: int | None) -> bool:
    """Whether a process with this id runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return bool(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def task_args(task: str, options: dict | None = None) -> list[str]:
    """`--task T --option K=V ...`: how a command in a new process is told its task."""
    return ["--task", task, *[f"--option={k}={v!r}" for k, v in sorted((options or {}).items())]]
