"""Run folders: every run gets a new folder, nothing already there is overwritten; its
tables, summary and verdict line. (The processes a run starts: `processes`.)"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from ..base.errors import WorkbookError
from . import schemas
from .artifacts import FORMAT
from .files import sha256, write_json, write_text
from .processes import process_alive

CHECKOUT = Path(__file__).resolve().parents[2]
# Interactive runs land in the checkout's runs/ folder (ignored by git) unless WORKBOOK_RUNS is set.
RUNS_ROOT = Path(os.environ.get("WORKBOOK_RUNS", CHECKOUT / "runs"))
# Created exclusively in every folder claimed for a run: of two processes given one folder at
# once, only one can create it. A launch of notebook 09 claims its folder with LAUNCH_CLAIM.
CLAIM = ".workbook-claim"
LAUNCH_CLAIM = ".workbook-launch"


# The pilot's run folder, set for the processes it starts (its kernels and theirs): `shown`
RUN_ENV = "WORKBOOK_RUN"


def shown(path: str | Path, in_run: bool = True) -> str:
    """A path as people should see it, never one machine's folders: relative to the working
    folder when it lies there or in this checkout (committed notebook outputs), else to the
    pilot's run folder (`RUN_ENV`) when it lies there - what a reader of the run's report can
    open; not with `in_run=False`, for a command whose paths must all hold from one working
    folder - else with the home folder as `~`."""
    full = Path(os.path.abspath(path))  # not resolve(): a venv's python is a symlink to keep
    if full.is_relative_to(os.getcwd()) or full.is_relative_to(CHECKOUT):
        return os.path.relpath(full)
    run = os.environ.get(RUN_ENV)
    if in_run and run and full.is_relative_to(run):
        return os.path.relpath(full, run)
    home = _home()
    if home is not None and full.is_relative_to(home):
        return str("~" / full.relative_to(home))
    return str(path)


def _home() -> Path | None:
    """This user's home folder (None without one, or when it is the root)."""
    try:
        home = Path.home()
    except RuntimeError:
        return None
    return home if home != Path(home.anchor) else None


def shown_in(text: str, run: str | Path) -> str:
    """`text` (a page exported from what the workbook did not write: a papermill parameter, a
    task's own print) with the paths in the run folder `run` made relative to it and the home
    folder as `~`, as `shown` makes one path."""
    home = _home()
    prefixes = [(folder + os.sep, "") for folder in (os.path.abspath(run), os.path.realpath(run))]
    prefixes += [(str(home) + os.sep, "~" + os.sep)] if home else []
    for prefix, replacement in prefixes:  # the run folder first: it may lie in the home folder
        for form in {prefix, html.escape(prefix)}:
            text = text.replace(form, replacement)
    return text


PARTIAL = re.compile(r"^\..+\.partial-(\d+)-")  # artifacts' temporary: .NAME.partial-PID-*


