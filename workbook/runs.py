"""Run folders: every run gets a new folder, nothing already there is overwritten."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from .artifacts import write_error
from .errors import WorkbookError

CHECKOUT = Path(__file__).resolve().parents[1]
_UMASK = os.umask(0o022)
os.umask(_UMASK)
# Interactive runs land in the checkout's runs/ folder (ignored by git) unless WORKBOOK_RUNS is set.
RUNS_ROOT = Path(os.environ.get("WORKBOOK_RUNS", CHECKOUT / "runs"))


def shown(path: str | Path) -> str:
    """A path as people should see it: relative to the working folder when it lies there or in
    this checkout (committed notebook outputs must not carry one machine's checkout path)."""
    full = Path(os.path.abspath(path))  # not resolve(): a venv's python is a symlink to keep
    if full.is_relative_to(os.getcwd()) or full.is_relative_to(CHECKOUT):
        return os.path.relpath(full)
    return str(path)


def fresh_process(args: list[str], timeout: float, what: str = "the command",
                  launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python [LAUNCHER] -m workbook ARGS` in a new process (nothing shared with this one),
    within `timeout` seconds; the working folder is importable, as it is for the pilot's
    kernels. The process gets its own session, so a timeout kills it with every process it
    started (torchrun's workers included)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, *launcher, "-m", "workbook", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:
        stop_tree(proc)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise WorkbookError(f"{what} did not finish within {timeout:.0f} s",
                                "the machine may be overloaded or the task stuck; run `python "
                                f"{shlex.join([*launcher, '-m', 'workbook', *args])}` by hand "
                                "to see where") from None
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop a process and everything it started, including children that moved to their own
    session (torchrun's workers do): SIGTERM first, so a launcher can stop its workers, then
    SIGKILL to whatever is left. Its pipes are drained with a time limit."""
    tree = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=grace)
            if sig == signal.SIGTERM and not any(process_alive(pid) for pid in tree[1:]):
                return
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def process_alive(pid: int | None) -> bool:
    """Whether a process with this id runs (a zombie, exited but not yet reaped, does not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError, IndexError):
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def task_args(task: str, options: dict | None = None) -> list[str]:
    """`--task T --option K=V ...`: how a command in a new process is told its task."""
    return ["--task", task, *[f"--option={k}={v!r}" for k, v in sorted((options or {}).items())]]


def claim_dir(path: str | Path) -> Path:
    """Create `path` for a new run; an existing non-empty folder is refused, never reused."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise WorkbookError(f"output folder {path} is a file", "choose a new --out folder")
    if path.exists() and any(path.iterdir()):
        raise WorkbookError(f"output folder {path} already holds a run",
                            "choose a new --out folder (runs are never overwritten)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise WorkbookError(f"cannot create the output folder {path}: {exc.strerror or exc}",
                            "choose a writable --out folder (not under a file, /proc or a "
                            "read-only mount)") from None
    return path


def new_run_dir(label: str, root: str | Path | None = None) -> Path:
    """A fresh folder `root/<timestamp>-<label>`; a suffix keeps it unique within a second."""
    root = RUNS_ROOT if root is None else root
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "run"
    for n in range(1000):
        path = Path(root) / (f"{stamp}-{slug}" + (f"-{n}" if n else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise WorkbookError(f"no free run folder name under {root}", "clean up old runs")


def notebook_dir(out_dir: str, notebook: str) -> Path:
    """The folder a notebook writes into: the one it was given, or a new run folder."""
    return claim_dir(out_dir) if out_dir else new_run_dir(notebook)


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN and infinities become strings, numpy scalars plain numbers."""
    if hasattr(value, "item") and not isinstance(value, (list, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_text(path: str | Path, text: str) -> Path:
    """Write a text file atomically: a temporary file in the same folder, then a rename. A
    failed write (disk full, permissions) leaves neither a partial file nor the temporary one
    and becomes a `WorkbookError` naming the path."""
    path = Path(path)
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp",
                                         prefix=f".{path.name}.") as handle:
            tmp = handle.name
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # a temporary file is private; the result is not
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise write_error("file", path, exc) from exc
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, data: Any) -> Path:
    """Write JSON atomically (see `write_text`)."""
    return write_text(path, json.dumps(_clean(data), indent=1, sort_keys=True))


def write_summary(out_dir: Path, verdict: str, figures: dict[str, Any], **extra: Any) -> Path:
    """`summary.json`: the verdict ("pass"/"fail") and the key figures, read by the pilot."""
    if verdict not in ("pass", "fail"):
        raise ValueError(f"verdict must be 'pass' or 'fail', not {verdict!r}")
    return write_json(Path(out_dir) / "summary.json", {"verdict": verdict, "figures": figures,
                                                       **extra})


def save_table(frame: pd.DataFrame, out_dir: Path, name: str) -> Path:
    """Store a table as CSV (for people) and JSON records (for programs)."""
    write_text(Path(out_dir) / f"{name}.csv", frame.to_csv(index=False))
    write_json(Path(out_dir) / f"{name}.json", frame.to_dict(orient="records"))
    return Path(out_dir) / f"{name}.csv"
