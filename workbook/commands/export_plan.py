"""What `workbook export` sends, read from a pilot's run folder without changing anything in it:
one `Entry` for the pilot, one per notebook in its index and one per trial of 06's study, each
with its parameters, metrics (single values and curves with steps), tags, outcome and files.
The MLflow and TensorBoard writers (`export_mlflow`, `export_tensorboard`) only translate it.

Every file is read through the readers that wrote it: index.json and summary.json through
`schemas`, the study's design through `study.read_design`, its trials through the `Ledger` (on a
private copy of ledger.sqlite: opening a ledger may mark trials interrupted, and a reader must
not change the run), 07's archive through `artifacts.verify`. Nothing is followed through a link.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..base.errors import WorkbookError, reason
from ..notebooks import registry
from ..notebooks.registry import key_figures, verdict_line
from ..storage import runs, schemas
from ..storage.artifacts import verify
from ..storage.files import open_plain, read_plain, sha256
from ..storage.ledger import Ledger
from ..storage.processes import process_alive
from ..storage.runs import CLAIM, overall_verdict

FORMAT = 1  # raised when what an export holds changes: an older export is then replaced
STUDY, GATES = registry.STUDY.stem, registry.GATES.stem
ARCHIVE = (registry.RESUME.stem, "archive")
TABLES = (".csv", ".json", ".md", ".png")  # a notebook folder's files sent as artifacts
MAX_TAG = 5000  # characters of a parameter or tag (MLflow keeps 6,000 and 8,000; files all)
MAX_NOTE = 8000  # characters of a run's description (an MLflow tag)
INSTALL = "pip install 'workbook[export]' (or make install, which adds it)"  # both writers
STATUS = {"pass": "FINISHED", "fail": "FAILED", "error": "FAILED", "interrupted": "KILLED"}
TRIAL_STATUS = {"finished": "FINISHED", "diverged": "FINISHED", "failed": "FAILED",
                "interrupted": "KILLED", "running": "RUNNING"}


class IndexRow(BaseModel):
    """One notebook's row of index.json, as the pilot writes it."""

    model_config = ConfigDict(extra="allow")
    notebook: str = Field(pattern=r"^[0-9]{2}_[A-Za-z0-9_]{1,80}$")  # a folder name, no path
    verdict: Literal["pass", "fail", "error", "interrupted"]
    error: StrictStr = ""
    seconds: float = 0.0


class Index(BaseModel):
    """A pilot run's index.json: the task, how it ran, and a row per notebook that ran."""

    model_config = ConfigDict(extra="allow")
    task: StrictStr
    task_options: dict[StrictStr, Any] = {}
    smoke: bool = False
    time_limit_s: float | None = None
    notebooks: list[IndexRow]


@dataclass
class Entry:
    """One run as a tracker shows it: MLflow makes it a run (a child of `parent`), TensorBoard
    a folder. Times in milliseconds since the epoch; curves as (step, value, time) points."""

    key: str  # unique in the export: "pilot", a notebook's stem, "06_lr_study/trial-3"
    name: str
    role: str  # "pilot", "notebook" or "trial"
    parent: str | None = None
    status: str = "FINISHED"
    start_ms: int | None = None
    end_ms: int | None = None
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    curves: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    note: str = ""  # what a person reads first (markdown): the verdict and why
    files: dict[str, Path] = field(default_factory=dict)  # artifact path -> file in the run
    folders: dict[str, Path] = field(default_factory=dict)  # artifact folder -> verified folder
    images: dict[str, Path] = field(default_factory=dict)  # figure name -> PNG in the run
    hparams: dict[str, Any] = field(default_factory=dict)  # a trial's lr and seed


@dataclass
class Pilot:
    """A run folder read for export: its entries (parents first), what could not be exported
    and why, and the identity that makes a second export add nothing."""

    run: Path
    name: str
    pilot_id: str  # the same for the life of the run folder
    digest: str  # changes when anything exported changes
    entries: list[Entry]
    missing: list[str]
    still_running: bool


