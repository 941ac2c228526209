"""The trial ledger: an SQLite file in the study folder. Rows are appended, never deleted; a trial
only moves forward through its status. A trial left "running" by a process that ended is marked
"interrupted" on the next open (a live one stays running), so nothing is lost and nothing stays
running forever.

A ledger holds data only. Anyone who can write the study folder can put SQL into the file (a
trigger that deletes rows when the next trial writes, a view, a changed table), so it is opened
defensively: schema functions untrusted (`PRAGMA trusted_schema=OFF`), nothing reached through a
trigger or a view authorized, and every object in `sqlite_master` compared with the workbook's
own schema - anything else is refused by name before a row is written. The ledger, its `-wal`,
`-shm` and `-journal` files and its folder must be plain (no links). A ledger that does not
record trials whose folders are in `trials/` (restored from an older copy, or emptied to 0
bytes) is refused rather than written into, so no trial silently drops out of the study."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import socket
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import psutil

from ..base.errors import WorkbookError
from . import schemas
from .files import shown_name
from .processes import process_alive
from .runs import shown

STATUSES = ("running", "finished", "diverged", "failed", "interrupted")
BUSY_S = 5.0  # how long a call waits for another process's write before it is refused
TRIALS = "trials"  # the study folder's trial folders, beside the ledger
SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    name TEXT PRIMARY KEY, config_path TEXT NOT NULL, notes TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT, study TEXT NOT NULL REFERENCES studies(name),
    params TEXT NOT NULL, status TEXT NOT NULL, stop_reason TEXT NOT NULL DEFAULT '',
    stop_step INTEGER, best_step INTEGER, best_metric REAL, best_checkpoint TEXT,
    repro TEXT NOT NULL, repeats INTEGER REFERENCES trials(id), pid INTEGER,
    started REAL NOT NULL, ended REAL);
CREATE TABLE IF NOT EXISTS steps (
    trial INTEGER NOT NULL REFERENCES trials(id), step INTEGER NOT NULL, loss REAL, lr REAL,
    examples INTEGER, targets INTEGER, time_s REAL, PRIMARY KEY (trial, step));
CREATE TABLE IF NOT EXISTS evals (
    trial INTEGER NOT NULL REFERENCES trials(id), step INTEGER NOT NULL, scope TEXT NOT NULL,
    loss REAL, metrics TEXT NOT NULL, per_class TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (trial, step, scope));
CREATE TABLE IF NOT EXISTS checkpoints (
    trial INTEGER NOT NULL REFERENCES trials(id), step INTEGER NOT NULL, path TEXT NOT NULL,
    metric REAL, kept INTEGER NOT NULL DEFAULT 1, PRIMARY KEY (trial, step));
"""
# Added to ledgers of earlier versions on open (nothing else in them changes): `process`, who runs
# a trial (host, boot and the process's start time), so a pid reused by another process, or this
# process's own pid, is not taken for the trial's.
# `scheduled`, the task's schedule's factor at each update (its rate over the rate the trial was
# given), so a study can tell the rate it asked for from the one its trials ran at.
ADDED = ("ALTER TABLE trials ADD COLUMN process TEXT",
         "ALTER TABLE steps ADD COLUMN scheduled REAL")
# What ANALYZE or `PRAGMA optimize` (run by SQLite tools) adds: planner statistics, data only.
STATISTICS = {"sqlite_stat1": "CREATE TABLE sqlite_stat1(tbl,idx,stat)",
              "sqlite_stat4": "CREATE TABLE sqlite_stat4(tbl,idx,neq,nlt,ndlt,sample)"}
# Trials running in this process, by (ledger, trial): the thread running each.
_RUNNING: dict[tuple[str, int], threading.Thread] = {}


@functools.lru_cache(maxsize=2)
def _schema(added: bool = True) -> tuple[dict, dict]:
    """The workbook's own schema, as SQLite stores it: {(type, name): (table, sql)} and
    {table: [columns]} (`added` False: a ledger of the first version)."""
    mem = sqlite3.connect(":memory:")
    mem.executescript(SCHEMA + (";".join(ADDED) if added else ""))
    objects = {(t, n): (tbl, sql) for t, n, tbl, sql in mem.execute(
        "SELECT type, name, tbl_name, sql FROM sqlite_master")}
    columns = {n: [c[1] for c in mem.execute(f"PRAGMA table_info({n})")]
               for t, n in objects if t == "table"}
    mem.close()
    return objects, columns


@functools.lru_cache(maxsize=None)
def row_type(table: str) -> type:
    """A row of one of the ledger's tables: a named tuple of the columns SCHEMA declares (the
    one declaration the ledger writes and its export reads)."""
    return collections.namedtuple(table.title().rstrip("s"), _schema()[1][table])


