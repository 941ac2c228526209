"""The ledger holds data only: SQL planted in it never runs and is refused by name, a ledger that
does not record the study's trials (restored, emptied) is refused without a change, a lock held
by another process is named, and a `running` row is recovered only when its process has ended.
Each probe has a clean twin that must work. No training: every test takes well under a second
(the lock probe starts one small Python process)."""

import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading

import pytest

from workbook import WorkbookError
from workbook.storage import ledger as ledger_module
from workbook.storage.ledger import Ledger, process_identity

STEP = {"step": 1, "loss": 1.0, "lr": 0.1, "examples": 2, "targets": 2, "time_s": 0.1}


def _study(tmp_path, trials=1):
    """A study folder as Study leaves it: ledger.sqlite and trials/<id>/ per trial."""
    folder = tmp_path / "study"
    folder.mkdir()
    ledger = Ledger(folder / "ledger.sqlite")
    ledger.add_study("s", "design.json")
    for n in range(trials):
        tid = ledger.start_trial("s", {"lr": 0.1 * (n + 1), "seed": 0}, "repro")
        (folder / "trials" / str(tid)).mkdir(parents=True)
        ledger.add_steps(tid, [STEP])
        ledger.end_trial(tid, "finished", "", 1)
    ledger.close()
    return folder, folder / "ledger.sqlite"


def _raw(path, *statements):
    db = sqlite3.connect(path, isolation_level=None)
    for s in statements:
        db.execute(s)
    db.close()


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(path, *words):
    before = _digest(path)
    with pytest.raises(WorkbookError) as info:
        Ledger(path)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert _digest(path) == before, "a refused ledger is left as it was"
    return info.value


# --- SQL from disk ------------------------------------------------------------------------
@pytest.mark.parametrize("plant, words", [
    ("CREATE TRIGGER wipe AFTER INSERT ON steps BEGIN DELETE FROM trials; END",
     ["holds a trigger 'wipe' the workbook did not create: a ledger holds data only"]),
    ("CREATE VIEW best AS SELECT * FROM trials", ["holds a view 'best'"]),
    ("CREATE TABLE notes (x)", ["holds a table 'notes'"]),
    ("CREATE INDEX by_loss ON steps (abs(loss))", ["holds an index 'by_loss'"]),
    ("ALTER TABLE trials ADD COLUMN extra TEXT",
     ["the table 'trials' has the column(s) 'extra' the workbook did not create"]),
])
def test_sql_or_objects_the_workbook_did_not_create_are_refused_by_name(plant, words, tmp_path):
    _, path = _study(tmp_path)
    _raw(path, plant)
    error = _refused(path, *words)
    assert "start a new study folder" in error.fix


def test_a_planted_trigger_never_deletes_rows(tmp_path):
    """Seen: a trigger in ledger.sqlite deleted every trial when the next trial wrote."""
    _, path = _study(tmp_path, trials=2)
    _raw(path, "CREATE TRIGGER wipe AFTER INSERT ON steps BEGIN DELETE FROM trials; END")
    _refused(path, "trigger 'wipe'")
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM trials").fetchone()[0] == 2
    db.close()


def test_sql_reached_through_a_trigger_is_not_authorized_even_past_the_check(tmp_path,
                                                                             monkeypatch):
    """The second line: with the schema check skipped, SQLite's authorizer still refuses to
    run a trigger's body (and the write is refused whole)."""
    _, path = _study(tmp_path)
    ledger = Ledger(path)
    _raw(path, "CREATE TRIGGER wipe AFTER INSERT ON steps BEGIN DELETE FROM trials; END")
    with pytest.raises(WorkbookError, match="tried to run SQL of its own"):
        ledger.add_steps(1, [{**STEP, "step": 2}])
    assert len(ledger.frame("trials")) == 1 and len(ledger.frame("steps")) == 1
    assert ledger.db.execute("PRAGMA trusted_schema").fetchone()[0] == 0
    ledger.close()


def test_a_table_missing_a_column_is_named_not_an_operational_error(tmp_path):
    _, path = _study(tmp_path)
    _raw(path, "CREATE TABLE s2 (trial INTEGER NOT NULL REFERENCES trials(id), step INTEGER "
               "NOT NULL, loss REAL, lr REAL, examples INTEGER, targets INTEGER, "
               "PRIMARY KEY (trial, step))", "DROP TABLE steps", "ALTER TABLE s2 RENAME TO steps")
    _refused(path, "the table 'steps' lacks the column(s) 'time_s' the workbook writes")


