"""`python -m workbook export RUN_FOLDER [--mlflow [URI]] [--tensorboard DIR]`: a pilot run
where users already compare runs. The run folder is read (`export_plan`) and never changed;
MLflow (`export_mlflow`) and TensorBoard (`export_tensorboard`) get the same content. Both need
the `export` extra; what is asked for is checked - the extra installed, the run folder, every
destination - before anything is written, and each destination gets the whole export or none
of it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..base.errors import WorkbookError
from . import export_mlflow, export_tensorboard
from .export_plan import read_pilot

DEFAULT = ""  # --mlflow without a URI: the SQLite store beside the run folder


def export_run(run: str, mlflow: str | None = None, tensorboard: str | None = None,
               experiment: str = export_mlflow.EXPERIMENT) -> dict[str, Any]:
    """Export the pilot run folder `run` to MLflow (`mlflow`: a URI, or "" for
    `sqlite:///<parent>/mlflow.db`; None: not to MLflow) and/or TensorBoard (`tensorboard`: a
    log folder). Returns {"pilot": the run read, "mlflow": ..., "tensorboard": ...}, each
    destination's outcome (`export_mlflow.export`, `export_tensorboard.export`)."""
    if mlflow is None and tensorboard is None:
        raise WorkbookError("export needs a destination",
                            "add --mlflow (a SQLite store beside the run folder, or --mlflow "
                            "URI) and/or --tensorboard DIR")
    if mlflow is not None:
        export_mlflow.import_mlflow()
    if tensorboard is not None:
        export_tensorboard.import_tensorboard()
    if not experiment.strip():
        raise WorkbookError("--experiment is empty", "give the MLflow experiment a name, or "
                            f"leave --experiment out ({export_mlflow.EXPERIMENT!r})")
    plan = read_pilot(run)
    uri = export_mlflow.store_uri(mlflow, plan.run) if mlflow is not None else None
    if uri is not None:  # every destination is checked before either is written
        export_mlflow.check_destination(uri, plan.run)
    if tensorboard is not None:
        export_tensorboard.destination(tensorboard, plan)
    done: dict[str, Any] = {"pilot": plan}
    if uri is not None:
        done["mlflow"] = export_mlflow.export(plan, uri, experiment)
    if tensorboard is not None:
        done["tensorboard"] = export_tensorboard.export(plan, tensorboard)
    return done


def lines(done: dict[str, Any]) -> list[str]:
    """What an export did, for people: per destination what was added (or that nothing was),
    where, and how to open it; then what the run folder could not give."""
    plan = done["pilot"]
    trials = sum(e.role == "trial" for e in plan.entries)
    notebooks = sum(e.role == "notebook" for e in plan.entries)
    what = f"the pilot, {notebooks} notebooks and {trials} trials of 06"
    out = []

    def head(tracker: str, action: str) -> str:
        return {"exported": f"{tracker}: exported {what}",
                "replaced": f"{tracker}: exported {what}, replacing the earlier export of this "
                            "run (its content changed)",
                "unchanged": f"{tracker}: already exported with the same content - nothing "
                             "added"}[action]

    if "mlflow" in done:
        m = done["mlflow"]
        out += [f"{head('MLflow', m['action'])} ({m['runs']} runs)",
                f"  store {m['uri']}, experiment {m['experiment']!r}, pilot run {m['run_id']}"]
        if m["view"]:  # a database written by a newer MLflow is refused by an older one
            out.append(f"  open: {m['view']}" + (
                f" (with mlflow>={m['version']}: pip install mlflow)"
                if m["uri"].startswith("sqlite") else ""))
    if "tensorboard" in done:
        t = done["tensorboard"]
        out += [f"{head('TensorBoard', t['action'])} ({t['runs']} runs)",
                f"  folder {t['folder']}", f"  open: {t['view']}"]
    if plan.missing:
        out += ["not exported (the run folder does not have it):"]
        out += [f"  - {m}" for m in plan.missing]
    return out


def add_arguments(export: argparse.ArgumentParser) -> None:
    """The `export` command's options (cli.py's table of commands adds it)."""
    export.add_argument("run", metavar="RUN_FOLDER", nargs="?",
                        help="the pilot's run folder (runs/<time>-<task>)")
    export.add_argument("--mlflow", nargs="?", const=DEFAULT, metavar="URI",
                        help="an MLflow store: sqlite:///PATH/mlflow.db, a database URI or a "
                        "tracking server http://HOST:PORT (default: sqlite:///<the run "
                        "folder's parent>/mlflow.db)")
    export.add_argument("--experiment", default=export_mlflow.EXPERIMENT,
                        help=f"the MLflow experiment (default {export_mlflow.EXPERIMENT!r})")
    export.add_argument("--tensorboard", metavar="DIR", help="a TensorBoard log folder: the "
                        "run goes to DIR/<run folder name>/")


def run_command(args: argparse.Namespace) -> int:
    """`workbook export`: 0 when every destination holds the run, 2 when refused (the
    problem and the fix on stderr)."""
    run, mlflow = args.run, args.mlflow
    if run is None and mlflow and os.path.isdir(mlflow):  # `export --mlflow RUN_FOLDER`:
        run, mlflow = mlflow, DEFAULT  # argparse gave the folder to --mlflow
    try:
        if run is None:
            raise WorkbookError("export needs the run folder",
                                "python -m workbook export RUN_FOLDER --mlflow [URI] "
                                "[--tensorboard DIR]")
        done = export_run(run, mlflow, args.tensorboard, args.experiment)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines(done)))
    return 0
