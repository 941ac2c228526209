"""The pilot command: execute the notebooks in order with papermill into a new run folder.
Every notebook runs under a time limit; a stuck cell or a dead kernel becomes an `error` row and
the next notebook still runs; index.json/index.csv are rewritten after every notebook, so an
interrupted pilot (SIGINT/SIGTERM, or even SIGKILL) leaves a valid index of what finished."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from .errors import WorkbookError
from .frontend import HEADLESS_ENV
from .loop import resolve_device
from .params import NOTEBOOK_DIR, defaults, stems, validate
from .params import smoke as smoke_sizes
from .report import write_report
from .runs import claim_dir, new_run_dir, write_json, write_text
from .task import load_task

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
    all_stems = stems()
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
    known = {k: v for stem in selected for k, v in defaults(stem).items()}
    validate(params, "the selected notebooks", known)
    limit = float(TIME_LIMIT["smoke" if smoke else "full"] if timeout is None else timeout)
    if not limit > 0:
        raise WorkbookError(f"--timeout must be positive, got {timeout}",
                            "give each notebook's limit in seconds")
    parameters = {}
    for stem in selected:  # check every notebook's parameters before running (or creating) any
        given = {"task": task, "task_options": task_options or {}, "device": device,
                 **(smoke_sizes(stem) if smoke else {}),
                 **{k: v for k, v in params.items() if k in defaults(stem)}}
        parameters[stem] = validate(given, stem)
    run = claim_dir(out) if out else new_run_dir(task.split(":")[0].split(".")[-1])
    for stem in selected:
        parameters[stem]["out_dir"] = str((run / stem).resolve())
    kernel = ensure_kernel()
    meta = {"task": task, "task_options": task_options or {}, "smoke": smoke,
            "time_limit_s": limit}
    rows: list[dict[str, Any]] = []
    with _headless_kernels(), _sigterm_as_interrupt():
        try:
            for stem in selected:
                rows.append(execute(stem, run, parameters[stem], kernel, limit, progress))
                write_index(run, rows, meta)
                print(f"{stem}: {rows[-1]['verdict']} ({rows[-1]['seconds']} s) "
                      f"{rows[-1]['error']}", flush=True)
        except KeyboardInterrupt:
            done = {r["notebook"] for r in rows}
            for stem in selected:
                if stem not in done:
                    rows.append(_row(stem, "interrupted", "the pilot was interrupted "
                                     "(SIGINT/SIGTERM) before this notebook finished"))
            write_index(run, rows, meta)
            write_report(run, pd.DataFrame(rows), task)
            raise
    index = pd.DataFrame(rows)
    write_report(run, index, task)
    return run, index


def _row(stem: str, verdict: str = "error", error: str = "", seconds: float = 0.0) -> dict:
    return {"notebook": stem, "verdict": verdict, "summary": f"{stem}/summary.json",
            "executed": f"{stem}.ipynb", "error": error, "seconds": seconds}


def execute(stem: str, run: Path, parameters: dict[str, Any], kernel: str, limit: float,
            progress: bool = False) -> dict[str, Any]:
    """Execute one notebook with papermill within `limit` seconds; returns its index row.
    A cell still running at the limit, or a kernel that dies, becomes an `error` row naming
    the cell; the kernel is shut down either way."""
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
    try:
        pm.execute_notebook(NOTEBOOK_DIR / f"{stem}.ipynb", partial,
                            parameters=parameters, kernel_name=kernel, progress_bar=progress,
                            cwd=os.getcwd(), timeout_func=remaining,
                            start_timeout=int(min(120, limit)))
        row["verdict"] = json.loads((run / stem / "summary.json").read_text())["verdict"]
    except pm.PapermillExecutionError as exc:  # recorded; the other notebooks still run
        row["error"] = f"{exc.ename}: {exc.evalue}"[:500]
    except CellTimeoutError:
        row["error"] = (f"time limit: the notebook did not finish within {limit:.0f} s; stuck "
                        f"in cell {_cell_name(current)} (raise the limit with --timeout "
                        "SECONDS if the machine is just slow)")
    except DeadKernelError:
        row["error"] = (f"the kernel died in cell {_cell_name(current)} (out of memory, or a "
                        "crash in native code: run the notebook in JupyterLab to see it)")
    except FileNotFoundError as exc:
        row["error"] = f"no summary.json: the notebook finished without writing it ({exc})"
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        _keep_executed(partial, run / f"{stem}.ipynb")
    if row["error"]:
        _record_error(run / stem, row["error"])
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def _record_error(folder: Path, error: str) -> None:
    """A notebook that failed keeps what it found: its summary.json (written now when the
    notebook never got that far, with the files it did write) carries the error."""
    path = folder / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else {
            "verdict": "error", "figures": {},
            "found": sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []}
    except ValueError:
        summary = {"verdict": "error", "figures": {}}
    folder.mkdir(parents=True, exist_ok=True)
    write_json(path, {**summary, "error": error})


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


@contextlib.contextmanager
def _headless_kernels() -> Iterator[None]:
    """Kernels started inside inherit WORKBOOK_HEADLESS=1: no live widgets (they can hang)."""
    before = os.environ.get(HEADLESS_ENV)
    os.environ[HEADLESS_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HEADLESS_ENV, None)
        else:
            os.environ[HEADLESS_ENV] = before


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI job cancelled, `kill`) ends the pilot like Ctrl-C: index first, then exit."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_index(run: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """index.json and index.csv for the notebooks so far (each written atomically)."""
    write_json(run / "index.json", {**meta, "notebooks": rows})
    write_text(run / "index.csv", pd.DataFrame(rows).to_csv(index=False))
