"""Notebook 09's planted multi-process bugs: each launched on data that can show it, and
whether the rule meant to name it fails."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ...contract.data import Item
from ...contract.task import Task
from ...training import checkpoint as ckpt
from ...training.deviation import relative_deviation
from ...training.loop import seed_everything
from ...training.ranks import digest
from ...training.replica import (
    FAULTS,
    ReplicaSpec,
    check_items,
    rank_mean_gradient,
    reference_gradient,
    shard,
    update_groups,
)
from .launches import LAUNCH_TIMEOUT, launch_in_turn
from .rank_rules import rules

# The rule each planted fault must fail.
CAUGHT_BY = {"rank_seed": "identical initial parameters",
             "same_order": "disjoint shards covering the split",
             "all_ranks_write": "only rank 0 writes",
             "fixed_order": "a new order every pass",
             "bn_rank0": "batch-norm statistics synchronised",
             "rank_mean_loss": "loss normalised over a partial update (unequal shares)"}


NOT_DEMONSTRABLE = "not demonstrable on this task: "


@dataclass
class Demonstration:
    """The launch that plants one fault: its settings and the training items it runs on, or
    (`why`) the reason no data of this task can show the fault."""

    spec: ReplicaSpec
    items: list[Item] = field(repr=False)
    why: str = ""


def demonstration(fault: str, spec: ReplicaSpec, items: list[Item],
                  reference: dict[str, Any] | None = None, task: Task | None = None,
                  tolerance: float = 1e-4) -> Demonstration:
    """Settings and data on which the planted `fault` is observable: a demonstration whose data
    cannot show its fault proves nothing about the rule, and its miss is no finding about the
    task. What the launch without the fault measured (`reference`) or this process can compute
    decides it; where nothing can show the fault, `why` says so."""
    planted, world = replace(spec, fault=fault), spec.shape.replicas
    if fault == "rank_seed" and task is not None and not _init_depends_on_seed(task, spec.seed):
        return Demonstration(planted, items, f"build_model gives bit-identical parameters "
                             f"after seeding with {spec.seed} and with {spec.seed + 1} "
                             "(pretrained or fixed initialisation), so seeding with the rank "
                             "changes nothing")
    if fault == "all_ranks_write" and not spec.checkpoint_at:  # only a checkpoint shows it
        planted = replace(planted, checkpoint_at=1)
    if fault == "fixed_order":  # every rank must read examples of a second pass
        n = _second_pass_examples(planted, len(items))
        if n is None:
            per_update = spec.shape.examples_per_update
            return Demonstration(planted, items, f"{spec.updates} updates of {per_update} "
                                 f"examples reach no second pass on every rank even with the "
                                 f"fewest training examples the gradient check takes "
                                 f"({2 * world}): raise updates")
        if n < len(items):
            check = min(spec.check_examples, n // (2 * world) * 2 * world)
            planted, items = replace(planted, train_limit=n, check_examples=check), items[:n]
    if fault == "bn_rank0":
        checks = [c for c in ((reference or {}).get("batch_norm_final"),
                              ((reference or {}).get("checkpoint") or {}).get("batch_norm"))
                  if c and c.get("layers")]
        off = max((c.get("rank0_vs_rank_mean", c["ranks_differed_by"]) for c in checks),
                  default=None)
        if off is not None and off <= 1e-6:
            return Demonstration(planted, items, f"rank 0's batch-norm statistics were within "
                                 f"{off:.1g} of the mean over ranks in the launch without the "
                                 "bug (the ranks' statistics agree), so saving rank 0's saves "
                                 "the mean")
    if fault == "rank_mean_loss":
        why = _rank_mean_alike(_partial_check(reference) or _rank_mean_here(task, items, spec),
                               tolerance)
        if why:
            return Demonstration(planted, items, why)
    return Demonstration(planted, items)


def _init_depends_on_seed(task: Task, seed: int) -> bool:
    """Whether the task's model is initialised differently under another seed (this process's
    random state is left as it was)."""
    state = ckpt.rng_state()
    try:
        digests = []
        for s in (seed, seed + 1):
            seed_everything(s)
            digests.append(digest(task.build_model().state_dict()))
    finally:
        ckpt.set_rng_state(state)
    return digests[0] != digests[1]


def _passes_read(n: int, spec: ReplicaSpec, world: int) -> list[set[int]]:
    """The passes in which each rank reads real examples during a launch of `spec` from
    scratch on `n` training examples (the pass order is a pure function, nothing runs)."""
    read: list[set[int]] = [set() for _ in range(world)]
    step, epoch = 0, 0
    while step < spec.updates:
        groups = update_groups(n, spec, epoch, world)[: spec.updates - step]
        for group in groups:
            for r in range(world):
                if shard(group, r, world, spec.shape.micro_batch, spec.fault)[0]:
                    read[r].add(epoch)
        step, epoch = step + len(groups), epoch + 1
    return read


def _second_pass_examples(spec: ReplicaSpec, available: int) -> int | None:
    """The most training examples (at most `available`, at least what the gradient check
    takes) on which every rank of the launch reads examples of a second pass."""
    world, per_update = spec.shape.replicas, spec.shape.examples_per_update
    for n in range(min(available, max(1, (spec.updates - 1) * per_update)), 2 * world - 1, -1):
        if all(1 in passes for passes in _passes_read(n, spec, world)):
            return n
    return None


def _partial_check(launched: dict[str, Any] | None) -> dict[str, Any] | None:
    """The partial case of a launch's gradient check, when it measured the per-rank mean."""
    for check in (launched or {}).get("gradient_check") or []:
        if check["case"] == "partial" and "rank_mean_deviation" in check:
            return check
    return None


