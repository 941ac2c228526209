"""The trial ledger: an SQLite file in the run folder. Rows are appended, never deleted; a trial
only moves forward through its status. A trial left "running" by a process that died is marked
"interrupted" on the next open, so nothing is lost and nothing stays running forever."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import WorkbookError
from .runs import process_alive

STATUSES = ("running", "finished", "diverged", "failed", "interrupted")
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


class Ledger:
    """One study folder's ledger (`ledger.sqlite`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
            self.recover()
        except sqlite3.DatabaseError as exc:
            raise WorkbookError(f"the ledger {self.path} cannot be opened: {exc}",
                                "restore it from a copy, or start a new study in a new folder "
                                "(a damaged ledger is never overwritten)") from None

    def close(self) -> None:
        self.db.close()

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self.db:  # one transaction: all of it or none of it
            return self.db.execute(sql, args)

    def recover(self) -> list[int]:
        """Mark trials whose process is gone as interrupted; returns their ids."""
        rows = self.db.execute("SELECT id, pid FROM trials WHERE status = 'running'").fetchall()
        dead = [tid for tid, pid in rows if pid != os.getpid() and not process_alive(pid)]
        for tid in dead:
            last = self.db.execute("SELECT MAX(step) FROM steps WHERE trial = ?",
                                   (tid,)).fetchone()[0]
            self._write("UPDATE trials SET status = 'interrupted', stop_reason = ?, "
                        "stop_step = ?, ended = ? WHERE id = ? AND status = 'running'",
                        ("its process ended before the trial finished", last, time.time(), tid))
        return dead

    def add_study(self, name: str, config_path: str, notes: str = "") -> None:
        self._write("INSERT OR IGNORE INTO studies (name, config_path, notes, created) "
                    "VALUES (?, ?, ?, ?)", (name, config_path, notes, time.time()))

    def start_trial(self, study: str, params: dict, repro: str,
                    repeats: int | None = None) -> int:
        if repeats is not None and not self.db.execute("SELECT 1 FROM trials WHERE id = ?",
                                                       (repeats,)).fetchone():
            raise WorkbookError(f"trial {repeats} does not exist in {self.path}",
                                "name an existing trial to repeat (see the study table)")
        cur = self._write(
            "INSERT INTO trials (study, params, status, repro, repeats, pid, started) "
            "VALUES (?, ?, 'running', ?, ?, ?, ?)",
            (study, json.dumps(params, sort_keys=True), repro, repeats, os.getpid(),
             time.time()))
        return int(cur.lastrowid)

    def add_steps(self, trial: int, steps: list[dict]) -> None:
        with self.db:
            self.db.executemany(
                "INSERT INTO steps (trial, step, loss, lr, examples, targets, time_s) "
                "VALUES (:trial, :step, :loss, :lr, :examples, :targets, :time_s)",
                [{**s, "trial": trial} for s in steps])

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

    def frame(self, table: str, trial: int | None = None) -> pd.DataFrame:
        where = "" if trial is None else f" WHERE {'id' if table == 'trials' else 'trial'} = ?"
        return pd.read_sql_query(f"SELECT * FROM {table}{where}", self.db,
                                 params=() if trial is None else (trial,))

    def trial(self, trial: int) -> dict[str, Any]:
        row = self.frame("trials", trial)
        if row.empty:
            raise WorkbookError(f"no trial {trial} in {self.path}", "see the study table")
        return row.iloc[0].to_dict()
