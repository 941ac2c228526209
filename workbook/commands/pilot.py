"""The pilot command: execute the notebooks in order with papermill into a new run folder.
Every notebook runs under a time limit; a stuck cell or a dead kernel becomes an `error` row and
the next notebook still runs; index.json/index.csv are rewritten after every notebook, so an
interrupted pilot (SIGINT/SIGTERM, or even SIGKILL) leaves a valid index of what finished."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pandas as pd

from ..base.errors import WorkbookError
from ..base.progress import HEADLESS_ENV
from ..contract.task import load_task
from ..notebooks import registry
from ..notebooks.registry import RENTAL
from ..storage import runs
from ..storage.files import write_json, write_text
from ..storage.processes import signals_as_interrupt
from ..storage.runs import RUNS_ROOT, claim_dir, new_run_dir, sweep_runs
from ..training.devices import resolve_device
from .params import NOTEBOOK_DIR, validate
from .params import smoke as smoke_sizes
from .report import write_report

KERNEL = "workbook"
# Per-notebook wall-clock limits in seconds: generous for a busy 2-core machine (a full notebook
# takes minutes there, a smoke one well under one); `--timeout` overrides both.
TIME_LIMIT = {"full": 3600, "smoke": 600}
# Options the pilot owns: a notebook parameter of the same name would contradict index.json.
OWNED = {"task": "--task", "task_options": "--option", "out_dir": "--out", "device": "--device"}


def ensure_kernel() -> str:
    """Register this interpreter as the `workbook` Jupyter kernel when it is not yet known."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        if Path(spec.argv[0]).resolve() == Path(sys.executable).resolve():
            return KERNEL
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL, display_name="Python (workbook)", prefix=sys.prefix)
    return KERNEL


def select(only: str | None) -> list[str]:
    """Notebook stems to run, in order; `only` is a comma list of numbers like "01,02"."""
    all_stems = registry.stems()
    if only is None:
        return all_stems
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    if not wanted:
        raise WorkbookError(f"--only {only!r} names no notebook",
                            f"use numbers from {[s.split('_')[0] for s in all_stems]}, "
                            "e.g. --only 01,02, or leave --only out to run them all")
    unknown = [w for w in wanted if not any(s.startswith(w + "_") for s in all_stems)]
    if unknown:
        raise WorkbookError(f"--only names unknown notebooks {unknown}",
                            f"use numbers from {[s.split('_')[0] for s in all_stems]}")
    return [s for s in all_stems if s.split("_")[0] in wanted]


def rental_memory(params: dict[str, Any]) -> dict[str, Any]:
    """03 judges the plan against the GPU 08 rents: `-p rental_gpu=L4` (with 08's `gpus`,
    given or default) sets 03's `device_memory_gib` unless that is given too."""
    if "rental_gpu" not in params or "device_memory_gib" in params:
        return {}
    gpus = params.get("gpus", RENTAL.parameters().gpus)
    gib = gpus.get(params["rental_gpu"]) if isinstance(gpus, dict) else None
    return {"device_memory_gib": float(gib)} if isinstance(gib, (int, float)) else {}


