"""Notebook 09: the same loop on N processes with DistributedDataParallel, launched with
torchrun from this (single) process under a time limit, and the multi-host rules checked on
what every rank reported: one writer, identical replicas, disjoint shards with a new order each
pass, global loss normalisation, synchronised batch-norm statistics, evaluation as sums over
ranks, and resume of the N-process run in N new processes. Then the same loop sharded with
FSDP2 (`sharded_replica`, two more launches) and the rules that change under sharding: every
rank writes its shard of a DCP checkpoint, resume from it in new processes is exact, the first
updates agree with one process, tied weights stay tied; and the per-rank peak of every phase
against `sharding.predict_sharded`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ...base.errors import WorkbookError
from ...contract.data import prepare
from ...contract.task import Task
from ...training.replica import FAULTS, ReplicaSpec
from ..accounting import BatchAccount
from ..parameters import ParallelParams
from ..registry import PARALLEL
from .faults import (
    CAUGHT_BY,
    NOT_DEMONSTRABLE,
    Demonstration,
    demonstration,
    demonstrations,
    fault_table,
    planted_faults,
    planted_runs,
)
from .fsdp import (
    FSDP_RULES,
    UNSHARDABLE,
    ShardedCheck,
    measure_fsdp,
    memory_table,
    sharded_check,
    sharded_faults,
    sharded_spec,
    sharded_verdict,
    unshardable,
)
from .launches import (
    LAUNCH_TIMEOUT,
    check_devices,
    command,
    launch,
    launch_in_turn,
    rented_spec,
    shell_command,
)
from .pipeline import PIPELINE_RULES, pipeline_rules
from .rank_rules import (
    RULES,
    accounting,
    evaluation_table,
    outcome,
    phase_table,
    resume_check,
    resume_point,
    resume_rule,
    rules,
    verdict,
    with_row,
)


@dataclass
class ParallelResult:
    """Everything notebook 09 shows: the launch, its rules (the resume in new processes
    included), the accounting over ranks, evaluation, phase times and the planted bugs."""

    task: Task
    backend: str  # which collective backend carries the launch, in words
    spec: ReplicaSpec
    account: BatchAccount  # the calculator for this launch
    launch: dict  # what rank 0 gathered
    rules: pd.DataFrame
    accounting: pd.DataFrame
    evaluation: pd.DataFrame
    phases: pd.DataFrame
    resume_row: dict
    resumed: pd.DataFrame
    faults: pd.DataFrame | None
    rented_command: str  # the same launch on 8 GPUs, by hand
    sharded: "ShardedCheck | None" = None  # the FSDP2 section (parameter fsdp)
    sharded_note: str = ""  # why the FSDP2 section did not run, when it was asked for


def run(params: ParallelParams | Mapping[str, Any], out_dir: Path) -> ParallelResult:
    """Notebook 09 from its parameters: the launch, the resume and the planted bugs run in
    folders under `out_dir`."""
    params = PARALLEL.check(params)
    shape = params.shape()
    backend_line = check_devices(params.device, shape.replicas)
    task = params.load_task()
    items = prepare(task, ("train",), {"train": params.train_limit}).train
    spec = ReplicaSpec(params.task, params.task_options, shape, params.updates,
                       params.lr, params.seed, params.train_limit,
                       params.validation_limit, params.eval_batch,
                       check_examples=params.check_examples,
                       checkpoint_at=params.checkpoint_at, device=params.device)
    result = launch(spec, out_dir / "run", timeout=params.launch_timeout)
    # the resume's new processes then run the planted faults in turn: one start for both
    demos = (demonstrations(spec, items, result, task=task, tolerance=params.tolerance)
             if params.demonstrate_faults else {})
    runs = [(spec, out_dir / "resumed"), *planted_runs(demos, out_dir)]
    resumed_launch, *planted = launch_in_turn(runs, resume_point(result, out_dir / "run"),
                                              LAUNCH_TIMEOUT * len(runs))
    resume_row, resumed = resume_rule(spec, result, resumed_launch, out_dir / "run",
                                      out_dir / "resumed", params.resume_tolerance)
    faults = (fault_table(demos, planted, task=task, tolerance=params.tolerance)
              if params.demonstrate_faults else None)
    rented = rented_spec(spec)
    sharded, sharded_note = None, "not run (fsdp = False)"
    if params.fsdp:
        try:
            sharded = sharded_check(sharded_spec(spec), task, out_dir, params.tolerance,
                                    params.resume_tolerance, params.launch_timeout)
        except WorkbookError as exc:  # the model's own operations under fully_shard
            if not UNSHARDABLE.search(exc.problem):
                raise
            sharded_note = unshardable(exc.problem)
    table = with_row(rules(result, items, params.tolerance, task=task), resume_row)
    for row in pipeline_rules(task, shape.replicas, params.seed, shape.micro_batch,
                              params.check_examples):
        table = with_row(table, row)
    return ParallelResult(
        task, backend_line, spec, BatchAccount(shape, len(items)), result, table,
        accounting(result, items, task), evaluation_table(result), phase_table(result),
        resume_row, resumed, faults, shell_command(rented), sharded, sharded_note)


def save(result: ParallelResult, out_dir: Path) -> str:
    """Notebook 09's tables and `summary.json`. The verdict fails on a failing rule, and on a
    planted bug its rule missed (a rule that misses its bug cannot be trusted on yours)."""
    from ...storage.runs import save_table, write_summary

    rules, accounting, phases, resumed, faults = (result.rules, result.accounting,
                                                  result.phases, result.resumed, result.faults)
    for table, name in ((rules, "rules"), (accounting, "accounting"), (phases, "phases"),
                        (resumed, "resume")):
        save_table(table, out_dir, name)
    caught = not_shown = None
    if faults is not None:
        save_table(faults, out_dir, "planted_faults")
        caught = {r["planted bug"]: r["caught"] for r in faults.to_dict("records")}
        not_shown = {r["planted bug"]: r["measured"] for r in faults.to_dict("records")
                     if r.get("verdict") == "not demonstrable"}
    verdict_ = outcome(rules, faults)
    sharded = result.sharded
    fsdp = None if result.sharded_note == "not run (fsdp = False)" else \
        {"not_run": result.sharded_note}
    if sharded is not None:
        for table, name in ((sharded.rules, "fsdp_rules"), (sharded.faults, "fsdp_planted_faults"),
                            (sharded.resumed, "fsdp_resume"), (sharded.memory, "fsdp_memory")):
            save_table(table, out_dir, name)
        if sharded_verdict(sharded) == "fail":
            verdict_ = "fail"
        errors = sharded.memory.error_pct.dropna()
        fsdp = {"rules": sharded.rules.set_index("rule").verdict.to_dict(),
                "faults_caught": {r["planted bug"]: r["caught"]
                                  for r in sharded.faults.to_dict("records")},
                "memory_max_abs_error_pct": float(f"{errors.abs().max():.3g}")
                if len(errors) else None,
                "seconds": round(sharded.seconds, 1)}
    checks = {c["case"]: float(f"{c['max_relative_deviation']:.2g}")
              for c in result.launch["gradient_check"]}
    write_summary(out_dir, verdict_, {
        "replicas": result.spec.shape.replicas,
        "rules_failing": int((rules.verdict == "fail").sum()),
        "gradient_max_relative_deviation": checks, "faults_caught": caught,
        "faults_not_demonstrable": not_shown,
        "all_reduce_median_s": float(phases[phases.phase == "all-reduce"].median_s.median()),
        "fsdp": fsdp},
        task=result.task.name, rules=rules.set_index("rule").verdict.to_dict())
    return verdict_


# notebook 09's public names (`wb.parallel.NAME`: the tests, the benchmarks); most live in its
# parts
__all__ = ["CAUGHT_BY", "FAULTS", "NOT_DEMONSTRABLE", "RULES", "Demonstration",
           "ParallelResult", "ReplicaSpec", "accounting", "command", "demonstration",
           "evaluation_table", "launch", "outcome", "phase_table", "planted_faults",
           "resume_check", "rules", "run", "save", "shell_command", "verdict", "with_row",
           "FSDP_RULES", "ShardedCheck", "measure_fsdp", "memory_table", "sharded_check",
           "sharded_faults", "sharded_spec", "sharded_verdict", "PIPELINE_RULES",
           "pipeline_rules"]
