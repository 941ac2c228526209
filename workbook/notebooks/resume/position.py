"""Notebook 07's data position: where a resumed run's examples came from, found in the order of
the pass they should come from, and what the difference says about the pipeline, in words."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch.utils.data import DataLoader

from ...contract.data import Item, encode_example, epoch_order, epoch_updates
from ...contract.pipeline import DataPosition, open_pipeline
from ...contract.task import Task
from ...training.loop import TrainConfig

PASS_LIMIT = 200_000  # ids of one pass read for the diagnosis at most

Order = Callable[..., list[str]]  # (pass, upto=0) -> the ids it gives, in order
Cause = Callable[[str, bool, bool], str]  # (guessed cause, twice, loop order) -> what to say


def pass_orders(task: Task, items: list, cfg: TrainConfig, limit: int = 0) -> Order | None:
    """The ids of a pass as a fresh run reads them: the task's pipeline read through (nothing
    trained), or the workbook's order of the items; None for a task's own sampler (its order is
    its own to state) and for a task carrying state, read in order pass after pass."""
    if cfg.pipeline:
        return pipeline_order(task, cfg.seed, workers=cfg.workers,
                              micro_batch=cfg.shape.micro_batch, limit=limit)
    if task.make_sampler is not None or task.state is not None:
        return None

    def order(epoch: int, upto: int = 0) -> list[str]:
        groups = epoch_updates(epoch_order(len(items), cfg.seed, epoch), cfg.shape.micro_batch,
                               cfg.shape.accumulation, cfg.drop_partial)
        return [str(items[i].id) for g in groups for mb in g for i in mb]
    return order


def pipeline_order(task: Task, seed: int, rank: int = 0, world: int = 1, workers: int = 0,
                   micro_batch: int = 1, limit: int = 0) -> Order:
    """A pass of the task's pipeline (of `rank` of `world`) as a new pipeline reads it, cut at
    `limit`; `order(epoch, upto)` reads past the limit, to the pass's first `upto` examples."""
    def read(epoch: int, upto: int = 0) -> list[str]:
        pipe = open_pipeline(task, seed, rank, world, workers=workers,
                             micro_batch=micro_batch, limit=0 if upto else limit)
        ids, most = [], min(upto or PASS_LIMIT, PASS_LIMIT)
        for _, _, example in pipe.read(DataPosition(epoch)):
            if example is None or len(ids) >= most:
                break
            ids.append(str(example[task.id_key]))
        return ids
    return read


def stated_length(task: Task, cfg: TrainConfig) -> int | None:
    """The length the task's pipeline states (len() of what train_pipeline returns), None for
    a stream without one - what a count-and-skip by length divides by."""
    if not cfg.pipeline:
        return None
    return pipeline_length(task, cfg.seed, workers=cfg.workers,
                           micro_batch=cfg.shape.micro_batch)


def pipeline_length(task: Task, seed: int, rank: int = 0, world: int = 1, workers: int = 0,
                    micro_batch: int = 1) -> int | None:
    """len() of the pipeline `rank` opens, None when it has none."""
    return length_of(open_pipeline(task, seed, rank, world, workers=workers,
                                   micro_batch=micro_batch).source)


def length_of(source) -> int | None:
    """len() of a pipeline's source, None for a stream without a usable one."""
    try:
        return int(len(source))
    except Exception:  # no __len__, or one that raises (a stream without a length)
        return None


def position_before(reference: list[dict], step: int) -> tuple[int, int]:
    """(pass, examples read in it) before update `step` of the uninterrupted run."""
    epoch = next(r["epoch"] for r in reference if r["step"] == step)
    return epoch, sum(len(r["ids"]) for r in reference if r["step"] < step and r["epoch"] == epoch)


def where_from(reference: list[dict], resumed: list[dict], after: int, order: Order | None,
               micro_batch: int, first_resume: tuple[int, int] | None = None,
               length: int | None = None, cause: Cause | None = None,
               loop_order: bool = False) -> str:
    """'' when the resumed run's first update read what the uninterrupted run read; else where
    its examples came from and the pipeline bug that explains it. `first_resume`: for a resume
    of a resume, the position the first resume began from; `length`: the pipeline's len();
    `cause`: what the experiments on the pipeline say of the guessed cause (stream_state's
    Findings.cause); `loop_order`: the resume restored as a training loop does."""
    steps = {r["step"] for r in reference}
    if not resumed or after + 1 not in steps:
        return ""
    got = resumed[0]["ids"]
    expected = next(r["ids"] for r in reference if r["step"] == after + 1)
    if got == expected:
        return ""
    if order is None:
        return (f"update {after + 1} read other examples than the uninterrupted run (the task's "
                "own sampler: its order after the resume is not the one it gave)")
    epoch, n = position_before(reference, after + 1)
    total = sum(len(r["ids"]) for r in reference if r["step"] < after + 1)
    where, why = resumed_from(epoch, n, total, got, order, micro_batch, first_resume, length)
    if cause is not None:
        why = cause(why, first_resume is not None, loop_order)
    return f"{where}: {why}" if where.startswith("the resumed") else \
        f"update {after + 1} {where}: {why}"


