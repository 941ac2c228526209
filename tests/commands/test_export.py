"""`workbook export`: a pilot run folder in MLflow and TensorBoard, read back by their own
clients (MlflowClient / mlflow.search_runs, TensorBoard's EventAccumulator); a second export
adds nothing, the run folder is never changed, and every bad input is refused with its fix
before anything is written."""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pandas as pd
import pytest

from workbook import WorkbookError
from workbook.commands import export_mlflow, export_tensorboard
from workbook.commands.cli import main
from workbook.commands.export import export_run, lines
from workbook.commands.export_plan import name_of, read_pilot

from ..conftest import CLASSIFICATION

mlflow = pytest.importorskip("mlflow", reason="the [export] extra is not installed")
pytest.importorskip("tensorboard", reason="the [export] extra is not installed")
from mlflow.entities import ViewType  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow's own SQLAlchemy mappings use a loader SQLAlchemy 2.1 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy")
STUDY, GATES, RESUME = "06_lr_study", "03_phase_gates", "07_resume_reload"
STARTED = "2026-12-03T12:24:10.500000+00:00"
ENDED = "2026-12-03T12:24:33.750000+00:00"


def _build_run(run: Path) -> Path:
    """A run folder as the pilot leaves it, made in seconds: the pilot's claim, 03 and 06 run
    through the same `run`/`save` their notebooks call (06 with a diverging rate), 07 stopped
    by an error after writing its archive (its summary as the pilot records an error), 06's
    executed notebook with papermill's record (as papermill writes it: the record of a real
    pilot is read in tests/commands/test_pilot.py's README run), index.json and the report by
    the pilot's own writers; 01, 02, 04, 05, 08 and 09 not run. 06's ledger also holds a trial
    whose process ended while it ran."""
    from workbook.commands import pilot
    from workbook.commands.params import of
    from workbook.commands.report import write_report
    from workbook.contract.task import load_task
    from workbook.notebooks import gates, plots, study
    from workbook.notebooks.resume.archive import write_archive
    from workbook.storage.runs import claim_dir

    claim_dir(run)
    p = of(GATES, small=True, task=CLASSIFICATION)
    result = gates.run(p, run / GATES)
    plots.gate_memory(result.report.table(), save=run / GATES / "gates.png")  # as 03's cell
    gates.save(result, run / GATES)
    p = of(STUDY, small=True, task=CLASSIFICATION, lrs=[1e-2, 50.0], updates=10, eval_every=5,
           extra_trials=0)
    s = study.run(p, run / STUDY)
    study.save(s, run / STUDY)
    s.ledger.close()
    # a third trial left running by a process that ended (a pilot killed mid-study): its row
    # says running until a ledger opens it; a reader that opened the run's own would change it
    subprocess.run([sys.executable, "-c", "import sys; from workbook.storage.ledger import "
                    "Ledger; Ledger(sys.argv[1]).start_trial('lr-comparison', {'lr': 0.01, "
                    "'seed': 0}, 'python -m workbook trial ...')",
                    str(run / STUDY / "study" / "ledger.sqlite")], check=True, timeout=120)
    (run / f"{STUDY}.ipynb").write_text(json.dumps({
        "cells": [], "nbformat": 4, "nbformat_minor": 5, "metadata": {"papermill": {
            "parameters": {**p, "out_dir": str(run / STUDY)}, "start_time": STARTED,
            "end_time": ENDED, "duration": 23.25}}}))
    write_archive(run / RESUME / "archive", CLASSIFICATION, {},
                  load_task(CLASSIFICATION).build_model(), {"lr": 1e-3},
                  pd.DataFrame({"step": [1], "loss": [1.6]}), ["python -m workbook pilot"],
                  controls=2)
    error = "time limit: the notebook did not finish within 600 s; stuck in cell 7"
    pilot._record_error(run / RESUME, error)
    rows = [pilot._row(GATES, "pass", "", 2.5), pilot._row(STUDY, "pass", "", 23.3),
            pilot._row(RESUME, "error", error, 600.0)]
    pilot.write_index(run, rows, {"task": CLASSIFICATION, "task_options": {}, "smoke": True,
                                  "time_limit_s": 600.0})
    write_report(run, pd.DataFrame(rows), CLASSIFICATION)
    return run


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build_run(tmp_path_factory.mktemp("pilot") / "20261203-122200-classification")


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    """An empty MLflow SQLite store, its schema made once, on a memory file system where there
    is one (MLflow's migrations commit one by one, each synced to the disk), then copied
    beside the tests' other files."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    memory = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=memory if memory.is_dir() else None) as scratch:
        made = Path(scratch) / "mlflow.db"
        mlflow.MlflowClient(export_mlflow.sqlite_uri(made)).search_experiments()
        shutil.copy(made, path)
    return path


@pytest.fixture
def run(built, tmp_path):
    """A private copy of the run folder (a test may export beside it or change it)."""
    return Path(shutil.copytree(built, tmp_path / "runs" / built.name, symlinks=True))


@pytest.fixture
def store(empty_store, tmp_path):
    path = tmp_path / "store" / "mlflow.db"
    path.parent.mkdir()
    shutil.copy(empty_store, path)
    return export_mlflow.sqlite_uri(path)


def fingerprint(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (hidden ones too): its kind, mode, bytes and, for files,
    the time it was last written (a write of the same bytes shows too)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        st = os.lstat(path)
        body = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        written = st.st_mtime_ns if path.is_file() else ""
        found[str(path.relative_to(folder))] = f"{oct(st.st_mode)} {body} {written}"
    return found


def runs_of(uri: str, view=ViewType.ACTIVE_ONLY) -> pd.DataFrame:
    client = mlflow.MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return pd.DataFrame([{"id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
                          "start": r.info.start_time, "end": r.info.end_time,
                          **{f"tag:{k}": v for k, v in r.data.tags.items()}}
                         for r in client.search_runs(ids, run_view_type=view)])


def ledger_trials(run: Path) -> pd.DataFrame:
    return pd.read_csv(run / STUDY / "trials.csv")


# --- MLflow ----------------------------------------------------------------------------------
def test_mlflow_holds_the_pilot_its_notebooks_trials_gates_and_artifacts(run, store,
                                                                          monkeypatch):
    done = export_run(str(run), store)
    assert done["mlflow"]["action"] == "exported" and done["mlflow"]["runs"] == 7
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    table = mlflow.search_runs(experiment_names=["workbook pilot"])
    assert len(table) == 7  # the pilot, 03, 06, 07 and 06's three trials
    by_name = table.set_index("tags.mlflow.runName")
    pilot = by_name.loc[run.name]
    assert pilot["tags.workbook.role"] == "pilot" and pilot["tags.verdict"] == "error"
    assert pilot.status == "FAILED"  # 07 did not finish: the pilot did not pass
    assert pilot["params.task"] == CLASSIFICATION and pilot["metrics.notebooks_run"] == 3
    assert pilot["metrics.notebooks_passed"] == 2
    assert "07_resume_reload did not finish (error: time limit" in pilot["tags.missing"]
    assert "not run in this pilot: 01_inspect_examples, 02_overfit" in pilot["tags.missing"]
    for stem in (GATES, STUDY, RESUME):
        assert by_name.loc[stem, "tags.mlflow.parentRunId"] == pilot.run_id
    assert by_name.loc[RESUME, "status"] == "FAILED" and \
        by_name.loc[RESUME, "tags.error"].startswith("time limit")

    # 06's key figures and verdict; its parameters and times from papermill's record
    summary = json.loads((run / STUDY / "summary.json").read_text())
    nb06 = by_name.loc[STUDY]
    assert nb06["tags.verdict"] == "pass" and nb06["metrics.passed"] == 1
    assert nb06["metrics.trials"] == summary["figures"]["trials"] == 2
    assert nb06["metrics.statuses.diverged"] == 1
    assert nb06["metrics.best_metric"] == pytest.approx(summary["figures"]["best_metric"])
    assert nb06["params.updates"] == "10" and nb06["params.lrs"] == "[0.01, 50.0]"
    assert nb06.start_time == pd.Timestamp(STARTED) and nb06.end_time == pd.Timestamp(ENDED)
    assert nb06["tags.mlflow.note.content"].startswith("**06_lr_study** - verdict: pass - 2 "
                                                       "trials (1 diverged, 1 finished)")

    # every trial, the diverged one kept: parameters, outcome, curves with their steps
    trials = ledger_trials(run)
    client = mlflow.MlflowClient(store)
    kids = table[table["tags.mlflow.parentRunId"] == nb06.run_id].set_index("tags.trial")
    assert sorted(kids.index) == ["1", "2", "3"]
    cut = kids.loc["3"]  # recorded running; its process is gone
    assert cut.status == "KILLED" and cut["tags.outcome"] == "interrupted"
    assert cut["tags.mlflow.runName"] == "trial 3 lr=0.01 seed=0 (interrupted)"
    assert "ended before the trial finished" in cut["tags.stop_reason"]
    for row in trials.itertuples():
        kid = kids.loc[str(row.id)]
        assert kid["tags.outcome"] == row.status and kid["params.lr"] == str(row.lr)
        assert kid["params.seed"] == "0" and kid["params.micro_batch"] == "2"
        assert kid.status == "FINISHED" and kid["tags.repro"] == row.repro
        loss = client.get_metric_history(kid.run_id, "train/loss")
        assert [m.step for m in sorted(loss, key=lambda m: m.step)] == \
            list(range(1, row.stop_step + 1))
        assert kid["metrics.stop_step"] == row.stop_step
    diverged = kids.loc[str(trials.id[trials.status == "diverged"].item())]
    assert diverged["tags.mlflow.runName"] == "trial 2 lr=50 seed=0 (diverged)"
    assert "above 1000 x the first update" in diverged["tags.stop_reason"]
    finished = kids.loc["1"]
    val = client.get_metric_history(finished.run_id, "val/loss")
    assert [m.step for m in sorted(val, key=lambda m: m.step)] == [5, 10]
    assert finished["metrics.best_metric"] == pytest.approx(trials.best_metric[0])

    # 03's gates: one set of metrics per row of gates.csv, the same numbers
    gates = pd.read_csv(run / GATES / "gates.csv")
    nb03 = by_name.loc[GATES]
    for row in gates.itertuples():
        phase = name_of(row.phase)
        assert nb03[f"metrics.gate/{phase}/passed"] == float(row.verdict == "pass")
        assert nb03[f"metrics.gate/{phase}/peak_allocated_bytes"] == row.peak_allocated_bytes
        assert nb03[f"metrics.gate/{phase}/time_s"] == pytest.approx(row.time_s)
        assert nb03[f"tags.gate/{phase}"].startswith(row.verdict)
    assert len(gates) == 9

    # the report and the archive on the pilot, each notebook's files on its run, byte for byte
    listed = {a.path for a in client.list_artifacts(pilot.run_id)}
    assert {"report.html", "index.json", "archive"} <= listed
    archive = run / RESUME / "archive"
    got = Path(client.download_artifacts(pilot.run_id, "archive", str(run.parent / "got")))
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in archive.iterdir())
    assert all((got / p.name).read_bytes() == p.read_bytes() for p in archive.iterdir())
    assert {"gates.csv", "gates.png", "summary.json"} <= \
        {a.path for a in client.list_artifacts(nb03.run_id)}
    assert {"06_lr_study.ipynb", "06_lr_study.html", "trials.csv", "summary.json"} <= \
        {a.path for a in client.list_artifacts(nb06.run_id)}, "the executed notebook too"


def test_a_second_export_adds_nothing_and_the_run_folder_is_never_changed(
        run, store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing may land in the working folder either
    before = fingerprint(run)
    threads = set(threading.enumerate())
    args = ["export", str(run), "--mlflow", store, "--tensorboard", str(tmp_path / "tb")]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "MLflow: exported the pilot, 3 notebooks and 3 trials of 06 (7 runs)" in first
    assert "not run in this pilot: 01_inspect_examples" in first
    runs, events = runs_of(store, ViewType.ALL), fingerprint(tmp_path / "tb")
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "MLflow: already exported with the same content - nothing added" in second
    assert "TensorBoard: already exported with the same content - nothing added" in second
    assert len(runs_of(store, ViewType.ALL)) == len(runs) == 7
    assert fingerprint(tmp_path / "tb") == events
    assert fingerprint(run) == before, "the run folder was changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "store", "tb"]
    left = [t for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not left, f"threads left running: {left}"


def test_a_changed_run_replaces_its_earlier_export_whole(run, store, tmp_path):
    tb = tmp_path / "tb"
    export_run(str(run), store, str(tb))
    old = set(runs_of(store).id)
    (run / GATES / "notes.md").write_text("the rental GPU is booked\n")  # a new file in 03
    done = export_run(str(run), store, str(tb))
    assert done["mlflow"]["action"] == done["tensorboard"]["action"] == "replaced"
    now = runs_of(store)
    assert len(now) == 7 and not set(now.id) & old, "the new export, whole, and nothing else"
    assert set(runs_of(store, ViewType.DELETED_ONLY).id) == old
    client = mlflow.MlflowClient(store)
    nb03 = now.set_index("name").loc[GATES, "id"]
    assert "notes.md" in {a.path for a in client.list_artifacts(nb03)}
    marker = json.loads((tb / run.name / "workbook-export.json").read_text())
    assert marker["digest"] == read_pilot(run).digest
    assert sorted(p.name for p in tb.iterdir()) == [run.name], "no partial or old folder left"


def test_an_export_that_fails_midway_leaves_nothing(run, store, tmp_path, monkeypatch):
    def broken(self, run_id, local_dir, artifact_path=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mlflow.MlflowClient, "log_artifacts", broken)  # 07's archive
    with pytest.raises(WorkbookError, match="No space left on device; the 1 runs it had "
                                            "written were deleted"):  # the pilot's own run
        export_run(str(run), store)
    assert runs_of(store).empty
    monkeypatch.undo()

    def no_figure(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(export_tensorboard, "_image", no_figure)
    with pytest.raises(WorkbookError, match="Input/output error; nothing of it was kept"):
        export_run(str(run), tensorboard=str(tmp_path / "tb"))
    assert list((tmp_path / "tb").iterdir()) == []


# --- TensorBoard -----------------------------------------------------------------------------
def _events(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0,
                                                          "images": 0})
    events.Reload()
    return events


def _text(events: EventAccumulator, tag: str) -> str:
    return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


def test_tensorboard_shows_the_pilot_the_notebooks_and_every_trial(run, tmp_path):
    done = export_run(str(run), tensorboard=str(tmp_path / "tb"))
    root = Path(done["tensorboard"]["folder"])
    assert root == tmp_path / "tb" / run.name
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["pilot", GATES, STUDY, RESUME, "workbook-export.json"])
    pilot = _events(root / "pilot")
    assert [e.value for e in pilot.Scalars("notebooks_passed")] == [2.0]
    assert "overall **error**" in _text(pilot, "description")
    gates = _events(root / GATES)
    table = pd.read_csv(run / GATES / "gates.csv")
    for row in table.itertuples():
        assert gates.Scalars(f"gate/{name_of(row.phase)}/peak_allocated_bytes")[0].value == \
            pytest.approx(row.peak_allocated_bytes)
    assert "verdict: pass - 9 of 9 gates passed" in _text(gates, "verdict")
    image = gates.Images("figures/gates")[0]
    assert image.encoded_image_string == (run / GATES / "gates.png").read_bytes()
    assert "time limit" in _text(_events(root / RESUME), "verdict")

    trials = ledger_trials(run)
    for row in trials.itertuples():
        events = _events(root / STUDY / f"trial-{row.id}")
        loss = events.Scalars("train/loss")
        assert [e.step for e in loss] == list(range(1, row.stop_step + 1))
        hparams = events.PluginTagToContent("hparams")
        assert set(hparams) == {"_hparams_/experiment", "_hparams_/session_start_info",
                                "_hparams_/session_end_info"}
        start = hparams["_hparams_/session_start_info"]
        assert row.status.encode() in start and b"outcome" in start and b"lr" in start
    diverged = _events(root / STUDY / "trial-2")
    assert "diverged" in _text(diverged, "description")
    assert diverged.Scalars("train/loss")[-1].value > 1e6, "the diverging curve is kept"
    assert [e.step for e in _events(root / STUDY / "trial-1").Scalars("val/loss")] == [5, 10]
    cut = _events(root / STUDY / "trial-3").PluginTagToContent("hparams")
    assert b"interrupted" in cut["_hparams_/session_start_info"]


# --- what is refused, and what is said -------------------------------------------------------
def test_folders_that_are_no_pilot_run_are_refused_with_the_fix(built, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    cases = {str(tmp_path / "empty"): "is not a pilot run folder (no index.json)",
             str(tmp_path / "file.txt"): "is a file, not a run folder",
             str(tmp_path / "absent"): "does not exist",
             str(built / STUDY): "is the folder of one notebook, not a pilot run",
             str(built.parent): "holds pilot runs, it is not one"}
    for folder, problem in cases.items():
        with pytest.raises(WorkbookError, match=re.escape(problem)) as err:
            export_run(folder, "", str(tmp_path / "tb"))
        assert err.value.fix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file.txt"], \
        "nothing written for a refused folder"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "index.json").write_text('{"task": 3, "notebooks": []}')
    with pytest.raises(WorkbookError, match="field 'task'"):
        export_run(str(tmp_path / "broken"), tensorboard=str(tmp_path / "tb"))


def test_a_notebook_folder_named_in_the_index_never_leads_outside_the_run(run, tmp_path):
    index = json.loads((run / "index.json").read_text())
    index["notebooks"][0]["notebook"] = "../../outside"
    (run / "index.json").write_text(json.dumps(index))
    with pytest.raises(WorkbookError, match="field 'notebooks\\[0\\].notebook'"):
        export_run(str(run), tensorboard=str(tmp_path / "tb"))


def test_what_people_read_names_the_runs_files_relative_to_it(built):
    """The run folder lies outside the repository (under /tmp): the notes an export writes
    (markdown) name its files as a reader of the run folder opens them."""
    notes = {e.key: e.note for e in read_pilot(built).entries}
    assert not [key for key, note in notes.items() if f"{built}/" in note]
    trial = next(note for key, note in notes.items() if note.startswith("**trial "))
    assert f"--study {STUDY}/study " in trial, trial


def test_unreachable_and_invalid_mlflow_stores_are_refused_before_anything_is_written(
        run, store, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = fingerprint(run)
    tb = tmp_path / "tb"
    with pytest.raises(WorkbookError, match=f"store http://127.0.0.1:{port} cannot be used") \
            as err:
        export_run(str(run), f"http://127.0.0.1:{port}", str(tb))
    assert "start the tracking server" in err.value.fix
    assert not tb.exists(), "a failed destination writes no other one"
    with pytest.raises(WorkbookError, match="cannot be used") as err:
        export_run(str(run), "nosuchscheme://somewhere")
    assert "sqlite:///PATH/mlflow.db" in err.value.fix
    with pytest.raises(WorkbookError, match="cannot be used") as err:  # a plain ./mlruns folder
        export_run(str(run), str(tmp_path / "mlruns"))  # (MLflow 3 refuses the file store)
    assert "sqlite:///PATH/mlflow.db" in err.value.fix and not (tmp_path / "mlruns").exists()
    other = tmp_path / "notes.db"
    import sqlite3

    db = sqlite3.connect(other)
    db.execute("CREATE TABLE notes (text TEXT)")
    db.commit()
    db.close()
    kept = other.read_bytes()
    with pytest.raises(WorkbookError, match="is a SQLite database but not an MLflow store"):
        export_run(str(run), str(other))
    assert other.read_bytes() == kept, "MLflow's tables were not added to someone's database"
    (tmp_path / "text.db").write_text("not a database at all " * 100)
    with pytest.raises(WorkbookError, match="is not a SQLite database"):
        export_run(str(run), f"sqlite:///{tmp_path / 'text.db'}")
    inside = f"sqlite:///{run / 'mlflow.db'}"
    with pytest.raises(WorkbookError, match="lies inside the run folder"):
        export_run(str(run), inside)
    with pytest.raises(WorkbookError, match="names no file"):
        export_run(str(run), "sqlite://")
    with pytest.raises(WorkbookError, match="does not exist"):
        export_run(str(run), f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}")
    with pytest.raises(WorkbookError, match="would write into the run folder"):
        export_run(str(run), tensorboard=str(run / "tb"))
    with pytest.raises(WorkbookError, match="would write into the run folder"):
        export_run(str(run), tensorboard=str(run.parent))  # DIR/<run name> is the run itself
    (tmp_path / "tb2" / run.name).mkdir(parents=True)
    with pytest.raises(WorkbookError, match="exists and is not a workbook export"):
        export_run(str(run), tensorboard=str(tmp_path / "tb2"))
    assert fingerprint(run) == before
    assert runs_of(store).empty


def test_stores_mlflow_cannot_write_are_named_with_their_fix(run, store, tmp_path):
    import sqlite3

    path = store[len("sqlite:///"):]
    client = mlflow.MlflowClient(store)
    client.delete_experiment(client.create_experiment("old pilots"))
    with pytest.raises(WorkbookError, match="experiment 'old pilots' in .* was deleted") as err:
        export_run(str(run), store, experiment="old pilots")
    assert "mlflow experiments restore" in err.value.fix
    for revision, fix in (("0584bdc529eb", "mlflow db upgrade sqlite:///"),  # older schema
                          ("abcdef123456", "a newer MLflow wrote this store")):
        copy = tmp_path / f"{revision}.db"  # a new URI: MLflow checks a store's schema once
        shutil.copy(path, copy)
        db = sqlite3.connect(copy)
        db.execute("UPDATE alembic_version SET version_num = ?", (revision,))
        db.commit()
        db.close()
        with pytest.raises(WorkbookError, match="Detected out-of-date database schema") as err:
            export_run(str(run), str(copy))
        assert fix in err.value.fix
    assert not (tmp_path / "store" / "mlartifacts").exists() and runs_of(store).empty


def test_a_pilot_still_running_is_exported_as_far_as_it_got_and_said_so(run, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / ".workbook-claim").write_text(json.dumps({"pid": sleeper.pid,
                                                         "claimed": "2026-12-03T12:22:00"}))
        pilot = read_pilot(run)
        assert pilot.still_running
        assert "(the pilot is still running: export again when it ends)" in pilot.missing[0]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not read_pilot(run).still_running, "its process ended"


def test_a_notebook_the_pilot_never_finished_is_a_killed_run_with_its_reason(run, tmp_path):
    from workbook.commands.pilot import _row

    index = json.loads((run / "index.json").read_text())
    index["notebooks"].append(_row("08_rental_plan", "interrupted", "the pilot was interrupted "
                                   "(SIGINT/SIGTERM) before this notebook finished"))
    (run / "index.json").write_text(json.dumps(index))
    pilot = read_pilot(run)
    entry = next(e for e in pilot.entries if e.key == "08_rental_plan")
    assert entry.status == "KILLED" and entry.tags["verdict"] == "interrupted"
    assert entry.files == {} and entry.metrics["passed"] == 0
    assert [m for m in pilot.missing if m.startswith("08_rental_plan")] == [
        "08_rental_plan did not finish (interrupted: the pilot was interrupted (SIGINT/SIGTERM) "
        "before this notebook finished): what it wrote is exported"]
    done = export_run(str(run), tensorboard=str(tmp_path / "tb"))
    assert "interrupted" in _text(_events(tmp_path / "tb" / run.name / "08_rental_plan"),
                                  "verdict")
    assert any("08_rental_plan did not finish" in line for line in lines(done))


def test_without_the_extra_the_error_names_the_install(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    with pytest.raises(WorkbookError, match="MLflow's client, which is not installed") as err:
        export_run(str(run), "", str(tmp_path / "tb"))
    assert "pip install 'workbook[export]'" in err.value.fix and "make install" in err.value.fix
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(WorkbookError, match="needs the tensorboard package") as err:
        export_run(str(run), tensorboard=str(tmp_path / "tb"))
    assert "pip install 'workbook[export]'" in err.value.fix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert sorted(p.name for p in run.parent.iterdir()) == [run.name], "no store was made"


def test_the_command_line(run, empty_store, capsys):
    shutil.copy(empty_store, run.parent / "mlflow.db")  # the default store, its schema made
    assert main(["export", str(run)]) == 2
    assert "export needs a destination" in capsys.readouterr().err
    assert main(["export", "--mlflow", str(run)]) == 0  # the folder taken by --mlflow
    out = capsys.readouterr().out
    store = run.parent / "mlflow.db"
    assert f"store sqlite:///{store}" in out and f"mlflow ui --backend-store-uri " \
        f"sqlite:///{store}" in out
    assert (run.parent / "mlartifacts").is_dir(), "artifacts beside the store, not in the cwd"
    assert len(runs_of(f"sqlite:///{store}")) == 7
    assert main(["export", str(run), "--mlflow", "--experiment", " "]) == 2
    assert "--experiment is empty" in capsys.readouterr().err


def test_importing_the_workbook_loads_neither_mlflow_nor_tensorboard():
    code = ("import sys, workbook, workbook.commands.cli as cli; cli.parser(); "
            "import workbook.commands.export; "
            "print(sorted(m for m in ('mlflow', 'tensorboard', 'torch.utils.tensorboard') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