def name_of(text: str) -> str:
    """A metric, parameter or tag name both trackers accept: letters, digits, `_ . - /` (no
    `..`, no leading or trailing `/`); anything else becomes `_`."""
    text = re.sub(r"[^A-Za-z0-9_./-]+", "_", str(text)).strip("_")
    text = re.sub(r"/+", "/", re.sub(r"\.{2,}", ".", text)).strip("/.")
    return "/".join(p.strip("_") if p.strip("_.") else "_" for p in text.split("/"))[:250] \
        or "_"


def _number(value: Any) -> float | None:
    """A value as a metric: numbers and booleans (1/0); None for anything else."""
    return float(value) if isinstance(value, (int, float)) else None  # a bool is an int


def _text(value: Any, limit: int = MAX_TAG) -> str:
    """A value as a parameter or tag: strings as they are, anything else as JSON; cut to
    `limit` characters with the cut said."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 40] + " ... (cut; the file has all)"


def flat_figures(figures: dict, prefix: str = "") -> tuple[dict[str, float], dict[str, str]]:
    """A summary's key figures as metrics (numbers and yes/no, nested dicts by `a.b` names)
    and tags (`figure.NAME`: text, lists, and values that are neither)."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    for key, value in figures.items():
        name = f"{prefix}{name_of(key)}"
        if isinstance(value, dict) and value and all(
                _number(v) is not None or v is None or isinstance(v, dict)
                for v in value.values()):
            sub_metrics, sub_tags = flat_figures(value, f"{name}.")
            metrics.update(sub_metrics)
            tags.update(sub_tags)
        elif _number(value) is not None:
            metrics[name] = _number(value)
        elif value not in (None, "", [], {}):  # an empty list says nothing a tag should
            tags[f"figure.{name}"] = _text(value)
    return metrics, tags


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None or not math.isfinite(seconds) else int(round(seconds * 1000))


def _iso_ms(text: Any) -> int | None:
    """Milliseconds since the epoch of an ISO time with its zone (papermill's), else None."""
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return _ms(when.timestamp()) if when.tzinfo is not None else None