def find_start(ids: list[str], got: list[str]) -> int | None:
    """Where `got` begins in `ids` (a match may run past the end of `ids`)."""
    need = min(len(got), 2)
    for f in range(len(ids)):
        seen = ids[f:f + len(got)]
        if len(seen) >= need and seen == got[:len(seen)]:
            return f
    return None


def resumed_from(epoch: int, n: int, total: int, got: list[str], order: Order,
                 micro_batch: int, first_resume: tuple[int, int] | None = None,
                 length: int | None = None) -> tuple[str, str]:
    """(where a resume that should go on at example `n` of pass `epoch` - `total` examples
    read in all - read `got` from, the pipeline bug that explains it and its fix)."""
    skipped = _length_skip(epoch, n, total, got, order, length)
    if skipped:
        return skipped
    upto = max(n * max(micro_batch, 1), total) + len(got)  # past a pass cut short
    for e in dict.fromkeys([epoch, *range(epoch + 2)]):
        f = find_start(order(e, upto=upto), got)
        if f is not None:
            return _named(epoch, n, e, f, micro_batch, first_resume)
    seen = set(order(epoch)[:n])
    again = [i for i in got if i in seen]
    if not again:
        return (f"read examples pass {epoch} had not given yet, but not in the uninterrupted "
                "order", "the order after the resume is another (a shuffle buffer whose "
                "content the state does not hold, or a reseeded shuffle)")
    return (f"read {len(again)} examples pass {epoch} had already given before the resume "
            f"(e.g. {again[0]!r}), in another order", "the pipeline was reshuffled or "
            "reseeded on restore")


def _where(epoch: int, n: int, e: int, f: int) -> str:
    return f"the resumed run read from example {f} of pass {e}, the uninterrupted run from " \
           f"example {n} of pass {epoch}"


def _length_skip(epoch: int, n: int, total: int, got: list[str], order: Order,
                 length: int | None) -> tuple[str, str] | None:
    """The resume skipped `total % length` examples of pass `total // length` (or of the pass
    it was given), a Trainer's count-and-skip by len(dataloader) - or, without a length, the
    whole run's count from a pass's start (huggingface/transformers#26413)."""
    if not total or not got:
        return None
    by = [divmod(total, length), (epoch, total % length)] if length else \
        [(0, total), (epoch, total)]
    for e, f in dict.fromkeys(by):
        if (e, f) == (epoch, n) or order(e, upto=f + len(got))[f:f + len(got)] != got:
            continue
        stated = f"{total} examples read in all, " + (
            f"divided by the pipeline's len() of {length}" if length else "skipped from a "
            "pass's start (a stream without a usable __len__: the run counted as one pass)")
        return (_where(epoch, n, e, f), f"the resume skipped by a length the stream does not "
                f"have ({stated}; this run's pass {epoch} had given {n}) - skip by the "
                "examples read in the pass (the checkpoint's position), or give the stream a "
                "state_dict that holds its position")
    return None


def _named(epoch: int, n: int, e: int, f: int, micro_batch: int,
           first_resume: tuple[int, int] | None) -> tuple[str, str]:
    where = _where(epoch, n, e, f)
    if first_resume is not None and (e, f) == first_resume:
        return (f"{where} - where the first resume began", "the pipeline's state did not "
                "advance after load_state_dict, so a second resume restarts from the first")
    if first_resume is not None and f == 0 and e == first_resume[0] == epoch and n:
        return (where, "the pipeline's state did not advance after load_state_dict (the "
                "first resume was exact; its state_dict then gave the pass's start, so a "
                "second resume restarts the stream) - let state_dict report the position "
                "reached after a load as after a fresh start")
    if f == 0 and (e == epoch or e == 0) and n:
        return (where, "the pass restarted from its beginning on restore (an epoch guard "
                "that restarts the epoch instead of going on inside it, or an __iter__ that "
                "starts each pass at its beginning and drops the position load_state_dict gave "
                "back) - go on from the loaded position inside the pass")
    if e != epoch:
        return (where, "the pass number did not come back (set_epoch, or the epoch in its "
                "state)")
    if micro_batch > 1 and n and f == n * micro_batch:
        return (f"{where} = {n} x the micro-batch of {micro_batch}", "a skip counted in "
                "batches where the checkpoint counts examples")
    if f > n:
        return (where, f"{f - n} example(s) lost at the resume point (the state counted "
                "an example read ahead but not yet trained on - one in flight at a yield "
                "boundary)")
    return (where, f"{n - f} example(s) read again")


