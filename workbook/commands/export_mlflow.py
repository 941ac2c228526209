"""A pilot run in MLflow: the pilot as a parent run, each notebook a child (its key figures as
metrics, its verdict and why as the run's description, its parameters, tables and figures),
every trial of 06 a child of 06 (its parameters, curves with steps and outcome), 03's gates as
metrics, the report and 07's archive as the parent's artifacts (`export_plan` reads all of it).

Written through MLflow's own client (`MlflowClient`), so whatever store the URI names - the
default SQLite file beside the run folder, another database, a tracking server - holds what
its own UI and `mlflow.search_runs` read. Every run carries the pilot's id
(`workbook.pilot_id`): an export of a pilot already there with the same content adds nothing,
one whose content changed replaces it (the new runs first, the old ones deleted after), and an
export that fails deletes what it wrote."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlparse

from ..base.errors import WorkbookError, reason
from .export_plan import INSTALL, Entry, Pilot, inside, name_of

EXPERIMENT = "workbook pilot"
ROLE, PILOT_ID, DIGEST, COMPLETE, KEY = ("workbook.role", "workbook.pilot_id",
                                         "workbook.digest", "workbook.complete", "workbook.key")
NOTE = "mlflow.note.content"  # the run's description in MLflow's UI
MAX_KEY = 250  # MLflow's longest metric, parameter or tag name
PROBE_TIMEOUT_S = "10"  # the first request to a tracking server: refused quickly, not retried


def default_uri(run: Path) -> str:
    """The SQLite store beside the run folder: `sqlite:///<parent>/mlflow.db` (absolute)."""
    return sqlite_uri(Path(run).parent / "mlflow.db")


def sqlite_uri(path: Path) -> str:
    return "sqlite:///" + os.path.abspath(path)


def store_uri(given: str | None, run: Path) -> str:
    """The store to write: the default beside the run, a path ending in .db/.sqlite taken as a
    SQLite file, or the URI as given (sqlite:///..., postgresql://..., http://server:5000)."""
    if not given:
        return default_uri(run)
    if "://" not in given and given.endswith((".db", ".sqlite", ".sqlite3")):
        return sqlite_uri(Path(given))
    return given


def _sqlite_path(uri: str) -> Path | None:
    """The file of a sqlite:/// URI (None for another scheme)."""
    if not uri.startswith("sqlite:"):
        return None
    path = unquote(uri.split("?", 1)[0][len("sqlite:///"):]) if uri.startswith("sqlite:///") \
        else ""
    if not path or path == ":memory:":
        raise WorkbookError(f"--mlflow {uri} names no file (an in-memory store is gone when "
                            "the export ends)", "give a file: --mlflow sqlite:///PATH/mlflow.db")
    return Path(os.path.abspath(path))


def check_destination(uri: str, run: Path) -> None:
    """Before anything is written: a local store must lie outside the run folder, in a
    folder that exists and can be written, and a SQLite file already there must be MLflow's."""
    path = _sqlite_path(uri)
    if path is None:
        scheme = urlparse(uri).scheme
        if scheme in ("", "file"):
            path = Path(os.path.abspath(unquote(urlparse(uri).path) if scheme else uri))
            if inside(path, run):
                raise WorkbookError(f"--mlflow {uri} lies inside the run folder {run}, which an "
                                    "export never changes", "give a store outside it (the "
                                    "default is sqlite:///<parent>/mlflow.db beside it)")
        return
    if inside(path, run):
        raise WorkbookError(f"--mlflow {uri} lies inside the run folder {run}, which an export "
                            "never changes", "leave --mlflow without a URI (the store then goes "
                            f"beside the run folder: {default_uri(run)}) or give another path")
    if not path.parent.is_dir():
        raise WorkbookError(f"the folder of the MLflow store {path} does not exist",
                            f"create {path.parent} first, or give --mlflow another path")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise WorkbookError(f"the MLflow store {path} cannot be written (permission denied)",
                            "give --mlflow sqlite:///PATH/mlflow.db in a folder you can write")
    if path.exists() and path.stat().st_size:
        _check_mlflow_database(path)


def _check_mlflow_database(path: Path) -> None:
    """A SQLite file that is not MLflow's is refused: MLflow would add its tables to it."""
    try:
        db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = "
                                               "'table'")}
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise WorkbookError(f"{path} is not a SQLite database ({reason(exc)}), so it cannot be "
                            "an MLflow store", "give --mlflow a new file or an MLflow store's "
                            "(sqlite:///PATH/mlflow.db)") from None
    if not {"experiments", "runs", "alembic_version"} <= tables:
        raise WorkbookError(f"{path} is a SQLite database but not an MLflow store (it holds "
                            f"{', '.join(sorted(tables)[:5]) or 'no table'})",
                            "give --mlflow a new file or an MLflow store's "
                            "(sqlite:///PATH/mlflow.db); MLflow would add its tables to this one")