def run_pilot(task: str, out: str | None = None, smoke: bool = False, only: str | None = None,
              task_options: dict | None = None, device: str = "cpu", progress: bool = True,
              params: dict[str, Any] | None = None,
              timeout: float | None = None) -> tuple[Path, pd.DataFrame]:
    """Run the selected notebooks for `task`; returns the run folder and its index table.
    `params` go to every notebook that has a parameter of that name; `timeout` is each
    notebook's limit in seconds (default `TIME_LIMIT`)."""
    selected = select(only)
    params = dict(params or {})
    owned = sorted(set(params) & set(OWNED))
    if owned:
        raise WorkbookError(f"-p {', '.join(owned)} would override the pilot's own options",
                            "use " + ", ".join(f"{OWNED[k]} instead of -p {k}" for k in owned))
    load_task(task, **(task_options or {}))  # fail now, not inside the first notebook
    resolve_device(device)  # a GPU asked for but absent fails here, not after notebook 01
    validate(params, selected)
    limit = float(TIME_LIMIT["smoke" if smoke else "full"] if timeout is None else timeout)
    if not (math.isfinite(limit) and limit > 0):
        raise WorkbookError(f"--timeout must be a positive finite number of seconds, got "
                            f"{timeout}", "give each notebook's limit in seconds, e.g. "
                            "--timeout 1800")
    parameters = {}
    params = {**rental_memory(params), **params}
    for stem in selected:  # check every notebook's parameters before running (or creating) any
        entry = registry.entry(stem)
        given = {"task": task, "task_options": task_options or {}, "device": device,
                 **(smoke_sizes(stem) if smoke else {}),
                 **{k: v for k, v in params.items() if k in entry.parameters.names()}}
        parameters[stem] = entry.check(given)
    sweep_runs(Path(out).parent if out else RUNS_ROOT)  # what killed runs left half-written
    run = claim_dir(out) if out else new_run_dir(task.split(":")[0].split(".")[-1])
    for stem in selected:
        parameters[stem] = {**parameters[stem].model_dump(),  # papermill's literals
                            "out_dir": str((run / stem).resolve())}
    kernel = ensure_kernel()
    meta = {"task": task, "task_options": task_options or {}, "smoke": smoke,
            "time_limit_s": limit}
    rows: list[dict[str, Any]] = []
    space = _Reserve(run)  # what index and report still need when a notebook fills the disk
    # Ctrl-C, SIGTERM (a CI job cancelled, `kill`) and SIGHUP (the terminal closed) end the
    # pilot: the kernel's running cell is interrupted (its children stopped, its temporary
    # folders removed), the kernel shut down, the index and report written, then exit 130.
    interrupted = threading.Event()
    try:
        # kernels started inside inherit WORKBOOK_HEADLESS=1: no live widgets (they can hang);
        # and the run folder, which the paths they show are relative to (`runs.shown`)
        with mock.patch.dict(os.environ, {HEADLESS_ENV: "1", runs.RUN_ENV: str(run.resolve())}), \
                signals_as_interrupt(interrupted):
            try:
                for stem in selected:
                    rows.append(execute(stem, run, parameters[stem], kernel, limit, progress,
                                        interrupted))
                    error = rows[-1]["error"]
                    space.check(error)
                    if error:  # a full disk: written from the reserve
                        space.write(lambda: _record_error(run / stem, error))  # noqa: B023
                    space.write(lambda: write_index(run, rows, meta))
                    print(f"{stem}: {rows[-1]['verdict']} ({rows[-1]['seconds']} s) "
                          f"{rows[-1]['error']}", flush=True)
            except KeyboardInterrupt:
                logging.getLogger("asyncio").addFilter(_ended_kernel_task)
                done = {r["notebook"] for r in rows}
                for stem in selected:
                    if stem not in done:
                        rows.append(_row(stem, "interrupted", "the pilot was interrupted "
                                         "(SIGINT/SIGTERM) before this notebook finished"))
                space.release()
                write_index(run, rows, meta)
                write_report(run, pd.DataFrame(rows), task, export=not space.low)
                raise
        index = pd.DataFrame(rows)
        space.release()
        write_report(run, index, task, export=not space.low)
    finally:
        space.release()
    return run, index


# Kept free in the run folder while the notebooks run (a file of this size, allocated on the
# disk): when a notebook fills the disk, it is given back, so index.json, index.csv and
# report.html of what finished can still be written.
RESERVE_BYTES = 4 * 2**20
RESERVE = ".workbook-reserve"


