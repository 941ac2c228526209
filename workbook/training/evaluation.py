"""Evaluation: loss and metrics over exactly the given items, kept as sums so they add over any
batching or any split of the items (data-parallel ranks)."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..base.errors import WorkbookError
from ..contract.data import Batch, Item, collate_items
from ..contract.outputs import eval_mode
from ..contract.run import EXAMPLE_WEIGHT
from ..contract.state import Carry, carrying
from ..contract.targets import IGNORE_INDEX
from ..contract.task import Task, own_code
from ..storage.records import EvalRecord
from .devices import PRECISIONS


def target_count(value: float) -> int | float:
    """A target count as the loss reported it: an integer when it is whole, else the float (a
    task's loss may weigh its targets)."""
    return int(value) if float(value).is_integer() else float(value)


def _padded(items: list[Item], size: int) -> list[Item]:
    """Fill a final partial evaluation batch with copies whose labels say "no target" (-100 for
    ids, NaN for float targets): the shapes stay those of a full batch and the copies weigh zero
    in every sum."""
    def blank(v: torch.Tensor) -> torch.Tensor:
        return torch.full_like(v, float("nan") if v.is_floating_point() else IGNORE_INDEX)

    filler = Item(None, {k: (blank(v) if k == "labels" else v)
                         for k, v in items[-1].tensors.items()})
    return items + [filler] * (size - len(items))


LOSS = "(loss)"  # the key of the summed loss among the evaluation sums


def evaluation_batches(task: Task, items: list[Item], eval_batch: int,
                       device: torch.device) -> Iterator[Batch]:
    """The batches of an evaluation over exactly these items: a final partial batch is padded
    with copies that weigh zero, and `batch.tensors[EXAMPLE_WEIGHT]` says which rows are real.
    A task carrying state across batches is read in order, a batch never continuing a stream
    twice, and unpadded (a copy would continue its stream again)."""
    for real in _chunks(task, items, eval_batch):
        size = len(real) if task.state is not None else eval_batch
        batch = collate_items(task, _padded(real, size)).to(device)
        # the copies' weight, for a task's own loss or eval_step that does not read the labels
        batch.tensors[EXAMPLE_WEIGHT] = torch.tensor(
            [1.0] * len(real) + [0.0] * (size - len(real)), device=device)
        yield batch


def _chunks(task: Task, items: list[Item], eval_batch: int) -> Iterator[list[Item]]:
    """Consecutive runs of at most `eval_batch` items; with a carried state, a run also ends
    before a stream it already holds."""
    key = task.state.stream_key if task.state is not None else None
    run: list[Item] = []
    streams: set[int] = set()
    for item in items:
        stream = int(item.tensors[key]) if key is not None and key in item.tensors else None
        if len(run) == eval_batch or (stream is not None and stream in streams):
            yield run
            run, streams = [], set()
        run.append(item)
        if stream is not None:
            streams.add(stream)
    if run:
        yield run


def outputs_of(task: Task, model: nn.Module, items: list[Item],
               device: torch.device) -> torch.Tensor:
    """The logits of these items in their order, as one forward of them all; a task carrying
    state gets them batch by batch in order, each stream continuing from its previous item."""
    if task.state is None:
        return task.forward(model, collate_items(task, items).to(device).tensors)
    with carrying(Carry(task.state)):
        return torch.cat([task.forward(model, collate_items(task, run).to(device).tensors)
                          for run in _chunks(task, items, len(items))])


def metric_sums(task: Task, model: nn.Module, logits: torch.Tensor,
                batch: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """One batch's metric sums {name: (numerator, denominator)}: the task's own
    `eval_step(model, batch)` when it brings one (the evaluation the campaign runs), else
    `metrics(logits, batch)`."""
    if task.eval_step is None:
        return task.metrics(logits, batch)
    returned = own_code("eval_step", task.eval_step, model, batch,
                        receives="(model, batch dict) and returns {name: (sum, count)}")
    try:
        return {str(name): (float(num), float(den)) for name, (num, den) in returned.items()}
    except (AttributeError, TypeError, ValueError, RuntimeError):
        raise WorkbookError(f"the task's eval_step returned {str(returned)[:80]!r}, not "
                            "{name: (sum, count)}", "return each metric as its sum and count "
                            'over the batch, e.g. {"accuracy": (correct, examples)}: the '
                            "workbook adds them over the split") from None


@torch.inference_mode()
def evaluation_sums(task: Task, model: nn.Module, items: list[Item], eval_batch: int,
                    device: torch.device, precision: str = "fp32",
                    seen: list | None = None) -> tuple[dict[str, list[float]], dict]:
    """The sums behind an evaluation: {LOSS: [summed loss, targets], metric: [numerator,
    denominator]} and, for classification, [correct, total] per class. Sums add exactly over
    any batching or any split of the items (data-parallel ranks); a final partial batch is
    padded with zero-weight copies. The ids evaluated go to `seen`."""
    dtype = PRECISIONS[precision]
    sums: dict[str, list[float]] = {LOSS: [0.0, 0.0]}
    per_class: dict[str, list[int]] = {}
    with eval_mode(model), carrying(Carry(task.state) if task.state is not None else None):
        for batch in evaluation_batches(task, items, eval_batch, device):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = task.forward(model, batch.tensors)
                metrics = metric_sums(task, model, logits, batch.tensors)
            summed, count = task.loss(logits.float(), batch.tensors)
            sums[LOSS][0] += float(summed)
            sums[LOSS][1] += float(count)
            for name, (num, den) in metrics.items():
                total = sums.setdefault(name, [0.0, 0.0])
                total[0] += num
                total[1] += den
            if task.target_kind.named_classes:
                labels = batch.tensors["labels"]
                hits = logits.argmax(-1) == labels
                for cls in labels[labels != IGNORE_INDEX].unique().tolist():
                    name = task.decode([cls])
                    mine = labels == cls
                    counts = per_class.setdefault(name, [0, 0])
                    counts[0] += int((hits & mine).sum())
                    counts[1] += int(mine.sum())
            if seen is not None:
                seen.extend(i for i in batch.ids if i is not None)
    return sums, dict(sorted(per_class.items()))


def eval_record(sums: dict[str, list[float]], examples: int, step: int = 0,
                per_class: dict | None = None) -> EvalRecord:
    """An evaluation record from its sums: every value is a ratio of sums, never a mean of
    batch (or rank) means."""
    loss_sum, targets = sums[LOSS]
    metrics = {name: num / den if den else float("nan") for name, (num, den) in sums.items()
               if name != LOSS}
    return EvalRecord(step, examples, target_count(targets), loss_sum / max(targets, 1), metrics,
                      per_class or {})


def evaluate(task: Task, model: nn.Module, items: list[Item], eval_batch: int,
             device: torch.device, step: int = 0, precision: str = "fp32",
             seen: list | None = None, averaged: nn.Module | None = None) -> EvalRecord:
    """Loss and metrics over exactly these items in eval mode, identical for any `eval_batch`
    (see `evaluation_sums`). Classification also counts correct predictions per class. With
    `averaged` (the task's averaged model), its loss and metrics on the same items too."""
    sums, per_class = evaluation_sums(task, model, items, eval_batch, device, precision, seen)
    record = eval_record(sums, len(items), step, per_class)
    if averaged is not None:
        beside = eval_record(evaluation_sums(task, averaged, items, eval_batch, device,
                                             precision)[0], len(items), step)
        record.averaged = {"loss": beside.loss, **beside.metrics}
    return record