def test_a_table_with_changed_constraints_is_refused(tmp_path):
    _, path = _study(tmp_path)
    _raw(path, "CREATE TABLE c2 (trial INTEGER, step INTEGER, path TEXT, metric REAL, "
               "kept INTEGER DEFAULT 0)", "DROP TABLE checkpoints",
         "ALTER TABLE c2 RENAME TO checkpoints")
    _refused(path, "the table 'checkpoints' is not defined as the workbook defines it")


def test_clean_twins_a_new_an_intact_and_an_analyzed_ledger_open(tmp_path):
    folder, path = _study(tmp_path)
    _raw(path, "ANALYZE")  # what SQLite tools add: planner statistics, data only
    ledger = Ledger(path)
    assert ledger.frame("trials").status.tolist() == ["finished"]
    tid = ledger.start_trial("s", {"lr": 1.0, "seed": 0}, "repro")
    assert tid == 2
    ledger.close()
    with pytest.raises(ValueError, match="no table 'sqlite_master'"):
        Ledger(path).frame("sqlite_master")


def test_a_ledger_of_the_first_version_gets_the_process_column_and_keeps_its_rows(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    path = folder / "ledger.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(ledger_module.SCHEMA)
    db.execute("INSERT INTO studies VALUES ('s', 'c', '', 0)")
    db.execute("INSERT INTO trials (study, params, status, repro, pid, started) "
               "VALUES ('s', '{}', 'finished', 'r', 1, 0)")
    db.close()
    ledger = Ledger(path)
    assert "process" in ledger.frame("trials").columns
    assert ledger.frame("trials").status.tolist() == ["finished"]
    ledger.close()
    Ledger(path).close()  # and it reopens as a ledger of this version


def test_a_file_that_is_no_database_is_refused_as_before(tmp_path):
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"not sqlite at all" * 100)
    _refused(path, "cannot be opened")


# --- restored and empty ledgers -----------------------------------------------------------
def test_a_zero_byte_ledger_of_a_study_with_trials_is_refused_unchanged(tmp_path):
    folder, path = _study(tmp_path, trials=2)
    for extra in ("-wal", "-shm"):
        (folder / f"ledger.sqlite{extra}").unlink(missing_ok=True)
    path.write_bytes(b"")
    error = _refused(path, "is empty (0 bytes), but",
                     "holds trials 1, 2: the rows that recorded them are gone")
    assert "put back a copy of ledger.sqlite" in error.fix
    assert path.stat().st_size == 0 and sorted(os.listdir(folder / "trials")) == ["1", "2"]


def test_a_zero_byte_ledger_beside_its_write_ahead_log_is_refused_unchanged(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "ledger.sqlite").write_bytes(b"")
    (folder / "ledger.sqlite-wal").write_bytes(b"\x37\x7f\x06\x82" + b"\0" * 60)
    _refused(folder / "ledger.sqlite", "ledger.sqlite-wal beside it holds 64 bytes",
             "opening it would discard them")
    assert (folder / "ledger.sqlite-wal").stat().st_size == 64


def test_clean_twin_a_zero_byte_ledger_of_a_new_study_is_a_new_ledger(tmp_path):
    """A 0-byte file holds nothing (SQLite itself reads it as an empty database, and a study
    killed right after creating it leaves one): with no trial folders, nothing can be lost."""
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"")
    ledger = Ledger(path)
    assert ledger.start_trial("s", {}, "r") == 1
    ledger.close()


def test_a_ledger_restored_from_an_older_copy_is_refused_then_goes_on_without_them(tmp_path):
    """Seen: the restored copy handed out trial 2 again, and the trial's folder ended in a
    FileExistsError traceback."""
    folder, path = _study(tmp_path, trials=1)
    shutil.copy(path, tmp_path / "old.sqlite")
    ledger = Ledger(path)
    tid = ledger.start_trial("s", {"lr": 9, "seed": 0}, "repro")
    (folder / "trials" / str(tid)).mkdir()
    ledger.close()
    for extra in ("-wal", "-shm"):
        (folder / f"ledger.sqlite{extra}").unlink(missing_ok=True)
    shutil.copy(tmp_path / "old.sqlite", path)
    error = _refused(path, "does not record trial 2, whose folder is in",
                     "older than the study folder")
    assert "move that trial folder out" in error.fix
    shutil.move(folder / "trials" / "2", tmp_path / "trial-2")  # the fix it names
    ledger = Ledger(path)
    tid = ledger.start_trial("s", {}, "r")
    (folder / "trials" / str(tid)).mkdir()  # no FileExistsError: the id is free
    ledger.close()


def test_an_id_whose_trial_folder_exists_is_never_handed_out(tmp_path):
    folder, path = _study(tmp_path, trials=1)
    ledger = Ledger(path)
    (folder / "trials" / "2").mkdir()  # made after the open (another process, a copy)
    (folder / "trials" / "7").mkdir()
    assert ledger.start_trial("s", {}, "r") == 8
    ledger.close()