def inside(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies in it (links resolved): where an export never writes."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or path.is_relative_to(folder)


def _plain_file(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISREG(os.lstat(path).st_mode)
    return False


# --- the run folder -----------------------------------------------------------------------
def _check_folder(run: Path) -> None:
    given = "give the run folder the pilot printed at its end (runs/<time>-<task>)"
    if not os.path.lexists(run):
        raise WorkbookError(f"{run} does not exist", given)
    if run.is_symlink():
        raise WorkbookError(f"{run} is a symbolic link", "give the real run folder (a run "
                            "folder is read without following links)")
    if not run.is_dir():
        raise WorkbookError(f"{run} is a file, not a run folder", f"{given}, not a file in it")
    if not _plain_file(run / "index.json"):
        if _plain_file(run / "summary.json"):
            raise WorkbookError(f"{run} is the folder of one notebook, not a pilot run (it has a "
                                "summary.json but no index.json)",
                                "export the run folder that holds it (python -m workbook "
                                "pilot makes one: runs/<time>-<task>)")
        runs = sorted(p.name for p in run.iterdir() if p.is_dir() and not p.is_symlink()
                      and _plain_file(p / "index.json"))
        if runs:
            raise WorkbookError(f"{run} holds pilot runs, it is not one",
                                f"give one of them, e.g. {run / runs[-1]}")
        raise WorkbookError(f"{run} is not a pilot run folder (no index.json)",
                            "give the folder the pilot printed at its end (runs/<time>-<task>)")


def _index(run: Path) -> Index:
    return schemas.read(run / "index.json", Index, "pilot index",
                        "the run folder is damaged: export an intact copy, or run the pilot "
                        "again")


def pilot_identity(run: Path, index: Index) -> tuple[str, bool]:
    """A stable id for the run: from the claim the pilot made in the folder (unique: its pid
    and time), else from the folder's name and task; and whether that pilot still runs."""
    claim = run / CLAIM
    raw = b""
    with contextlib.suppress(OSError):
        with open_plain(claim) as handle:
            raw = handle.read(4096)
    pid = None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        pid = json.loads(raw).get("pid")
    basis = raw if raw else f"{run.name}\n{index.task}".encode()
    running = isinstance(pid, int) and process_alive(pid) and pid != os.getpid()
    return hashlib.sha256(basis).hexdigest()[:32], running


def _papermill(run: Path, stem: str) -> dict:
    """The executed notebook's papermill record: its parameters, start and end; {} when the
    notebook was not executed by papermill or cannot be read."""
    path = run / f"{stem}.ipynb"
    if not _plain_file(path):
        return {}
    try:
        data = schemas.parse_json(read_plain(path, "executed notebook", ""), path,
                                  "executed notebook")
    except WorkbookError:
        return {}
    record = (data.get("metadata") or {}).get("papermill") if isinstance(data, dict) else None
    return record if isinstance(record, dict) else {}


def _files(run: Path, stem: str) -> tuple[dict[str, Path], dict[str, Path]]:
    """A notebook's artifacts (its summary and tables, the executed notebook and its HTML) and
    its figures (PNG), plain files only."""
    files, images = {}, {}
    folder = run / stem
    if folder.is_dir() and not folder.is_symlink():
        for path in sorted(folder.iterdir()):
            if path.suffix in TABLES and _plain_file(path):
                files[path.name] = path
                if path.suffix == ".png":
                    images[path.stem] = path
    for suffix in (".ipynb", ".html"):
        if _plain_file(run / f"{stem}{suffix}"):
            files[f"{stem}{suffix}"] = run / f"{stem}{suffix}"
    return files, images


def _gates(run: Path) -> tuple[dict[str, float], dict[str, str]]:
    """03's gate table as metrics (`gate/PHASE/COLUMN`, `gate/PHASE/passed`) and tags
    (`gate/PHASE`: the verdict, and the detail when it did not pass)."""
    path = run / GATES / "gates.csv"
    if not _plain_file(path):
        return {}, {}
    with open_plain(path) as handle:
        table = pd.read_csv(handle)
    metrics, tags = {}, {}
    for row in table.to_dict(orient="records"):
        phase = name_of(row.get("phase", "gate"))
        for column, value in row.items():
            if column in ("phase", "micro_batch", "seq_len", "eval_batch") or \
                    isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                continue
            metrics[f"gate/{phase}/{name_of(column)}"] = float(value)
        verdict = str(row.get("verdict", ""))
        metrics[f"gate/{phase}/passed"] = float(verdict == "pass")
        detail = row.get("detail") if isinstance(row.get("detail"), str) else ""
        tags[f"gate/{phase}"] = _text(verdict + (f": {detail}" if verdict != "pass" and detail
                                                 else ""))
    return metrics, tags


def _notebook(run: Path, row: IndexRow, missing: list[str]) -> Entry:
    stem = row.notebook
    entry = Entry(key=stem, name=stem, role="notebook", parent="pilot",
                  status=STATUS[row.verdict])
    summary = None
    path = run / stem / "summary.json"
    if os.path.lexists(path) and not _plain_file(path):
        missing.append(f"{stem}: its summary.json is not a plain file: not exported")
    else:
        try:
            summary = runs.read_summary(run / stem)
            if summary is None and row.verdict not in ("error", "interrupted"):
                missing.append(f"{stem}: no summary.json: no key figures")
        except WorkbookError as exc:
            missing.append(f"{stem}: its summary.json cannot be read ({exc.problem}): its key "
                           "figures are not exported")
    if row.verdict in ("error", "interrupted"):
        missing.append(f"{stem} did not finish ({row.verdict}"
                       + (f": {row.error}" if row.error else "") + "): what it wrote is "
                       "exported")
    figures = (summary or {}).get("figures") or {}
    entry.metrics, figure_tags = flat_figures(figures)
    entry.metrics["seconds"] = float(row.seconds)
    entry.metrics["passed"] = float(row.verdict == "pass")
    record = _papermill(run, stem)
    entry.params = {name_of(k): _text(v) for k, v in sorted(
        (record.get("parameters") or {}).items())}
    entry.start_ms, entry.end_ms = _iso_ms(record.get("start_time")), \
        _iso_ms(record.get("end_time"))
    line = verdict_line(run / stem) if summary else f"verdict: {row.verdict}"
    words = "\n".join(f"| {label} | {value} |" for label, value in key_figures(stem, figures))
    entry.note = _text(f"**{stem}** - {line}" + (f"\n\nerror: {row.error}" if row.error else "")
                       + (f"\n\n| key figure | value |\n|---|---|\n{words}" if words else ""),
                       MAX_NOTE)
    entry.tags = {"verdict": row.verdict, **figure_tags,
                  **({"error": _text(row.error)} if row.error else {})}
    if stem == GATES:
        gate_metrics, gate_tags = _gates(run)
        entry.metrics.update(gate_metrics)
        entry.tags.update(gate_tags)
    entry.files, entry.images = _files(run, stem)
    return entry


# --- 06's study ---------------------------------------------------------------------------
@contextlib.contextmanager
def _ledger_copy(study: Path):
    """The study's ledger opened on a private copy (with its write-ahead log): the reader's
    own opening may write (recover interrupted trials, WAL files), never into the run."""
    folder = Path(tempfile.mkdtemp(prefix="workbook-export-"))
    try:
        for suffix in ("", "-wal"):
            source = study / f"ledger.sqlite{suffix}"
            if _plain_file(source):
                with open_plain(source) as src, open(folder / source.name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            elif os.path.lexists(source):
                raise WorkbookError(f"{source} is not a plain file", "export an intact run folder")
        ledger = Ledger(folder / "ledger.sqlite", trials=study / "trials")
        try:
            yield ledger
        finally:
            ledger.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _trials(run: Path, missing: list[str]) -> list[Entry]:
    """Every trial of 06's study, diverged and failed ones included: its parameters, the
    study's design, its curves (training loss and lr per update, validation per evaluation)
    and its outcome."""
    from ..notebooks.study import DESIGN, read_design, trial_params

    study = run / STUDY / "study"
    if not study.is_dir() or study.is_symlink():
        return []
    if not _plain_file(study / "ledger.sqlite"):
        missing.append(f"{STUDY}: no ledger.sqlite in {study}: no trial exported")
        return []
    try:
        design = read_design(study / DESIGN)
        with _ledger_copy(study) as ledger:
            trials = ledger.records("trials")
            steps, evals = ledger.frame("steps"), ledger.frame("evals")
    except WorkbookError as exc:
        missing.append(f"{STUDY}: its study cannot be read ({exc.problem}): no trial exported")
        return []
    shared = {"study": design.name, "updates": design.updates, "eval_every": design.eval_every,
              "eval_batch": design.eval_batch, "eval_sample": design.eval_sample,
              "metric": design.metric, "top_n": design.top_n,
              "divergence_multiple": design.divergence_multiple, "device": design.device,
              **asdict(design.shape)}
    entries = []
    for row in trials:
        tid = int(row.id)
        params = trial_params(row.params, f"trial {tid} in {study / 'ledger.sqlite'}")
        status = str(row.status)
        entry = Entry(key=f"{STUDY}/trial-{tid}", role="trial", parent=STUDY,
                      name=f"trial {tid} lr={params['lr']:g} seed={params['seed']}"
                      + ("" if status == "finished" else f" ({status})"),
                      status=TRIAL_STATUS.get(status, "FAILED"),
                      start_ms=_ms(row.started), end_ms=_ms(row.ended))
        repeats = row.repeats
        entry.hparams = {"lr": float(params["lr"]), "seed": int(params["seed"])}
        entry.params = {name_of(k): _text(v) for k, v in sorted(
            {**shared, **entry.hparams, **({"repeats": int(repeats)} if repeats else {})}
            .items())}
        for name in ("best_metric", "best_step", "stop_step"):
            if getattr(row, name) is not None:
                entry.metrics[name] = float(getattr(row, name))
        entry.tags = {"outcome": status, "trial": str(tid), "repro": _text(row.repro),
                      **({"stop_reason": _text(row.stop_reason)} if row.stop_reason
                         else {}),
                      **({"best_checkpoint": _text(row.best_checkpoint)}
                         if row.best_checkpoint else {})}
        entry.curves = _curves(tid, steps, evals, entry.start_ms or 0)
        if status == "interrupted":  # its end is when a ledger noticed (this read, perhaps):
            last = entry.curves.get("train/loss", [])  # the last update it recorded is when
            entry.end_ms = last[-1][2] if last else entry.start_ms  # it stopped
        entry.note = (f"**trial {tid}** of study {design.name}: lr {params['lr']:g}, seed "
                      f"{params['seed']} - {status}"
                      + (f" ({row.stop_reason})" if row.stop_reason else "")
                      + f"\n\nreproduce: `{row.repro}`")
        entries.append(entry)
    return entries


def _value(value: Any) -> Any:
    """A ledger cell as a plain value (pandas gives NaN for NULL)."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _curves(tid: int, steps: pd.DataFrame, evals: pd.DataFrame,
            start_ms: int) -> dict[str, list[tuple[int, float, int]]]:
    """A trial's curves with their steps: `train/loss`, `train/lr`, `train/time_s` per
    update, `val/loss` and `val/METRIC` per evaluation, `val_full_best/...` for the best
    checkpoint evaluated on the whole validation set. Times: the trial's start plus the
    updates' own seconds."""
    curves: dict[str, list[tuple[int, float, int]]] = {}
    mine = steps[steps.trial == tid].sort_values("step")
    at: dict[int, int] = {}
    elapsed = 0.0
    for step, loss, lr, seconds in zip(mine.step, mine.loss, mine.lr, mine.time_s,
                                       strict=True):
        elapsed += seconds if isinstance(seconds, float) and math.isfinite(seconds) else 0.0
        at[int(step)] = start_ms + int(elapsed * 1000)
        for name, value in (("train/loss", loss), ("train/lr", lr), ("train/time_s", seconds)):
            if _value(value) is not None:
                curves.setdefault(name, []).append((int(step), float(value), at[int(step)]))
    for row in evals[evals.trial == tid].sort_values("step").to_dict(orient="records"):
        step = int(row["step"])
        prefix = "val_full_best" if row["scope"] == "full-best" else "val"
        try:
            metrics = json.loads(row["metrics"]) if row["metrics"] else {}
        except ValueError:
            metrics = {}
        values = {"loss": row["loss"], **(metrics if isinstance(metrics, dict) else {})}
        for key, value in values.items():
            if _number(value) is not None:
                curves.setdefault(f"{prefix}/{name_of(key)}", []).append(
                    (step, float(value), at.get(step, start_ms)))
    return curves


# --- the whole run ------------------------------------------------------------------------
def read_pilot(run: str | Path) -> Pilot:
    """Everything an export sends, read from the run folder `run` (nothing in it changes).
    A folder that is no pilot run is refused; notebooks that failed or did not run are
    exported as far as they got, and named in `missing`."""
    run = Path(os.path.abspath(run))
    _check_folder(run)
    index = _index(run)
    pilot_id, running = pilot_identity(run, index)
    missing: list[str] = []
    ran = [r.notebook for r in index.notebooks]
    if len(set(ran)) != len(ran):
        raise WorkbookError(f"{run / 'index.json'} lists a notebook twice",
                            "the run folder is damaged: export an intact copy")
    not_run = [s for s in registry.stems() if s not in ran]
    if not_run:
        missing.append(f"not run in this pilot: {', '.join(not_run)}"
                       + (" (the pilot is still running: export again when it ends)"
                          if running else ""))
    notebooks = [_notebook(run, row, missing) for row in index.notebooks]
    trials = _trials(run, missing) if STUDY in ran else []
    pilot = _pilot_entry(run, index, notebooks, missing)
    entries = [pilot, *notebooks, *trials]
    for entry in entries:  # what people read: the run's paths relative to it, as its report
        entry.note = runs.shown_in(entry.note, run)
    return Pilot(run=run, name=run.name, pilot_id=pilot_id, digest=_digest(entries),
                 entries=entries, missing=missing, still_running=running)


def _pilot_entry(run: Path, index: Index, notebooks: list[Entry], missing: list[str]) -> Entry:
    verdicts = [n.tags["verdict"] for n in notebooks]
    overall = overall_verdict(verdicts)
    starts = [n.start_ms for n in notebooks if n.start_ms]
    ends = [n.end_ms for n in notebooks if n.end_ms]
    entry = Entry(key="pilot", name=run.name, role="pilot", status=STATUS[overall],
                  start_ms=min(starts) if starts else None, end_ms=max(ends) if ends else None)
    entry.params = {"task": _text(index.task), "task_options": _text(index.task_options),
                    "smoke": _text(index.smoke), "time_limit_s": _text(index.time_limit_s),
                    "notebooks": _text(",".join(n.key[:2] for n in notebooks))}
    entry.metrics = {"notebooks_run": float(len(verdicts)),
                     "notebooks_passed": float(verdicts.count("pass")),
                     "notebooks_not_passed": float(len(verdicts) - verdicts.count("pass")),
                     "seconds": float(sum(n.metrics.get("seconds", 0.0) for n in notebooks))}
    entry.tags = {"verdict": overall, "task": _text(index.task), "run_folder": _text(str(run))}
    if missing:
        entry.tags["missing"] = _text("; ".join(missing))
    lines = [f"Pilot run **{run.name}** of `{index.task}`: overall **{overall}**", ""]
    lines += [f"- {n.note.splitlines()[0]}" for n in notebooks]
    conclusion = run / registry.RENTAL.stem / "conclusion.md"
    if _plain_file(conclusion):
        with contextlib.suppress(WorkbookError, UnicodeDecodeError):
            lines += ["", read_plain(conclusion, "conclusion", "").decode("utf-8")]
    if missing:
        lines += ["", "Not exported:"] + [f"- {m}" for m in missing]
    entry.note = _text("\n".join(lines), MAX_NOTE)
    for name in ("report.html", "index.json"):
        if _plain_file(run / name):
            entry.files[name] = run / name
    archive = run.joinpath(*ARCHIVE)
    if os.path.lexists(archive):
        try:
            verify(archive, "archive")
            entry.folders["archive"] = archive
        except WorkbookError as exc:
            missing.append(f"07's archive {archive} is not exported: {exc.problem}")
            entry.tags["missing"] = _text("; ".join(missing))
    return entry


def _digest(entries: list[Entry]) -> str:
    """What an export holds, as one sha256: every value, and every file's bytes."""
    digest = hashlib.sha256(f"workbook export {FORMAT}\n".encode())
    for e in entries:
        data = {k: v for k, v in e.__dict__.items() if k not in ("files", "folders", "images")}
        digest.update(json.dumps(data, sort_keys=True, default=str).encode())
        for name, path in sorted({**e.files, **e.images}.items()):
            digest.update(f"{name}:{_file_digest(path)}".encode())
        for name, folder in sorted(e.folders.items()):
            for child in sorted(p for p in folder.iterdir()):
                digest.update(f"{name}/{child.name}:{_file_digest(child)}".encode())
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    try:
        return sha256(path)
    except OSError as exc:
        raise WorkbookError(f"cannot read {path}: {reason(exc)}", "export an intact run folder, "
                            "readable by you") from None