def _data_only(action: int, arg1: Any, arg2: Any, database: Any, source: str | None) -> int:
    """SQLite's authorizer: nothing reached through a trigger or a view, and no ATTACH."""
    return sqlite3.SQLITE_DENY if source or action == sqlite3.SQLITE_ATTACH else sqlite3.SQLITE_OK


def _started(pid: int) -> str:
    """When a process started (seconds since the epoch), or "" where it cannot be read."""
    with contextlib.suppress(psutil.Error):
        return f"{psutil.Process(pid).create_time():.2f}"
    return ""


def same_time(a: Any, b: Any) -> bool:
    """Two recorded times (a process's start, the machine's boot) within a second: both are
    derived from the clock, which may be adjusted a little. A value of another format (a ledger
    of an earlier version) is never the same."""
    try:
        return a == b or abs(float(a) - float(b)) < 1.0
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, str]:
    return socket.gethostname(), f"{psutil.boot_time():.0f}"


def process_identity(pid: int | None = None) -> dict[str, str]:
    """Who runs a trial, beyond its pid: the host, its boot and the process's start time."""
    host, boot = _machine()
    return {"host": host, "boot": boot, "start": _started(pid or os.getpid())}


def _locked(exc: sqlite3.Error) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _holders(path: Path) -> list[int]:
    """Other processes that have the ledger open (those whose open files can be read)."""
    names = {os.path.realpath(f"{path}{s}") for s in ("", "-wal", "-shm", "-journal")}
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and any(
                    os.path.realpath(f.path) in names for f in process.open_files()):
                found.append(process.pid)
    return sorted(found)


def _linked(path: Path, rule: str, fix: str) -> WorkbookError:
    return WorkbookError(f"{shown(path)} is a symbolic link (to "
                         f"{shown_name(os.readlink(path))}): {rule}", fix)