def sweep_partials(run: Path) -> list[Path]:
    """What a killed process (SIGKILL: no cleanup ran) left half-written in the run folder
    `run` and its notebook folders: `.NAME.partial-PID-*` whose process is gone, and the
    pilot's `.NN_name.partial.ipynb` once the process that claimed the run is gone. A run
    folder is one holding the claim; anything else is left alone. Returns what was removed."""
    try:
        claimant = json.loads((Path(run) / CLAIM).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return []
    removed = []
    for folder in (Path(run), *(p for p in Path(run).iterdir() if p.is_dir() and
                                not p.is_symlink())):
        for entry in folder.iterdir():
            own = PARTIAL.match(entry.name)
            stale = (not process_alive(int(own.group(1))) if own else
                     folder == Path(run) and entry.name.endswith(".partial.ipynb") and
                     entry.name.startswith(".") and not process_alive(claimant))
            if stale:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


def sweep_runs(root: Path) -> list[Path]:
    """`sweep_partials` over every run folder directly under `root`."""
    if not Path(root).is_dir():
        return []
    return [p for run in Path(root).iterdir() if run.is_dir() and not run.is_symlink()
            for p in sweep_partials(run)]


def claim_dir(path: str | Path, marker: str = CLAIM, beside: tuple[str, ...] = ()) -> Path:
    """Create `path` for a new run, or take an existing empty folder; a folder holding anything
    (but the `beside` names: the claim of the process that made it for this one) is refused,
    never reused. The claim is the file `marker`, created exclusively: of two processes given
    one folder at once, one gets it and the other is refused, even before anything is in it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise WorkbookError(f"output folder {path} is a file", "choose a new --out folder")
    taken = WorkbookError(f"output folder {path} already holds a run",
                          "choose a new --out folder (runs are never overwritten)")
    if path.is_dir() and any(p.name not in beside for p in path.iterdir()):
        raise taken
    blocking = file_in_the_way(path.parent)
    if blocking is not None:
        raise WorkbookError(f"cannot create the output folder {path}: {blocking} is a file, "
                            "not a folder", "choose an --out folder that is not under a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle = os.open(path / marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        if path.is_dir():  # the marker: another process claimed it a moment ago
            raise taken from None
        raise WorkbookError(f"cannot create the output folder {path}: a file is in the way",
                            "choose a new --out folder") from None
    except OSError as exc:
        raise WorkbookError(f"cannot create the output folder {path}: {exc.strerror or exc}",
                            "choose a writable --out folder (not under a file, /proc or a "
                            "read-only mount)") from None
    with contextlib.suppress(OSError), os.fdopen(handle, "w") as claim:  # empty, it still holds
        claim.write(json.dumps({"pid": os.getpid(), "claimed": datetime.now().isoformat()}))
    return path


def file_in_the_way(path: Path) -> Path | None:
    """The regular file (or other non-folder) that `path` or one of its parents is, if any."""
    for part in (path, *path.parents):
        if os.path.lexists(part):
            return None if part.is_dir() else part
    return None


def refuse_existing(paths: list[Path], option: str) -> None:
    """Before any work: each output a command will write must be new, in a folder that exists
    (outputs are never overwritten; a missing folder is named now, not after the work)."""
    for path in map(Path, paths):
        if os.path.lexists(path):
            raise WorkbookError(f"{option}: {path} already exists",
                                f"give {option} a new name (outputs are never overwritten)")
        blocking = file_in_the_way(path.parent)
        if blocking is not None:
            raise WorkbookError(f"{option}: {blocking} is a file, not a folder, so {path} "
                                "cannot be written under it",
                                f"give {option} a path in an existing folder")
        if not path.parent.is_dir():
            raise WorkbookError(f"{option}: the folder {path.parent} does not exist",
                                f"create it first, or give {option} a path in an existing "
                                "folder")


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
    raise WorkbookError(f"no free run folder name under {root}",
                        f"move old runs out of {root}, or give --out a new folder")


def notebook_dir(out_dir: str, notebook: str) -> Path:
    """The folder a notebook writes into: the one it was given, or a new run folder."""
    return claim_dir(out_dir) if out_dir else new_run_dir(notebook)


def write_summary(out_dir: Path, verdict: str, figures: dict[str, Any], **extra: Any) -> Path:
    """`summary.json`: the verdict ("pass"/"fail") and the key figures, read by the pilot."""
    if verdict not in ("pass", "fail"):
        raise ValueError(f"verdict must be 'pass' or 'fail', not {verdict!r}")
    return write_json(Path(out_dir) / "summary.json", {"verdict": verdict, "figures": figures,
                                                       **extra})


def read_summary(folder: str | Path) -> dict | None:
    """The `summary.json` a notebook wrote in `folder`, checked (`schemas.Summary`) - the one
    reader of it; None when there is none; a WorkbookError naming the file when it cannot be
    read (a link, not JSON, a verdict no notebook writes): each caller says what that means."""
    path = Path(folder) / "summary.json"
    if not os.path.lexists(path):
        return None
    return schemas.read(path, schemas.Summary, "notebook summary",
                        "run the notebook again").model_dump()


def overall_verdict(verdicts: list[str]) -> str:
    """A pilot's verdict from its notebooks': "pass" when every one passed, "fail" when each
    passed or failed (none ran: nothing passed), else "error" (one errored or was
    interrupted)."""
    if verdicts and all(v == "pass" for v in verdicts):
        return "pass"
    return "fail" if all(v in ("pass", "fail") for v in verdicts) else "error"


def save_table(frame: pd.DataFrame, out_dir: Path, name: str) -> Path:
    """Store a table as CSV (for people) and JSON records (for programs)."""
    write_text(Path(out_dir) / f"{name}.csv", frame.to_csv(index=False))
    write_json(Path(out_dir) / f"{name}.json", frame.to_dict(orient="records"))
    return Path(out_dir) / f"{name}.csv"


def notebook_of(folder: str | Path) -> str:
    """The notebook stem a folder is named by: `NN_name` of `<run>/NN_name` or of a notebook's
    own `<timestamp>-NN_name[-n]`."""
    return re.sub(r"^\d{8}-\d{6}-", "", Path(folder).name)


def verdict_line(out_dir: str | Path, explain: Callable[[str, dict], str] | None = None) -> str:
    """A notebook's last line: its verdict and, in one sentence, why - built from the
    `summary.json` that its `save` just wrote (e.g. "verdict: pass - 9 of 9 gates passed; the
    plan mb16 x acc2 len1024 bf16 needs 1.38 GiB and fits the 80 GiB rental GPU"). `explain`
    (the notebooks' `registry.explain`: storage knows no notebook) gives the reason; its errors
    are raised."""
    try:
        summary = read_summary(out_dir)
    except WorkbookError:
        summary = None
    if summary is None:
        return "verdict: unknown - no summary.json was written"
    why = explain(notebook_of(out_dir), summary) if explain else ""
    return f"verdict: {summary.get('verdict', 'unknown')}" + (f" - {why}" if why else "")


def seal_file(path: str | Path) -> Path:
    """A manifest for one file in a folder that is not written once (a study's plan.json):
    `<name>.manifest.json` with its size and sha256, written after the file."""
    path = Path(path)
    return write_json(path.with_name(path.name + ".manifest.json"), {
        "format": FORMAT, "files": {path.name: {"bytes": os.lstat(path).st_size,
                                                 "sha256": sha256(path)}}})