def repeats(records: list[dict], workers: int) -> str:
    """'' unless an example is read twice in one pass: with DataLoader workers, the sign that
    each worker replays the same shard."""
    by_pass: dict[int, Counter] = {}
    for r in records:
        by_pass.setdefault(r["epoch"], Counter()).update(r["ids"])
    for epoch, counts in sorted(by_pass.items()):
        twice = [i for i, c in counts.items() if c > 1]
        if twice:
            return (f"with {workers} DataLoader workers, {len(twice)} examples were read more "
                    f"than once in pass {epoch} (e.g. {twice[0]!r}, {counts[twice[0]]} times): "
                    "each worker replays the same shard - split the data by "
                    "torch.utils.data.get_worker_info()")
    return ""


def global_seed(task: Task, cfg: TrainConfig) -> str:
    """'' unless the task's pipeline with `cfg.workers` is a DataLoader without its own
    generator: each pass's iterator then draws the workers' seed from the global random
    stream, at another point of it in a resumed run (dropout differs after the resume)."""
    if not cfg.pipeline:
        return ""
    source = open_pipeline(task, cfg.seed, workers=cfg.workers,
                           micro_batch=cfg.shape.micro_batch).source
    if isinstance(source, DataLoader) and source.generator is None:
        return ("the same examples, other parameters: the pipeline's DataLoader has no "
                "generator of its own, so each pass's iterator draws its workers' seed from "
                "the global random stream - at another point of it in the resumed run, whose "
                "dropout then differs; give it generator=torch.Generator().manual_seed(seed)")
    return ""


def random_data(task: Task, items: list[Item], cfg: TrainConfig, limit: int = 0) -> str:
    """'' unless the task's encode gives one example other tensors when it is read again (a
    random augmentation, or other per-example randomness): measured on the first training
    example, encoded twice in this process. A resume that read the same examples but did not
    come out exact then says the data differed, not the loss or the resume."""
    if cfg.pipeline:
        pipe = open_pipeline(task, cfg.seed, micro_batch=cfg.shape.micro_batch, limit=limit)
        raw = next((ex for _, _, ex in pipe.read() if ex is not None), None)
    else:
        raw = next((it.raw for it in items if it.raw is not None), None)
    if raw is None:
        return ""
    first, second = (encode_example(task, raw).tensors for _ in range(2))
    if all(torch.equal(first[k], second[k]) for k in first):
        return ""
    where = f"in its {cfg.workers} DataLoader workers" if cfg.workers else "in encode"
    return (f"the same examples, other parameters: the data differs between runs (random "
            f"augmentation {where}: example {raw[task.id_key]!r} encoded twice gives other "
            "tensors) - seed the workers: a DataLoader generator=torch.Generator()"
            ".manual_seed(seed) and worker seeds derived from it, or seed each example's "
            "augmentation from the epoch and its index")


def repeated_pass(reference: list[dict], order: Order | None) -> str:
    """'' unless a pass of the uninterrupted run read the previous pass's examples again, in
    the same order, where a new pipeline opened at that pass reads another order: the
    pipeline moved to the new pass only when a pass ran to its end (the pilot's passes, like
    a loop that breaks early, stop before it)."""
    found = repeated(reference, order)
    return f"{found[0]}: {found[1]}" if found else ""


def repeated(reference: list[dict], order: Order | None) -> tuple[str, str] | None:
    """repeated_pass's finding as (what was read, the cause and its fix), or None."""
    if order is None:
        return None
    passes: dict[int, list[str]] = {}
    for r in reference:
        passes.setdefault(r["epoch"], []).extend(r["ids"])
    for epoch in sorted(passes)[1:]:
        got, before = passes[epoch], passes.get(epoch - 1, [])
        if not got or got != before[:len(got)]:
            continue
        fresh = order(epoch)[:len(got)]
        if fresh != got:
            return (f"pass {epoch} repeated pass {epoch - 1} (the same {len(got)} examples in "
                    f"the same order, e.g. {got[0]!r} first) where a new pipeline opened at "
                    f"pass {epoch} reads {fresh[:1]!r} first", "the pipeline commits its epoch "
                    "only when a pass runs to its end, so a loop that breaks early (a step "
                    "budget, the pilot's cut passes) replays the pass - take the epoch from "
                    "set_epoch (or advance it in __iter__), not from the end of the pass")
    return None
