"""Notebook 09's rules for a task's own training pipeline, rank by rank: each rank's pipeline
(opened with its rank and the world size, as every process of the launch opens it) reads
examples no other rank reads, and each rank's data position comes back in a new pipeline -
through its own state_dict, or by count-and-skip - in the middle of the first pass (read on
across its end), in the middle of the second, restored as a training loop does
(load_state_dict, then set_epoch), a second time after a resume; and a new pass is not the
last one read again. Read in this process (nothing trained): the rules are about the data. A
position that does not come back is named by its cause in notebook 07's words (resume.position),
and the row's fix is that cause's fix."""

from __future__ import annotations

from typing import Any

from ...contract.pipeline import DataPosition, open_pipeline
from ...contract.task import Task
from ..resume.position import Order, pipeline_length, pipeline_order, repeated, resumed_from

PIPELINE_RULES = {
    "the pipeline's ranks read disjoint examples":
        "deal the data to ranks by rank and world size (split_dataset_by_node, "
        "DistributedSampler, or shards[rank::world]) before dealing a rank's share to workers",
    "each rank's pipeline position comes back":
        "save each rank's own pipeline state_dict (or its count of examples read) in the "
        "checkpoint and load that rank's own on resume",
}


def _row(rule: str, ok: bool, measured: str, fixes: list[str] = ()) -> dict[str, str]:
    fix = "; ".join(dict.fromkeys(fixes)) or PIPELINE_RULES[rule]
    return {"rule": rule, "verdict": "pass" if ok else "fail", "measured": measured,
            "remediation": "" if ok else fix}


def _read(task: Task, seed: int, rank: int, world: int, micro_batch: int, count: int,
          start: DataPosition | None = None, limit: int = 0, stop_at: tuple[int, ...] = (),
          loop_order: bool = False) -> tuple[list[tuple[int, str]], dict[int, DataPosition]]:
    """(pass, id) of the next `count` examples of one rank's new pipeline from `start`, and
    its data positions after the first `stop_at` of them."""
    pipe = open_pipeline(task, seed, rank, world, micro_batch=micro_batch, limit=limit,
                         loop_order=loop_order)
    got, positions = [], {}
    if count <= 0:
        return got, positions
    for epoch, _, example in pipe.read(start or DataPosition()):
        if example is not None:
            got.append((epoch, str(example[task.id_key])))
        if len(got) in stop_at and len(got) not in positions:
            positions[len(got)] = pipe.position()
        if len(got) >= count:
            break
    return got, positions


class _Rank:
    """One rank's uninterrupted read, and each resume compared with it; a resume that reads
    elsewhere is named by its cause."""

    def __init__(self, task: Task, seed: int, rank: int, world: int, micro_batch: int,
                 limit: int):
        self.task, self.seed, self.rank, self.world = task, seed, rank, world
        self.micro_batch, self.limit = micro_batch, limit
        self.order: Order = pipeline_order(task, seed, rank, world, micro_batch=micro_batch,
                                           limit=limit)
        self.read: list[tuple[int, str]] = []

    def position(self, at: int) -> tuple[int, int]:
        """(pass, examples read in it) after the first `at` examples of the uninterrupted
        read."""
        epoch = self.read[at][0]
        return epoch, sum(1 for e, _ in self.read[:at] if e == epoch)

    def resume(self, label: str, at: int, start: DataPosition, loop_order: bool = False,
               first: tuple[int, int] | None = None, stop_at: tuple[int, ...] = ()
               ) -> tuple[str, str, dict[int, DataPosition]]:
        """(measured, the cause's fix) of a resume after `at` examples ('' when it read what
        the uninterrupted read went on with), and its positions after `stop_at` more."""
        expected = self.read[at:]
        again, positions = _read(self.task, self.seed, self.rank, self.world,
                                 self.micro_batch, len(expected), start, self.limit, stop_at,
                                 loop_order)
        if again == expected:
            return "", "", positions
        k = next((i for i, (a, b) in enumerate(zip(again, expected, strict=False)) if a != b),
                 min(len(again), len(expected)))
        said = (f"rank {self.rank}: {label} its new pipeline read "
                f"{[i for _, i in again[k:k + 3]]} where it had read "
                f"{[i for _, i in expected[k:k + 3]]}")
        if k or not again:  # it went wrong later, not at the resume point
            return said, "", positions
        length = pipeline_length(self.task, self.seed, self.rank, self.world,
                                 micro_batch=self.micro_batch)
        where, why = resumed_from(*self.position(at), at, [i for _, i in again[:4]],
                                  self.order, self.micro_batch, first, length)
        return f"{said} ({where})", why, positions


def _position_rule(task: Task, seed: int, rank: int, world: int, micro_batch: int,
                   examples: int, limit: int) -> tuple[list[tuple[int, str]], list[str],
                                                      list[str]]:
    """One rank's uninterrupted read, what its resumes lost, and the causes' fixes. A pass
    that repeats the last one makes that read no reference: it is named alone."""
    one = _Rank(task, seed, rank, world, micro_batch, limit)
    half, second = examples // 2, limit + 1  # in the first pass, at the second's start
    inside = limit + max(2, limit // 3)  # a third of the way into the second pass
    one.read, at = _read(task, seed, rank, world, micro_batch, limit * 2 + half,
                         limit=limit, stop_at=(half, second, inside))
    if half not in at:
        return one.read, [f"rank {rank}'s pipeline ended before {half} examples"], []
    found = repeated([{"epoch": e, "ids": [i]} for e, i in one.read], one.order)
    if found:
        return one.read, [f"rank {rank}: {found[0]}"], [found[1]]
    lost, fixes = [], []

    def check(said: str, why: str, *_) -> None:
        if said:
            lost.append(said)
            fixes.extend([why] if why else [])

    check(*one.resume(f"after {half} examples", half, at[half]))
    if inside in at and not lost:
        check(*one.resume(f"after {inside} examples ({inside - limit} into pass 1)", inside,
                          at[inside]))
        check(*one.resume(f"after {inside} examples, restored as a training loop does "
                          "(load_state_dict, then set_epoch),", inside, at[inside],
                          loop_order=True))
    if inside in at and not lost:
        said, why, again = one.resume(f"after {second} examples", second, at[second],
                                      stop_at=(inside - second,))
        check(said, why)
        if not said and inside - second in again:
            check(*one.resume(f"resumed twice (after {second}, then {inside} examples)",
                              inside, again[inside - second], first=one.position(second)))
    return one.read, lost, fixes


def pipeline_rules(task: Task, world: int, seed: int, micro_batch: int,
                   examples: int = 32) -> list[dict[str, Any]]:
    """The rows of the two rules, [] for a task without a train_pipeline. Each rank's passes
    are cut to three quarters of `examples`; its position is taken halfway through the first
    pass and a third of the way into the second."""
    if task.train_pipeline is None:
        return []
    limit = max(2, examples * 3 // 4)
    read, clashes, lost, fixes = {}, [], [], []
    for rank in range(world):
        read[rank], rank_lost, rank_fixes = _position_rule(task, seed, rank, world,
                                                           micro_batch, examples, limit)
        lost += rank_lost
        fixes += rank_fixes
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
             f"each of {world} ranks, resumed in its first and second pass, in a training "
             f"loop's order and twice, read the same next examples (passes {passes})", fixes),
    ]