def _trials(ids: list[int]) -> str:
    """"trial 2" or "trials 2, 3" (the first ten)."""
    listed = ", ".join(map(str, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    return f"trial{'s' if len(ids) > 1 else ''} {listed}"


class Ledger:
    """One study folder's ledger (`ledger.sqlite`); `trials` is the folder of its trials'
    folders (`trials/` beside it by default)."""

    def __init__(self, path: str | Path, trials: str | Path | None = None):
        self.path = Path(path)
        self.trials = Path(trials) if trials is not None else self.path.parent / TRIALS
        self._key = os.path.realpath(self.path)
        empty = self._check_files()
        folders = self._trial_folders()  # before the ids: a trial's row comes before its folder
        if empty and folders:
            raise self._unrecorded(folders, empty)
        try:
            self._busy = BUSY_S
            self.db = sqlite3.connect(self.path, timeout=self._busy, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._damaged(exc) from None
        try:
            with self._guard(opening=True):
                self.db.execute("PRAGMA trusted_schema=OFF")
                self.db.set_authorizer(_data_only)
                tables = self._check_schema()
                known = {r[0] for r in self.db.execute("SELECT id FROM trials")} \
                    if "trials" in tables else set()
                if set(folders) - known:
                    raise self._unrecorded(sorted(set(folders) - known), empty)
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                if self._objects() != _schema()[0]:
                    self._create()
            self.recover()
        except BaseException:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    # --- opening ---------------------------------------------------------------------------
    def _check_files(self) -> str:
        """Refuse links and odd files where the ledger lives; returns why the ledger counts as
        empty ("absent", "0 bytes") or "". An empty ledger beside a non-empty `-wal` is refused:
        SQLite would discard the write-ahead log, which may hold every row."""
        for p in (self.path.parent, self.path, *self._sidecars()):
            with contextlib.suppress(FileNotFoundError):
                mode = os.lstat(p).st_mode
                if stat.S_ISLNK(mode):
                    raise _linked(p, "a ledger is a plain file in a plain study folder",
                                  "copy the real file in (or name the real folder), or start a "
                                  "new study folder")
                if p != self.path.parent and not stat.S_ISREG(mode):
                    raise WorkbookError(f"{shown(p)} is not a plain file",
                                        "remove it, or start a new study folder")
        size = os.lstat(self.path).st_size if self.path.exists() else None
        wal = Path(f"{self.path}-wal")
        if size in (None, 0) and wal.exists() and wal.stat().st_size:
            raise WorkbookError(
                f"{shown(self.path)} is {'missing' if size is None else 'empty (0 bytes)'} but "
                f"{wal.name} beside it holds {wal.stat().st_size} bytes (rows not yet moved into "
                "the ledger): opening it would discard them",
                f"put back the {self.path.name} that {wal.name} belongs to, or move both out and "
                "start a new study folder")
        return "" if size else ("absent" if size is None else "0 bytes")

    def _sidecars(self) -> list[Path]:
        return [Path(f"{self.path}{s}") for s in ("-wal", "-shm", "-journal")]

    def _trial_folders(self) -> list[int]:
        """The ids of the trial folders in `trials/` (a linked `trials/` is refused)."""
        if self.trials.is_symlink():
            raise _linked(self.trials, "a study keeps its trials in a plain folder",
                          "name the real study folder, or start a new one")
        if not self.trials.is_dir():
            return []
        return sorted(int(p.name) for p in self.trials.iterdir()
                      if p.name.isascii() and p.name.isdigit() and p.name == str(int(p.name)))

    def _unrecorded(self, ids: list[int], empty: str) -> WorkbookError:
        where, them = shown(self.trials), "them" if len(ids) > 1 else "it"
        if empty:
            return WorkbookError(
                f"{shown(self.path)} is {'missing' if empty == 'absent' else 'empty (0 bytes)'}, "
                f"but {where} holds {_trials(ids)}: the rows that recorded {them} are gone",
                f"put back a copy of {self.path.name} that records {them}, or start a new study "
                "in a new folder (nothing here was changed)")
        return WorkbookError(
            f"{shown(self.path)} does not record {_trials(ids)}, whose folder"
            f"{'s are' if len(ids) > 1 else ' is'} in {where}: the ledger is older than the "
            "study folder (restored from a copy?)",
            f"put back the newest {self.path.name}, or move {'those' if len(ids) > 1 else 'that'} "
            f"trial folder{'s' if len(ids) > 1 else ''} out of {where} to go on without "
            f"{them}, or start a new study in a new folder (nothing here was "
            "changed)")

    def _check_schema(self) -> set[str]:
        """Refuse every object the workbook did not create, naming it; returns the workbook's
        tables the file holds (a new ledger holds none)."""
        objects, _ = _schema()
        first, _ = _schema(added=False)
        found = self.db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
        foreign = [(t, n) for t, n, tbl, sql in found if (t, n) not in objects and not (
            t == "table" and STATISTICS.get(n) == sql)]
        if foreign:
            things = ", ".join(f"{'an' if t == 'index' else 'a'} {t} {n[:60]!r}"
                               for t, n in foreign)
            raise WorkbookError(f"{shown(self.path)} holds {things} the workbook did not create: "
                                "a ledger holds data only",
                                "remove it (DROP it in the sqlite3 shell), or start a new study "
                                "folder")
        for t, n, tbl, sql in found:
            if (t, n) in objects and (tbl, sql) not in (objects[(t, n)], first.get((t, n))):
                raise self._differs(n)
        return {n for t, n, _tbl, _sql in found if t == "table"}

    def _differs(self, table: str) -> WorkbookError:
        _, columns = _schema()
        have = [c[1] for c in self.db.execute(f'PRAGMA table_info("{table}")')]
        want = columns[table]
        added = {(a.split()[2], a.split()[-2]) for a in ADDED}
        missing = [c for c in want if c not in have and (table, c) not in added]
        extra = [c for c in have if c not in want]
        fix = "use an intact copy of the ledger this study wrote, or start a new study folder"
        if missing:
            return WorkbookError(f"{shown(self.path)}: the table {table!r} lacks the column(s) "
                                 f"{', '.join(map(repr, missing))} the workbook writes", fix)
        if extra:
            return WorkbookError(f"{shown(self.path)}: the table {table!r} has the column(s) "
                                 f"{', '.join(repr(c[:60]) for c in extra)} the workbook did not "
                                 "create: a ledger holds data only", fix)
        return WorkbookError(f"{shown(self.path)}: the table {table!r} is not defined as the "
                             "workbook defines it (its types, keys, constraints or defaults were "
                             "changed)", fix)

    def _objects(self) -> dict:
        return {(t, n): (tbl, sql) for t, n, tbl, sql in self.db.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master")
            if not (t == "table" and STATISTICS.get(n) == sql)}

    def _create(self) -> None:
        """The workbook's tables that are missing, and the columns added since a ledger's version
        (all or nothing)."""
        with self._transaction():
            for statement in filter(str.strip, SCHEMA.split(";")):
                self.db.execute(statement)
            for statement in ADDED:
                table, column = statement.split()[2], statement.split()[-2]
                if column not in {c[1] for c in self.db.execute(f"PRAGMA table_info({table})")}:
                    self.db.execute(statement)
        if self._objects() != _schema()[0]:  # changed while it was opened
            raise WorkbookError(f"{shown(self.path)} changed its schema while it was opened",
                                "make sure nothing else writes the study folder, and open again")

    # --- errors and transactions -----------------------------------------------------------
    def _damaged(self, exc: sqlite3.Error) -> WorkbookError:
        return WorkbookError(f"the ledger {self.path} cannot be opened: {exc}",
                             "restore it from a copy, or start a new study in a new folder "
                             "(a damaged ledger is never overwritten)")

    def _locked_error(self) -> WorkbookError:
        pids = _holders(self.path)
        who = f"pid {', '.join(map(str, pids))}" if pids else "pid unknown"
        stop = f"stop it (kill {pids[0]})" if len(pids) == 1 else "stop that process"
        return WorkbookError(f"{shown(self.path)} is locked by another process ({who}) for more "
                             f"than {self._busy:g} s",
                             f"wait for that trial to end, or {stop}, then run this again; the "
                             "refused call wrote nothing")

    @contextlib.contextmanager
    def _guard(self, opening: bool = False) -> Iterator[None]:
        """SQLite's errors as the user's: a lock held too long, a ledger that is no database,
        SQL refused by the authorizer, a full disk."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            text = str(exc)
            if _locked(exc):
                raise self._locked_error() from None
            if "not authorized" in text:
                raise WorkbookError(f"{shown(self.path)} tried to run SQL of its own (a trigger "
                                    "or a view): a ledger holds data only", "start a new study "
                                    "folder") from None
            if "full" in text:
                raise WorkbookError(f"cannot write the ledger {self.path}: {text}",
                                    "free disk space and run again") from None
            if opening or type(exc) is sqlite3.DatabaseError:  # no database, or a damaged one
                raise self._damaged(exc) from None
            raise

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction, all of it or none of it; it takes the write lock at once, so a
        busy ledger waits (BUSY_S), then is refused by name."""
        with self._guard():
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.db.execute("ROLLBACK")
                raise

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._transaction():
            return self.db.execute(sql, args)

    # --- trials ----------------------------------------------------------------------------
    def _gone(self, tid: int, pid: int | None, process: str | None) -> str:
        """Why the process that ran a trial has certainly ended, or "" while it may still run
        it (a trial recorded on another machine stays running: only that machine can tell)."""
        try:  # bounded: a planted 5,000-digit number or deep array reads as no record
            rec = schemas.parse_json(str(process), self.path, "trial process") if process \
                else {}
        except WorkbookError:
            rec = {}
        rec = rec if isinstance(rec, dict) else {}
        host, boot = _machine()
        if rec and rec.get("host") != host:
            return ""
        if rec and not same_time(rec.get("boot"), boot):
            return "the machine restarted before the trial finished"
        if pid == os.getpid() and same_time(rec.get("start", _started(pid)), _started(pid)):
            thread = _RUNNING.get((self._key, tid))
            running = thread is not None and thread.is_alive() and \
                thread is not threading.current_thread()  # a thread runs one trial at a time
            return "" if running else f"its process (pid {pid}, this one) stopped running it " \
                "before it finished"
        if not process_alive(pid):
            return f"its process (pid {pid}) ended before the trial finished"
        if rec.get("start") and _started(pid) and not same_time(rec["start"], _started(pid)):
            return f"its process ended before the trial finished (pid {pid} is another process now)"
        return ""

    def recover(self) -> list[int]:
        """Mark trials whose process has ended as interrupted (a live one stays running);
        returns their ids."""
        dead: list[int] = []
        query = "SELECT id, pid, process FROM trials WHERE status = 'running'"
        with self._guard():
            if not any(self._gone(*row) for row in self.db.execute(query).fetchall()):
                return dead  # nothing to mark: no write lock taken
        with self._transaction():
            for tid, pid, process in self.db.execute(query).fetchall():
                why = self._gone(tid, pid, process)
                if not why:
                    continue
                last = self.db.execute("SELECT MAX(step) FROM steps WHERE trial = ?",
                                       (tid,)).fetchone()[0]
                self.db.execute("UPDATE trials SET status = 'interrupted', stop_reason = ?, "
                                "stop_step = ?, ended = ? WHERE id = ? AND status = 'running'",
                                (why, last, time.time(), tid))
                dead.append(tid)
        for tid in dead:
            _RUNNING.pop((self._key, tid), None)
        return dead

    def add_study(self, name: str, config_path: str, notes: str = "") -> None:
        self._write("INSERT OR IGNORE INTO studies (name, config_path, notes, created) "
                    "VALUES (?, ?, ?, ?)", (name, config_path, notes, time.time()))

    def start_trial(self, study: str, params: dict, repro: str,
                    repeats: int | None = None) -> int:
        """A new trial's row (status running), under an id no trial folder has yet; trials this
        thread left running (an interrupt) are marked interrupted first."""
        self.recover()
        with self._transaction():
            if repeats is not None and not self.db.execute("SELECT 1 FROM trials WHERE id = ?",
                                                           (repeats,)).fetchone():
                raise WorkbookError(f"trial {repeats} does not exist in {self.path}",
                                    "name an existing trial to repeat (see the study table)")
            used = self.db.execute(
                "SELECT MAX(n) FROM (SELECT MAX(id) AS n FROM trials UNION ALL "
                "SELECT seq FROM sqlite_sequence WHERE name = 'trials')").fetchone()[0] or 0
            tid = max([used, *self._trial_folders()]) + 1
            self.db.execute(
                "INSERT INTO trials (id, study, params, status, repro, repeats, pid, process, "
                "started) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?)",
                (tid, study, json.dumps(params, sort_keys=True), repro, repeats, os.getpid(),
                 json.dumps(process_identity(), sort_keys=True), time.time()))
        _RUNNING[(self._key, tid)] = threading.current_thread()
        return tid

    def add_steps(self, trial: int, steps: list[dict]) -> None:
        with self._transaction():
            self.db.executemany(
                "INSERT INTO steps (trial, step, loss, lr, examples, targets, time_s, "
                "scheduled) VALUES (:trial, :step, :loss, :lr, :examples, :targets, :time_s, "
                ":scheduled)", [{"scheduled": None, **s, "trial": trial} for s in steps])

    def add_eval(self, trial: int, step: int, scope: str, loss: float, metrics: dict,
                 per_class: dict | None = None) -> None:
        self._write("INSERT INTO evals (trial, step, scope, loss, metrics, per_class) "
                    "VALUES (?, ?, ?, ?, ?, ?)", (trial, step, scope, loss,
                                                  json.dumps(metrics), json.dumps(per_class or {})))

    def add_checkpoint(self, trial: int, step: int, path: str, metric: float) -> None:
        self._write("INSERT INTO checkpoints (trial, step, path, metric) VALUES (?, ?, ?, ?)",
                    (trial, step, path, metric))

    def drop_checkpoint(self, trial: int, step: int) -> None:
        """Record that a checkpoint's files were removed (the row stays)."""
        self._write("UPDATE checkpoints SET kept = 0 WHERE trial = ? AND step = ?", (trial, step))

    def set_best(self, trial: int, step: int, metric: float, path: str | None) -> None:
        self._write("UPDATE trials SET best_step = ?, best_metric = ?, best_checkpoint = ? "
                    "WHERE id = ?", (step, metric, path, trial))

    def end_trial(self, trial: int, status: str, reason: str = "",
                  step: int | None = None) -> None:
        if status not in STATUSES[1:]:
            raise ValueError(f"a trial ends as one of {STATUSES[1:]}, not {status!r}")
        self._write("UPDATE trials SET status = ?, stop_reason = ?, stop_step = ?, ended = ? "
                    "WHERE id = ? AND status = 'running'", (status, reason, step, time.time(),
                                                            trial))
        _RUNNING.pop((self._key, trial), None)

    def records(self, table: str, trial: int | None = None) -> list[tuple]:
        """A table's rows (of one trial), each a `row_type(table)`: its fields the columns
        SCHEMA declares, a NULL as None. The export reads the trials through these."""
        if table not in _schema()[1] or table == "sqlite_sequence":
            raise ValueError(f"the ledger has no table {table!r}")
        where = "" if trial is None else f" WHERE {'id' if table == 'trials' else 'trial'} = ?"
        row = row_type(table)
        with self._guard():
            return [row(*r) for r in self.db.execute(
                f"SELECT {', '.join(row._fields)} FROM {table}{where}",
                () if trial is None else (trial,))]

    def frame(self, table: str, trial: int | None = None) -> pd.DataFrame:
        """A table's rows (of one trial) as a frame (a NULL as NaN in a number column)."""
        row = row_type(table) if table in _schema()[1] else None
        return pd.DataFrame.from_records(self.records(table, trial), columns=row and row._fields,
                                         coerce_float=True)

    def trial(self, trial: int) -> dict[str, Any]:
        row = self.frame("trials", trial)
        if row.empty:
            raise WorkbookError(f"no trial {trial} in {self.path}",
                                "give the id of a trial the study's trials table lists")
        return row.iloc[0].to_dict()