def _rank_mean_here(task: Task | None, items: list[Item],
                    spec: ReplicaSpec) -> dict[str, Any] | None:
    """The gradient check's partial case computed in this process (no launch): what a mean
    per rank gives against the whole update's normalisation, at the launch's initial model."""
    world, n = spec.shape.replicas, spec.check_examples
    if task is None or n % (2 * world) or n > len(items):
        return None  # the launch says what is wrong with the settings
    chosen = check_items(task, items, n, world)[: n - 1]
    state = ckpt.rng_state()
    try:
        seed_everything(spec.seed)
        model = task.build_model()
    finally:
        ckpt.set_rng_state(state)
    cpu = torch.device("cpu")
    grads, counts = rank_mean_gradient(task, model, chosen, world, cpu)
    return {"examples": n - 1, "targets_per_rank": counts,
            "split": " + ".join(f"1 x {len(chosen[r::world])}" for r in range(world)),
            "rank_mean_deviation": relative_deviation(grads, reference_gradient(
                task, model, chosen, cpu))}


def _rank_mean_alike(check: dict[str, Any] | None, tolerance: float) -> str:
    """Why a mean per rank cannot be told from the right normalisation on the check's data
    ("" when it can, or when nothing says)."""
    if check is None or check["rank_mean_deviation"] > tolerance:
        return ""
    targets = [int(t) for t in check["targets_per_rank"]]
    cause = ("the loss counts as many targets on every rank whichever examples are chosen"
             if len(set(targets)) == 1 else
             "every rank's share has the same mean gradient per target (alike examples)")
    return (f"on the gradient check's {check['examples']} examples ({check['split']}, targets "
            f"per rank {targets}) a mean per rank gives the whole update's gradient to "
            f"{check['rank_mean_deviation']:.1e} (tolerance {tolerance:.0e}): {cause}")


def planted_faults(spec: ReplicaSpec, items: list[Item], folder: Path,
                   reference: dict[str, Any] | None, faults: tuple[str, ...] = tuple(FAULTS),
                   task: Task | None = None, tolerance: float = 1e-4) -> pd.DataFrame:
    """Each classic multi-process bug planted in its own run, on data that can show it
    (`demonstration`), the runs in turn in one launch: does the rule meant to name each fail? A
    bug the task's model cannot have (batch norm without batch-norm layers) is listed, not
    launched; one no data of this task can show is "not demonstrable", with the reason -
    neither fails the verdict."""
    demos = demonstrations(spec, items, reference, faults, task, tolerance)
    runs = planted_runs(demos, folder)
    launched = launch_in_turn(runs, timeout=LAUNCH_TIMEOUT * len(runs)) if runs else []
    return fault_table(demos, launched, faults, task, tolerance)


def demonstrations(spec: ReplicaSpec, items: list[Item], reference: dict[str, Any] | None,
                   faults: tuple[str, ...] = tuple(FAULTS), task: Task | None = None,
                   tolerance: float = 1e-4) -> dict[str, Demonstration]:
    """`demonstration` of each fault the model can have (bn_rank0 needs batch-norm layers)."""
    bn = (reference or {}).get("batch_norm_final")
    return {fault: demonstration(fault, spec, items, reference, task, tolerance)
            for fault in faults
            if not (fault == "bn_rank0" and bn is not None and not bn.get("layers"))}


def planted_runs(demos: dict[str, Demonstration], folder: Path) -> list[tuple[ReplicaSpec, Path]]:
    """The runs to launch (`launch_in_turn`): each demonstration that can show its fault, in its
    folder `fault-NAME`."""
    return [(demo.spec, folder / f"fault-{fault}") for fault, demo in demos.items()
            if not demo.why]


def fault_table(demos: dict[str, Demonstration], launched: list[dict[str, Any]],
                faults: tuple[str, ...] = tuple(FAULTS), task: Task | None = None,
                tolerance: float = 1e-4) -> pd.DataFrame:
    """One row per fault: its rule's verdict on what its run (`planted_runs`, in that order)
    returned, or why it was not launched."""
    results = iter(launched)
    rows = []
    for fault in faults:
        expected = CAUGHT_BY[fault]
        row = {"planted bug": FAULTS[fault], "rule": expected}
        if fault not in demos:
            rows.append({**row, "verdict": "not applicable", "caught": None,
                         "other failing rules": "",
                         "measured": "not planted: the model has no batch-norm layer"})
            continue
        demo = demos[fault]
        if not demo.why:
            result = next(results)
            table = rules(result, demo.items, tolerance, task=task).set_index("rule")
            verdict = table.verdict[expected]
            if verdict != "fail" and fault == "rank_mean_loss":  # the launch's own measure
                demo.why = _rank_mean_alike(_partial_check(result), tolerance)
        if demo.why:
            rows.append({**row, "verdict": "not demonstrable", "caught": None,
                         "other failing rules": "", "measured": NOT_DEMONSTRABLE + demo.why})
            continue
        rows.append({**row, "verdict": verdict, "caught": verdict == "fail",
                     "other failing rules": ", ".join(r for r in table.index[table.verdict ==
                                                                             "fail"]
                                                      if r != expected),
                     "measured": table.measured[expected]})
    return pd.DataFrame(rows)