class _Reserve:
    """Space set aside for the index and the report (RESERVE_BYTES), given back when the disk
    is nearly full (`check`), when a write of the index fails (`write`) and at the end."""

    def __init__(self, run: Path):
        self.path: Path | None = Path(run) / RESERVE
        self.low = False
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            self.path = None
            return
        try:
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            except (AttributeError, OSError) as exc:
                if getattr(exc, "errno", None) == errno.ENOSPC:
                    raise
                for _ in range(RESERVE_BYTES // 2**20):  # no fallocate on this file system
                    os.write(fd, bytes(2**20))
        except OSError:  # not even this much space: the pilot runs without a reserve
            os.close(fd)
            self.release()
            return
        os.close(fd)

    def check(self, error: str) -> None:
        """Give the space back when a notebook met a full disk or little is left."""
        try:
            free = shutil.disk_usage(self.path.parent).free if self.path else RESERVE_BYTES
        except OSError:
            free = 0
        if free < RESERVE_BYTES or any(w in error for w in ("No space left", "free space on",
                                                            "Disk quota")):
            self.low = True
            self.release()

    def write(self, write: Callable[[], Any]) -> None:
        """Run a write of the index; when the disk refuses it, give the space back and retry
        once (a second refusal names the path and the fix)."""
        try:
            write()
        except WorkbookError:
            if self.path is None:
                raise
            self.low = True
            self.release()
            write()

    def release(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.path = None


def _row(stem: str, verdict: str = "error", error: str = "", seconds: float = 0.0) -> dict:
    return {"notebook": stem, "verdict": verdict, "summary": f"{stem}/summary.json",
            "executed": f"{stem}.ipynb", "error": error, "seconds": seconds}


def execute(stem: str, run: Path, parameters: dict[str, Any], kernel: str, limit: float,
            progress: bool = False, interrupted: threading.Event | None = None
            ) -> dict[str, Any]:
    """Execute one notebook with papermill within `limit` seconds; returns its index row.
    A cell still running at the limit, or a kernel that dies, becomes an `error` row naming
    the cell; the kernel is shut down either way (its running cell interrupted first once
    `interrupted` is set)."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    start = time.monotonic()
    deadline = start + limit
    current: dict[str, Any] = {}

    def remaining(cell) -> int:  # nbclient asks this before every cell
        current["cell"] = cell
        return max(1, math.ceil(deadline - time.monotonic()))

    row = _row(stem)
    partial = run / f".{stem}.partial.ipynb"  # papermill saves as it goes; renamed when done
    started: list = []  # the notebook's kernel managers
    try:
        pm.execute_notebook(NOTEBOOK_DIR / f"{stem}.ipynb", _atomic(partial),
                            parameters=parameters, kernel_name=kernel, progress_bar=progress,
                            cwd=os.getcwd(), timeout_func=remaining,
                            start_timeout=int(min(120, limit)),
                            kernel_manager_class=_kernel_manager(run / KERNEL_LOG, interrupted,
                                                                 started))
        summary = runs.read_summary(run / stem)  # a WorkbookError when it cannot be read
        if summary is None:
            row["error"] = "no summary.json: the notebook finished without writing it"
        else:
            row["verdict"] = summary["verdict"]
    except pm.PapermillExecutionError as exc:  # recorded; the other notebooks still run
        row["error"] = f"{exc.ename}: {exc.evalue}"[:500]
    except CellTimeoutError:
        row["error"] = (f"time limit: the notebook did not finish within {limit:.0f} s; stuck "
                        f"in cell {_cell_name(current)} (raise the limit with --timeout "
                        "SECONDS if the machine is just slow)")
    except DeadKernelError:
        row["error"] = (f"the kernel died in cell {_cell_name(current)} (out of memory, or a "
                        "crash in native code: run the notebook in JupyterLab to see it)")
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        _keep_executed(partial, run / f"{stem}.ipynb")
        for manager in started:  # a kernel interrupted while it started, which nbclient
            _end_starting(manager)  # leaves running (it cleans up on an Exception only)
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


# papermill saves the executed notebook after its cells through this scheme: each save is a
# whole file under a temporary name, renamed over the last one (`write_text`), so a full disk
# or a kill leaves the last complete save, never a truncated notebook.
ATOMIC = "workbook-atomic://"
# Kernels' own output (not the notebooks': that is in each executed notebook): warnings, and
# what a kernel shut down while a cell ran says as it goes (zmq's "Socket operation on
# non-socket" after SIGTERM or Ctrl-C), kept here rather than printed over the pilot's output.
KERNEL_LOG = "kernels.log"


class _AtomicIO:
    """papermill's I/O handler for ATOMIC paths (a local file written atomically)."""

    @staticmethod
    def _path(path: str) -> str:
        return path[len(ATOMIC):]

    def read(self, path: str) -> str:
        return Path(self._path(path)).read_text(encoding="utf-8")

    def listdir(self, path: str) -> list[str]:
        return [os.path.join(self._path(path), f) for f in os.listdir(self._path(path))]

    def write(self, buf: str, path: str) -> None:
        write_text(Path(self._path(path)), buf)

    def pretty_path(self, path: str) -> str:
        return self._path(path)


def _atomic(path: Path) -> str:
    from papermill.iorw import papermill_io

    if not any(scheme == ATOMIC for scheme, _ in papermill_io._handlers):
        papermill_io.register(ATOMIC, _AtomicIO())
    return ATOMIC + str(Path(path).resolve())


def _end_starting(manager: Any) -> None:
    """End a kernel still running after its notebook (Ctrl-C came while it started: it never
    ran a cell) and remove its connection file, once the kernel cannot write it again."""
    process = getattr(getattr(manager, "provisioner", None), "process", None)
    if process is not None and process.poll() is None:
        process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
    manager.cleanup_connection_file()


def _kernel_manager(log: Path, interrupted: threading.Event | None = None,
                    started: list | None = None) -> type:
    """A kernel manager whose kernels write their own output (not the cells') to `log`; once
    `interrupted` is set (the pilot was), its shutdown interrupts the running cell first. Each
    one that starts a kernel is added to `started`."""
    from jupyter_client.manager import AsyncKernelManager

    class QuietKernelManager(AsyncKernelManager):
        async def start_kernel(self, **kw: Any) -> None:
            if started is not None:
                started.append(self)
            try:
                handle = open(log, "ab")  # noqa: SIM115 - the kernel holds it while it runs
            except OSError:
                handle = subprocess.DEVNULL
            try:
                return await super().start_kernel(**{"stdout": handle, "stderr": handle, **kw})
            finally:
                if handle is not subprocess.DEVNULL:
                    handle.close()  # the kernel has its own copy

        async def _async_interrupt_kernel(self) -> None:
            # jupyter_client interrupts (SIGINT) before every shutdown request: a kernel that
            # finished its notebook then writes a KeyboardInterrupt into kernels.log. A stuck
            # one is still ended - after the request, SIGTERM then SIGKILL - and a cell's time
            # limit still interrupts (not during a shutdown), and so does the pilot's own
            # interrupt: the cell's cleanup runs before the kernel is ended.
            if not self.shutting_down or (interrupted is not None and interrupted.is_set()):
                await super()._async_interrupt_kernel()

    return QuietKernelManager


def _record_error(folder: Path, error: str) -> None:
    """A notebook that failed keeps what it found: its summary.json (written now when the
    notebook never got that far, with the files it did write) carries the error."""
    try:
        summary = runs.read_summary(folder) or {
            "verdict": "error", "figures": {},
            "found": sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []}
    except WorkbookError:
        summary = {"verdict": "error", "figures": {}}
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "summary.json", {**summary, "error": error})


def _keep_executed(partial: Path, final: Path) -> None:
    """The executed notebook under its name when it is complete JSON; a copy truncated by a
    full disk or a kill is removed rather than left to confuse a reader."""
    if not partial.exists():
        return
    try:
        json.loads(partial.read_text())
        os.replace(partial, final)
    except (ValueError, OSError):
        partial.unlink(missing_ok=True)


def _cell_name(current: dict[str, Any]) -> str:
    cell = current.get("cell")
    if cell is None:
        return "(before the first cell)"
    lines = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.startswith("#")]
    return f"{cell.get('execution_count') or ''} `{(lines or [''])[0][:80]}`".strip()


def _ended_kernel_task(record: logging.LogRecord) -> bool:
    """Leaves out asyncio's "Task exception was never retrieved" for the cell whose kernel an
    interrupt shut down (nbclient's DeadKernelError): the interrupt is said once, by the pilot."""
    exc = record.exc_info[1] if record.exc_info else None
    return type(exc).__name__ != "DeadKernelError"


def write_index(run: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """index.json and index.csv for the notebooks so far (each written atomically)."""
    write_json(run / "index.json", {**meta, "notebooks": rows})
    write_text(run / "index.csv", pd.DataFrame(rows).to_csv(index=False))