# --- links --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"])
def test_a_linked_ledger_file_is_refused_and_its_target_untouched(name, tmp_path):
    folder, path = _study(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(path.read_bytes() if name == "ledger.sqlite" else b"precious")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(WorkbookError, match=f"{name} is a symbolic link .*elsewhere"):
        Ledger(path)
    assert target.read_bytes() == before


def test_a_linked_study_folder_or_trials_folder_is_refused(tmp_path):
    folder, path = _study(tmp_path)
    (tmp_path / "alias").symlink_to(folder)
    with pytest.raises(WorkbookError, match="alias is a symbolic link"):
        Ledger(tmp_path / "alias" / "ledger.sqlite")
    shutil.move(folder / "trials", tmp_path / "real-trials")
    (folder / "trials").symlink_to(tmp_path / "real-trials")
    with pytest.raises(WorkbookError, match="trials is a symbolic link"):
        Ledger(path)


# --- locks --------------------------------------------------------------------------------
HOLD = ("import sqlite3, sys\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('PRAGMA locking_mode=' + sys.argv[2])\n"
        "db.execute('BEGIN EXCLUSIVE' if sys.argv[2] == 'EXCLUSIVE' else 'BEGIN IMMEDIATE')\n"
        "db.execute('SELECT COUNT(*) FROM trials').fetchone()\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n")


def _holder(path, mode="NORMAL"):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _release(proc):
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_ledger_locked_by_another_process_is_refused_with_its_pid(tmp_path, monkeypatch):
    """Seen: `database is locked` after 32 s. Now a few seconds, then the process named."""
    monkeypatch.setattr(ledger_module, "BUSY_S", 0.2)
    _, path = _study(tmp_path)
    ledger = Ledger(path)
    proc = _holder(path)
    try:
        with pytest.raises(WorkbookError, match=f"is locked by another process \\(pid "
                                                f"{proc.pid}\\) for more than 0.2 s") as info:
            ledger.start_trial("s", {}, "r")
        assert "wait for that trial to end, or stop it" in info.value.fix
    finally:
        _release(proc)
    assert ledger.frame("trials").id.tolist() == [1], "the refused call wrote nothing"
    assert ledger.start_trial("s", {}, "r") == 2, "clean twin: once it is free, it writes"
    ledger.close()


def test_a_ledger_held_exclusively_is_refused_at_open(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "BUSY_S", 0.2)
    _, path = _study(tmp_path)
    proc = _holder(path, "EXCLUSIVE")
    try:
        with pytest.raises(WorkbookError, match=f"locked by another process \\(pid {proc.pid}"):
            Ledger(path)
    finally:
        _release(proc)
    Ledger(path).close()


def test_a_batch_of_steps_is_written_whole_or_not_at_all(tmp_path):
    _, path = _study(tmp_path)
    ledger = Ledger(path)
    with pytest.raises(sqlite3.IntegrityError):
        ledger.add_steps(1, [{**STEP, "step": 2}, {**STEP, "step": 1}])  # step 1 is there
    assert ledger.frame("steps").step.tolist() == [1]
    ledger.close()


# --- running rows -------------------------------------------------------------------------
def _running(path, pid, process):
    _raw(path, "INSERT INTO trials (study, params, status, repro, pid, process, started) "
               f"VALUES ('s', '{{}}', 'running', 'r', {pid}, "
               f"{'NULL' if process is None else repr(json.dumps(process))}, 0)")
    return sqlite3.connect(path).execute("SELECT MAX(id) FROM trials").fetchone()[0]


def _status(path, tid):
    ledger = Ledger(path)
    row = ledger.trial(tid)
    ledger.close()
    return row["status"], row["stop_reason"]


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_trial_whose_process_ended_is_marked_interrupted(tmp_path):
    _, path = _study(tmp_path)
    pid = _dead_pid()
    tid = _running(path, pid, process_identity(os.getpid()) | {"start": "1"})
    assert _status(path, tid) == ("interrupted", f"its process (pid {pid}) ended before the "
                                                 "trial finished")
    legacy = _running(path, _dead_pid(), None)  # a row of the first version: the pid alone
    assert _status(path, legacy)[0] == "interrupted"


def test_clean_twin_a_trial_whose_process_lives_stays_running(tmp_path):
    _, path = _study(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        ident = process_identity(proc.pid)
        if not ident["start"]:
            pytest.skip("a process's start time cannot be read here")
        alive = _running(path, proc.pid, ident)
        assert _status(path, alive)[0] == "running"
        reused = _running(path, proc.pid, ident | {"start": str(float(ident["start"]) - 7)})
        status, why = _status(path, reused)  # the pid now belongs to another process
        assert status == "interrupted" and "is another process now" in why
        assert _status(path, alive)[0] == "running"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert _status(path, alive)[0] == "interrupted"


def test_this_processs_own_trial_left_running_by_an_interrupt_is_recovered(tmp_path):
    """Seen: a trial stopped by an interrupt in a notebook kernel kept its `running` row forever:
    the kernel lives on, and its pid is the one that reopens the study."""
    _, path = _study(tmp_path)
    ledger = Ledger(path)
    tid = ledger.start_trial("s", {}, "r")  # ...and a KeyboardInterrupt: no end_trial
    assert _status(path, tid) == ("interrupted", f"its process (pid {os.getpid()}, this one) "
                                                 "stopped running it before it finished")
    again = ledger.start_trial("s", {}, "r")
    ledger.start_trial("s", {}, "r")  # the same thread starting anew: the last one stopped
    assert ledger.trial(again)["status"] == "interrupted"
    ledger.close()


def test_clean_twin_a_trial_another_thread_of_this_process_runs_stays_running(tmp_path):
    _, path = _study(tmp_path)
    ledger = Ledger(path)
    tid = ledger.start_trial("s", {}, "r")
    done = threading.Event()
    worker = threading.Thread(target=done.wait)
    worker.start()
    ledger_module._RUNNING[(ledger._key, tid)] = worker  # as if that thread ran it
    try:
        assert _status(path, tid)[0] == "running"
    finally:
        done.set()
        worker.join()
    assert _status(path, tid)[0] == "interrupted"
    ledger.close()


def test_trials_of_another_machine_stay_running_and_a_restart_ends_them(tmp_path):
    _, path = _study(tmp_path)
    me = process_identity()
    other = _running(path, _dead_pid(), me | {"host": "rented-gpu-7"})
    assert _status(path, other)[0] == "running", "only that machine can tell"
    rebooted = _running(path, os.getpid(), me | {"boot": "an-earlier-boot"})
    assert _status(path, rebooted) == ("interrupted",
                                       "the machine restarted before the trial finished")


def test_a_study_reopened_on_an_emptied_or_restored_ledger_is_refused_not_a_traceback(tmp_path):
    """Through notebook 06's Study: the trial's folder once ended in FileExistsError."""
    from workbook.notebooks.study import Study, StudyDesign
    from workbook.training.loop import UpdateShape

    own = "tests.own_task:task"
    design = StudyDesign(name="s", task=own, lrs=[1e-3], updates=2, shape=UpdateShape(4, 1),
                         eval_every=2, eval_batch=8, metric="accuracy", prediction_examples=1)
    study = Study(tmp_path / "s", design)
    fresh = tmp_path / "fresh.sqlite"
    with sqlite3.connect(fresh) as copy:  # a copy made before the first trial
        study.ledger.db.backup(copy)
    (tid,) = study.run_all()
    study.ledger.close()
    path = study.folder / "ledger.sqlite"
    shutil.copy(path, tmp_path / "kept.sqlite")
    for extra in ("-wal", "-shm"):
        (study.folder / f"ledger.sqlite{extra}").unlink(missing_ok=True)
    for planted, words in ((b"", "is empty (0 bytes), but"), (fresh.read_bytes(),
                                                                "does not record trial 1")):
        path.write_bytes(planted)
        with pytest.raises(WorkbookError, match=re.escape(words)):
            Study(study.folder, task=own)
        assert path.read_bytes() == planted
    shutil.copy(tmp_path / "kept.sqlite", path)  # the fix: the copy that records the trial
    again = Study(study.folder, task=own)
    assert again.trial_table().status.tolist() == ["finished"] and again.run_all() == []
    again.ledger.close()


def test_a_start_or_boot_time_is_the_same_within_a_second_of_clock_adjustment():
    from workbook.storage.ledger import same_time

    assert same_time("1796418420.25", "1796418420.70") and same_time("", "")
    assert not same_time("1796418420.25", "1796418413.25")  # the pid is another process now
    assert not same_time("9af1-boot-id", "1796418420")  # a ledger of an earlier version


def test_the_rows_the_export_reads_have_the_columns_the_ledger_declares(tmp_path):
    import sqlite3

    from workbook.storage.ledger import SCHEMA, row_type

    _, path = _study(tmp_path)
    ledger = Ledger(path)
    (trial,) = ledger.records("trials")
    mem = sqlite3.connect(":memory:")
    mem.executescript(SCHEMA)
    declared = [c[1] for c in mem.execute("PRAGMA table_info(trials)")]
    assert list(row_type("trials")._fields) == [*declared, "process"]  # + the added column
    assert isinstance(trial, row_type("trials")) and trial.best_step is None  # NULL as None
    assert list(ledger.frame("trials").columns) == list(trial._fields)
    ledger.close()
