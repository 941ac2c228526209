"""`workbook trial`: one more trial of an existing study (the repro command notebook 06 prints),
run in this process; the command line hands its outcome back."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ...base.errors import WorkbookError
from ...storage.schemas import SEED_MAX


def trial_in_this_process(args: argparse.Namespace) -> tuple[int, dict, WorkbookError | None]:
    """Check the trial's settings, run it into the study's ledger; (exit code, outcome, error):
    1 and the ledger's reason when the trial failed."""
    from . import Study

    if not 0 <= args.seed <= SEED_MAX:
        raise WorkbookError(f"--seed {args.seed} is outside 0..{SEED_MAX}",
                            f"give a seed from 0 to {SEED_MAX}: the trial seeds Python, NumPy "
                            "and torch from it, and NumPy takes no other")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise WorkbookError(f"--lr {args.lr} is not a positive finite number",
                            "give a learning rate such as --lr 1e-3")
    if args.repeats is not None and args.repeats < 1:
        raise WorkbookError(f"--repeats {args.repeats} is not a trial id",
                            "give the id of the trial this one repeats (see the study table)")
    study = Study(args.study, task=args.task, task_options=dict(args.option))
    try:
        tid = study.run_trial(args.lr, args.seed, args.repeats)
        row = study.ledger.trial(tid)
    finally:
        study.ledger.close()
    outcome = {"trial": tid, "status": row["status"], "stop_reason": row["stop_reason"],
               "stop_step": _plain(row["stop_step"])}
    if row["status"] == "failed":
        return 1, outcome, WorkbookError(
            f"trial {tid} failed: {row['stop_reason']}",
            "the ledger keeps its row and error; fix the cause, then run it again as a new "
            f"trial: {study.repro(args.lr, args.seed, tid)}")
    print(f"trial {tid}: {row['status']}" + (f" ({row['stop_reason']})"
                                              if row["stop_reason"] else ""))
    return 0, outcome, None


def _plain(value: Any) -> Any:
    """A ledger value as plain JSON (pandas gives numpy numbers and NaN for NULL)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if hasattr(value, "item") else value
