"""Notebook 09's rules for a task's own training pipeline, rank by rank: each rank's pipeline
(opened with its rank and the world size, as every process of the launch opens it) reads
examples no other rank reads, and each rank's data position comes back in a new pipeline -
through its own state_dict, or by count-and-skip - in the middle of a pass and across the
pass's end. Read in this process (nothing trained): the rules are about the data."""

from __future__ import annotations

from typing import Any

from ..contract.pipeline import DataPosition, open_pipeline
from ..contract.task import Task

PIPELINE_RULES = {
    "the pipeline's ranks read disjoint examples":
        "deal the data to ranks by rank and world size (split_dataset_by_node, "
        "DistributedSampler, or shards[rank::world]) before dealing a rank's share to workers",
    "each rank's pipeline position comes back":
        "save each rank's own pipeline state_dict (or its count of examples read) in the "
        "checkpoint and load that rank's own on resume",
}


def _row(rule: str, ok: bool, measured: str) -> dict[str, str]:
    return {"rule": rule, "verdict": "pass" if ok else "fail", "measured": measured,
            "remediation": "" if ok else PIPELINE_RULES[rule]}


def _read(task: Task, seed: int, rank: int, world: int, micro_batch: int, count: int,
          start: DataPosition | None = None, limit: int = 0,
          stop_at: int | None = None) -> tuple[list[tuple[int, str]], DataPosition | None]:
    """(pass, id) of the next `count` examples of one rank's new pipeline from `start`, and
    its data position after the first `stop_at` of them."""
    pipe = open_pipeline(task, seed, rank, world, micro_batch=micro_batch, limit=limit)
    got, position = [], None
    for epoch, _, example in pipe.read(start or DataPosition()):
        if example is not None:
            got.append((epoch, str(example[task.id_key])))
        if len(got) == stop_at and position is None:
            position = pipe.position()
        if len(got) >= count:
            break
    return got, position


def pipeline_rules(task: Task, world: int, seed: int, micro_batch: int,
                   examples: int = 32) -> list[dict[str, Any]]:
    """The rows of the two rules, [] for a task without a train_pipeline. Each rank reads
    `examples`, its passes cut to three quarters of that, so the position taken halfway comes
    back across the end of a pass too."""
    if task.train_pipeline is None:
        return []
    half, limit = examples // 2, max(1, examples * 3 // 4)
    read, clashes, lost = {}, [], []
    for rank in range(world):
        read[rank], position = _read(task, seed, rank, world, micro_batch, examples,
                                     limit=limit, stop_at=half)
        if position is None:
            lost.append(f"rank {rank}'s pipeline ended before {half} examples")
            continue
        again, _ = _read(task, seed, rank, world, micro_batch, len(read[rank]) - half,
                         start=position, limit=limit)
        if again != read[rank][half:]:
            where = next((i for i, (a, b) in enumerate(zip(again, read[rank][half:], strict=False))
                          if a != b), min(len(again), len(read[rank]) - half))
            lost.append(f"rank {rank}: after {half} examples its new pipeline read "
                        f"{[i for _, i in again[where:where + 3]]} where it had read "
                        f"{[i for _, i in read[rank][half + where:half + where + 3]]}")
    for rank in range(world):
        for other in range(rank + 1, world):
            same = {i for e, i in read[rank] if e == 0} & {i for e, i in read[other] if e == 0}
            if same:
                clashes.append(f"ranks {rank} and {other} both read {len(same)} examples of "
                               f"their first pass (e.g. {sorted(same)[0]!r})")
    passes = sorted({e for ids in read.values() for e, _ in ids})
    return [
        _row("the pipeline's ranks read disjoint examples", not clashes, "; ".join(clashes) or
             f"{world} ranks, the first {limit} examples of each first pass: none read twice"),
        _row("each rank's pipeline position comes back", not lost, "; ".join(lost) or
             f"each of {world} ranks resumed after {half} examples read the same next "
             f"{examples - half} (passes {passes})"),
    ]