def import_mlflow() -> Any:
    """MLflow's client (the `export` extra), telemetry off; a clear error when it is absent."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # an export sends nothing else
    try:
        import mlflow  # noqa: F401
        from mlflow import MlflowClient
    except ImportError as exc:
        raise WorkbookError(f"--mlflow needs MLflow's client, which is not installed "
                            f"({reason(exc)})", INSTALL) from None
    try:
        import sqlalchemy  # noqa: F401  (the SQLite store)
    except ImportError:
        raise WorkbookError("--mlflow needs SQLAlchemy for MLflow's SQLite store, and it is "
                            "not installed", INSTALL) from None
    return MlflowClient


@contextlib.contextmanager
def _quiet(probe: bool = False) -> Iterator[None]:
    """MLflow's store set-up messages kept out of the command's output; with `probe`, a first
    request to a tracking server neither retried nor waited on for long (unless the user set
    MLflow's own variables)."""
    set_here = []
    if probe:
        for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"),
                            ("MLFLOW_HTTP_REQUEST_TIMEOUT", PROBE_TIMEOUT_S)):
            if name not in os.environ:
                os.environ[name] = value
                set_here.append(name)
    loggers = [logging.getLogger(n) for n in ("mlflow.store.db.utils", "alembic",
                                              "alembic.runtime.migration")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        for name in set_here:
            os.environ.pop(name, None)


def _unusable(uri: str, exc: BaseException) -> WorkbookError:
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        fix = ("start the tracking server (mlflow server --port PORT) or correct the address; "
               "leave the URI out to write a SQLite store beside the run folder")
    elif scheme.startswith(("sqlite", "postgresql", "mysql", "mssql")):
        found = re.search(r"found version (\w+)", str(exc))
        if found and not _known_revision(found.group(1)):
            fix = ("a newer MLflow wrote this store: upgrade this one (pip install -U "
                   "mlflow-skinny), or give another store")
        elif found or "schema" in str(exc).lower():
            fix = (f"upgrade the store's schema (back it up first): mlflow db upgrade {uri}; "
                   "or give another store")
        else:
            fix = "give a database URI MLflow can open, e.g. sqlite:///runs/mlflow.db"
    else:
        fix = ("give sqlite:///PATH/mlflow.db, a database URI or a tracking server "
               "(http://HOST:PORT); leave the URI out for a SQLite store beside the run folder")
    return WorkbookError(f"the MLflow store {uri} cannot be used: {reason(exc, 400)}", fix)


def _known_revision(revision: str) -> bool:
    """Whether the installed MLflow knows a store schema revision (else a newer one wrote it)."""
    import mlflow.store

    versions = Path(mlflow.store.__file__).parent / "db_migrations" / "versions"
    return any(versions.glob(f"{revision}_*.py"))


def connect(uri: str, experiment: str) -> tuple[Any, Any]:
    """The client for `uri` and the experiment `experiment` (made when missing; in a SQLite
    store its artifacts go to `mlartifacts/` beside the database), or a WorkbookError naming
    the store and the fix: unreachable, not MLflow's, an experiment that was deleted, or an
    artifact location the client cannot write."""
    client_type = import_mlflow()
    try:
        with _quiet(probe=True):
            client = client_type(tracking_uri=uri)
            found = client.get_experiment_by_name(experiment)
            if found is None:
                path = _sqlite_path(uri)
                location = (path.parent / "mlartifacts" / name_of(experiment)).as_uri() \
                    if path is not None else None
                client.create_experiment(experiment, artifact_location=location)
                found = client.get_experiment_by_name(experiment)
    except WorkbookError:
        raise
    except Exception as exc:  # MLflow's, SQLAlchemy's and requests' errors alike
        raise _unusable(uri, exc) from None
    if found.lifecycle_stage != "active":
        raise WorkbookError(f"the experiment {experiment!r} in {uri} was deleted",
                            "restore it (mlflow experiments restore --experiment-id "
                            f"{found.experiment_id}) or give --experiment another name")
    location = found.artifact_location or ""
    if location.startswith("mlflow-artifacts:") and urlparse(uri).scheme not in ("http",
                                                                                  "https"):
        raise WorkbookError(f"the experiment {experiment!r} keeps its artifacts on a tracking "
                            f"server ({location}), which {uri} does not reach",
                            "give --mlflow the server's address (http://HOST:PORT), or "
                            "--experiment another name")
    return client, found


def _in_run(location: str, run: Path) -> bool:
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return False
    return inside(Path(os.path.abspath(unquote(parsed.path) if parsed.scheme else location)),
                   run)


def _search(client: Any, experiment_id: str, where: str) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=where, max_results=1000,
                                  page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _batches(client: Any, run_id: str, entry: Entry, now: int) -> None:
    from mlflow.entities import Metric, Param, RunTag

    stamp = entry.end_ms or entry.start_ms or now
    key = MAX_KEY  # MLflow's longest name
    metrics = [Metric(k[:key], v, stamp, 0) for k, v in entry.metrics.items()]
    metrics += [Metric(k[:key], v, t, s) for k, points in entry.curves.items()
                for s, v, t in points]
    params = [Param(k[:key], v) for k, v in entry.params.items()]
    tags = [RunTag(k[:key], v) for k, v in entry.tags.items()]
    for start in range(0, max(len(metrics), 1), 1000):
        client.log_batch(run_id, metrics=metrics[start:start + 1000], synchronous=True)
    for start in range(0, max(len(params), len(tags)), 100):
        client.log_batch(run_id, params=params[start:start + 100], tags=tags[start:start + 100],
                         synchronous=True)


def _user() -> str:
    """Who exported (MLflow's UI shows it as "Created by")."""
    import getpass

    with contextlib.suppress(Exception):
        return getpass.getuser()
    return ""


def _write_entry(client: Any, experiment_id: str, entry: Entry, plan: Pilot,
                 parent_id: str | None, now: int, created: list[str]) -> str:
    """One run, its id added to `created` as soon as it exists (a failure after that deletes
    it with the rest)."""
    tags = {ROLE: entry.role, PILOT_ID: plan.pilot_id, KEY: entry.key, NOTE: entry.note,
            "mlflow.source.type": "LOCAL", "mlflow.source.name": "workbook pilot",
            **({"mlflow.user": _user()} if _user() else {}),
            **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    if entry.role == "pilot":
        tags[DIGEST] = plan.digest
    run = client.create_run(experiment_id, start_time=entry.start_ms or now, tags=tags,
                            run_name=entry.name)
    run_id = run.info.run_id
    created.append(run_id)
    _batches(client, run_id, entry, now)
    for path in entry.files.values():
        client.log_artifact(run_id, str(path))
    for name, folder in entry.folders.items():
        client.log_artifacts(run_id, str(folder), name)
    if entry.status != "RUNNING":  # MLflow prints two "View run" lines per run to a server:
        with contextlib.redirect_stdout(io.StringIO()):  # the command says it once
            client.set_terminated(run_id, entry.status,
                                  end_time=entry.end_ms or entry.start_ms or now)
    return run_id


def export(plan: Pilot, uri: str, experiment: str = EXPERIMENT) -> dict[str, Any]:
    """Send `plan` to the MLflow store `uri`. Returns what happened: `action` ("exported",
    "unchanged": the same content is there, or "replaced": an earlier export of this pilot
    was deleted after the new one was written), the parent's `run_id`, the number of `runs`,
    the store and how to `view` it."""
    check_destination(uri, plan.run)
    client, found = connect(uri, experiment)
    if _in_run(found.artifact_location or "", plan.run):
        raise WorkbookError(f"the experiment {experiment!r} keeps its artifacts inside the run "
                            f"folder ({found.artifact_location}), which an export never changes",
                            "give --experiment another name")
    exp_id = found.experiment_id
    from mlflow.version import VERSION

    result = {"uri": uri, "experiment": experiment, "experiment_id": exp_id, "version": VERSION,
              "view": f"mlflow ui --backend-store-uri {uri}" if _sqlite_path(uri) else ""}
    with _quiet():
        try:
            earlier = _search(client, exp_id, f"tags.`{PILOT_ID}` = '{plan.pilot_id}'")
        except Exception as exc:
            raise _unusable(uri, exc) from None
        for run in earlier:
            tags = run.data.tags
            if tags.get(ROLE) == "pilot" and tags.get(COMPLETE) == "true" and \
                    tags.get(DIGEST) == plan.digest:
                count = sum(r.data.tags.get(ROLE) != "pilot" for r in earlier) + 1
                return {**result, "action": "unchanged", "run_id": run.info.run_id,
                        "runs": count, **_page(uri, exp_id, run.info.run_id)}
        created: list[str] = []
        try:
            ids: dict[str, str] = {}
            now = int(time.time() * 1000)
            for entry in plan.entries:  # parents come first
                ids[entry.key] = _write_entry(client, exp_id, entry, plan,
                                              ids.get(entry.parent or ""), now, created)
            client.set_tag(ids["pilot"], COMPLETE, "true")  # the export is whole from here on
        except BaseException as exc:
            for run_id in reversed(created):
                with contextlib.suppress(Exception):
                    client.delete_run(run_id)
            if not isinstance(exc, Exception):
                raise
            raise WorkbookError(f"the export to MLflow ({uri}) failed: {reason(exc, 400)}; the "
                                f"{len(created)} runs it had written were deleted",
                                "fix the cause and export again (nothing of this export was "
                                "kept)") from None
        for run in earlier:  # an older or unfinished export of this pilot
            with contextlib.suppress(Exception):
                client.delete_run(run.info.run_id)
    return {**result, "action": "replaced" if earlier else "exported", "run_id": ids["pilot"],
            "runs": len(created), **_page(uri, exp_id, ids["pilot"])}


def _page(uri: str, experiment_id: str, run_id: str) -> dict[str, str]:
    """A tracking server's page of the pilot run, to open in a browser."""
    if urlparse(uri).scheme not in ("http", "https"):
        return {}
    return {"view": f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"}
