"""Notebook 09's process under torchrun (`workbook ddp`, one per rank): refused outside
torchrun, rank 0 claims the launch's folders, and each spec (--spec, then every --then) says
which replica this rank runs - data-parallel (`training/replica.py`) or FSDP
(`training/sharded_replica.py`)."""

from __future__ import annotations

import argparse
import os

from ...base.errors import WorkbookError
from ...storage.processes import command_line
from ...storage.runs import CLAIM, LAUNCH_CLAIM, claim_dir
from ..registry import PARALLEL


def claim_launch(args: argparse.Namespace) -> None:
    """Refuse `workbook ddp` outside torchrun (no RANK/WORLD_SIZE) with the command that starts
    it; on rank 0, claim --out: new or empty (a launch of notebook 09 made and claimed it)."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if not (rank or "").isdigit() or not (world or "").isdigit():
        again = ["ddp", "--spec", args.spec, "--out", args.out]
        again += ["--resume-from", args.resume_from] if args.resume_from else []
        again += [w for then in args.then for w in ("--then", *then)]
        raise WorkbookError(
            "workbook ddp is started by torchrun (notebook 09 does that): RANK and WORLD_SIZE "
            "are not set",
            f"run the notebook ({PARALLEL.stem}), or " + command_line(
                ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "workbook", *again]))
    if rank == "0":
        for out in (args.out, *(out for _, out in args.then)):
            claim_dir(out, LAUNCH_CLAIM, beside=(CLAIM,))


def replica_in_this_process(args: argparse.Namespace) -> int:
    """Run this rank's part of the launch --spec describes, then of each --then in turn (after
    `claim_launch`); its exit code (an error raises)."""
    from ...training import replica, sharded_replica
    from ...training.ranks import leave_launch

    try:
        for spec, out, resume_from in [(args.spec, args.out, args.resume_from),
                                       *((spec, out, None) for spec, out in args.then)]:
            data = replica.read_spec(spec)
            sharded = isinstance(data, dict) and data.get("strategy") == "fsdp"  # FSDP launches
            (sharded_replica if sharded else replica).main(data, out, resume_from)
    finally:
        leave_launch()
    return 0
