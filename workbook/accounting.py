"""Notebook 04: how many examples one update sees and how many updates a budget buys.

A micro-batch is one forward/backward pass; accumulation combines passes into one update; data
replicas multiply the examples of an update (model parallelism does not). These sums predict
neither duration nor quality: they keep comparisons honest."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch

from .data import Item, micro_batches, prepare
from .errors import WorkbookError
from .loop import Stepper, UpdateShape, train
from .records import StepRecord
from .task import IGNORE_INDEX, Task, load_task, task_from_params

HOLD = ("updates", "examples", "epochs")


@dataclass(frozen=True)
class BatchAccount:
    """Updates of `shape` over a data set of `examples` (per pass)."""

    shape: UpdateShape
    examples: int = 0  # examples in one pass over the training data
    drop_partial: bool = False  # leave out the examples that do not fill a whole update

    def __post_init__(self):
        self.shape.validate()
        if self.examples < 0:
            raise WorkbookError(f"examples must be 0 or more, got {self.examples}",
                                "give the size of one pass over the training data")

    @property
    def examples_per_update(self) -> int:
        return self.shape.examples_per_update

    @property
    def full_updates_per_pass(self) -> int:
        return self.examples // self.examples_per_update

    @property
    def leftover(self) -> int:
        """Examples of a pass that do not fill a whole update."""
        return self.examples % self.examples_per_update

    @property
    def updates_per_pass(self) -> int:
        return self.full_updates_per_pass + (1 if self.leftover and not self.drop_partial else 0)

    @property
    def examples_per_pass(self) -> int:
        return self.examples - (self.leftover if self.drop_partial else 0)

    def partial_update(self) -> dict[str, int] | None:
        """The last update of a pass when it is partial: its examples and micro-batches
        (per replica the examples are shared out as evenly as the sampler can)."""
        if not self.leftover or self.drop_partial:
            return None
        micro = self.shape.micro_batch
        per_replica = math.ceil(self.leftover / self.shape.replicas)
        return {"examples": self.leftover,
                "micro_batches_per_replica": math.ceil(per_replica / micro),
                "last_micro_batch": per_replica - (math.ceil(per_replica / micro) - 1) * micro}

    def examples_in(self, updates: int) -> tuple[int, int]:
        """(examples seen, partial updates) in the first `updates` updates, pass after pass."""
        if not self.updates_per_pass:
            raise WorkbookError(f"one update needs {self.examples_per_update} examples but a "
                                f"pass has {self.examples}", "lower micro-batch x accumulation "
                                "x replicas, or keep partial updates")
        passes, rest = divmod(updates, self.updates_per_pass)
        seen = passes * self.examples_per_pass + min(rest * self.examples_per_update,
                                                     self.examples_per_pass)
        partial = passes * (1 if self.partial_update() else 0)
        return seen, partial

    def budget(self, hold: str, value: float, targets_per_example: float = 1.0) -> dict:
        """Hold one quantity fixed (updates, examples or epochs) and derive the others."""
        if hold not in HOLD:
            raise WorkbookError(f"cannot hold {hold!r} fixed", f"hold one of {HOLD}")
        if value <= 0:
            raise WorkbookError(f"the budget must be positive, got {value}", "give a budget")
        if hold == "updates":
            updates = int(value)
        elif hold == "examples":
            updates = math.ceil(value / self.examples_per_update)
        else:
            updates = math.ceil(value * self.updates_per_pass)
        examples, partial = self.examples_in(updates)
        return {"held": hold, "updates": updates, "examples": examples,
                "epochs": round(examples / self.examples_per_pass, 4),
                "targets": round(examples * targets_per_example), "partial_updates": partial,
                "examples_per_update": self.examples_per_update}

    def compare(self, hold: str, value: float, accumulations: Iterable[int],
                targets_per_example: float = 1.0) -> pd.DataFrame:
        """The same budget held fixed for other accumulations: what else changes."""
        rows = [replace(self, shape=replace(self.shape, accumulation=a))
                .budget(hold, value, targets_per_example) for a in accumulations]
        return pd.DataFrame(rows).assign(accumulation=list(accumulations))

    def table(self) -> pd.DataFrame:
        """The calculator as a one-row table."""
        shape = self.shape
        row = {"micro_batch": shape.micro_batch, "accumulation": shape.accumulation,
               "replicas": shape.replicas, "examples": self.examples,
               "drop_partial": self.drop_partial, "examples_per_update": self.examples_per_update,
               "updates_per_pass": self.updates_per_pass,
               "updates_per_pass_without_partial": self.full_updates_per_pass,
               "updates_per_pass_with_partial": self.full_updates_per_pass + bool(self.leftover),
               "leftover_examples": self.leftover}
        return pd.DataFrame([row])


def reconcile(account: BatchAccount, steps: list[StepRecord], items: list[Item],
              task: Task | None = None) -> pd.DataFrame:
    """The loop's counters against the calculator: optimizer steps, examples, partial updates,
    and targets against the targets of the very examples the loop reports consuming."""
    count = task.target_count if task is not None else \
        (lambda labels: int((labels != IGNORE_INDEX).sum()))
    targets_of = {it.id: count(it.tensors["labels"]) for it in items}
    examples, partial = account.examples_in(len(steps))
    consumed = [i for s in steps for i in s.example_ids]
    rows = [
        ("optimizer steps", len(steps), len(steps)),
        ("examples", sum(s.examples for s in steps), examples),
        ("partial updates", sum(s.examples < account.examples_per_update for s in steps),
         partial),
        ("examples per full update", max(s.examples for s in steps),
         min(account.examples_per_update, account.examples)),
        ("targets", sum(s.targets for s in steps), sum(targets_of[i] for i in consumed)),
        ("distinct examples in the first pass", len(set(consumed[:account.examples_per_pass])),
         min(account.examples_per_pass, len(consumed))),
    ]
    frame = pd.DataFrame(rows, columns=["counter", "loop", "expected"])
    frame["match"] = frame.loop == frame.expected
    return frame


def update_gradients(task: Task, model: torch.nn.Module, items: list[Item], micro_batch: int,
                     mean_per_micro_batch: bool = False) -> dict[str, torch.Tensor]:
    """The gradient of one update over `items` split into micro-batches, through the loop's own
    accumulation - or, with `mean_per_micro_batch`, the classic wrong normalisation (a mean per
    micro-batch divided by the number of micro-batches), to show what the check catches."""
    model.zero_grad(set_to_none=True)
    batches = list(micro_batches(task, items, micro_batch))
    if mean_per_micro_batch:
        for batch in batches:
            summed, count = task.loss(task.forward(model, batch.tensors), batch.tensors)
            (summed / count / len(batches)).backward()
    else:
        Stepper(task, model, torch.optim.SGD(model.parameters(), lr=0.0), None,
                torch.device("cpu")).accumulate(batches)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


class GradientRecorder(torch.optim.SGD):
    """The optimizer handed to a task's own `train_step` in the check: `step()` records the
    gradients and changes no parameter (learning rate 0)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model.parameters(), lr=0.0)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.grads: dict[str, torch.Tensor] = {}
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.grads = {self.names[id(p)]: p.grad.detach().clone() for g in self.param_groups
                      for p in g["params"] if p.grad is not None}


def own_step_gradients(task: Task, model: torch.nn.Module, items: list[Item],
                       micro_batch: int) -> dict[str, torch.Tensor]:
    """The gradient one call of the task's `train_step` applies for an update over `items`
    split into micro-batches; it must step the optimizer exactly once."""
    model.zero_grad(set_to_none=True)
    recorder = GradientRecorder(model)
    task.train_step(model, recorder, [b.tensors for b in micro_batches(task, items,
                                                                         micro_batch)])
    if recorder.steps != 1:
        raise WorkbookError(f"the task's train_step called optimizer.step() {recorder.steps} "
                            f"times for one update of {math.ceil(len(items) / micro_batch)} "
                            "micro-batches", "step once per update, after the last micro-batch")
    return recorder.grads


def normalisation_check(task: Task, items: list[Item], splits: Iterable[int] = (16, 2, 1),
                        tolerance: float = 1e-4, seed: int = 0) -> pd.DataFrame:
    """One update over the same examples as 1 x N, k x N/k, ..., N x 1 micro-batches (the first
    split is each way's reference): the loop's normalisation, the classic wrong one, and - when
    the task brings one - its own `train_step`. Dropout and batch-norm are in eval behaviour:
    they legitimately change with the micro-batch."""
    torch.manual_seed(seed)
    model = task.build_model().eval()
    ways = {"targets of the whole update (loop)": partial(update_gradients, task, model),
            "per micro-batch mean (wrong)": partial(update_gradients, task, model,
                                                    mean_per_micro_batch=True)}
    if task.train_step is not None:
        ways["the task's train_step"] = partial(own_step_gradients, task, model)
    rows, reference = [], None
    for way, gradients in ways.items():
        own = way.startswith("the task's")
        if own:
            reference = None  # the task's step may normalise its own way: compared with itself
        for micro in splits:
            grads = gradients(items, micro)
            if reference is None:
                reference = grads
            dev = max(float((grads[n] - reference[n]).abs().max() /
                            reference[n].abs().max().clamp(min=1e-12)) for n in reference)
            accumulation = math.ceil(len(items) / micro)
            rows.append({"normalisation": way,
                         "micro_batch x accumulation": f"{micro} x {accumulation}",
                         "last_micro_batch": len(items) - (accumulation - 1) * micro,
                         "max_relative_deviation": dev, "within_tolerance": dev <= tolerance})
    return pd.DataFrame(rows)


def batch_norm_statistics(task: Task, items: list[Item], shape: UpdateShape) -> pd.DataFrame:
    """Run one update and record, for every batch-norm layer, how many examples each of its
    statistics was computed over: the micro-batch (or a ghost batch), never the effective batch."""
    micro_batch, accumulation = shape.micro_batch, shape.accumulation
    torch.manual_seed(0)
    model = task.build_model().train()
    seen: list[dict] = []

    def record(name):
        def hook(module, inputs):
            x = inputs[0]
            per_stat = x.shape[0] * (x[0, 0].numel() if x.dim() > 2 else 1)
            virtual = getattr(module, "virtual_batch_size", None)
            groups = math.ceil(x.shape[0] / virtual) if virtual else 1
            seen.append({"layer": name, "kind": type(module).__name__,
                         "examples_in_pass": x.shape[0], "statistics_per_pass": groups,
                         "values_per_statistic": per_stat // groups,
                         "effective_batch": micro_batch * accumulation})
        return hook
    handles = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    try:
        if handles:
            stepper = Stepper(task, model, torch.optim.SGD(model.parameters(), lr=0.0), None,
                              torch.device("cpu"))
            stepper.accumulate(list(micro_batches(task, items[: micro_batch * accumulation],
                                                  micro_batch)))
    finally:
        for h in handles:
            h.remove()
    return pd.DataFrame(seen)


def batch_norm_demonstration(task: Task, items: list[Item], shape: UpdateShape
                             ) -> pd.DataFrame:
    """`batch_norm_statistics` of the task; for a model without batch norm, the classification
    sample's plain and ghost batch norm (what the statistics see, shown on a model that has
    them)."""
    seen = batch_norm_statistics(task, items, shape)
    if not seen.empty:
        return seen
    sample = "workbook.samples.classification:task"
    sample_items = prepare(load_task(sample), ("train",), {"train": 64}).train
    demo = {norm: batch_norm_statistics(load_task(sample, batch_norm=norm, virtual_batch=2),
                                        sample_items, UpdateShape(4, 4)).head(1)
            for norm in ("batch", "ghost")}
    return pd.concat(demo, names=["norm"]).reset_index(level=0)


@dataclass
class AccountingResult:
    """Everything notebook 04 shows: the calculator on the task's data, the budget held fixed
    for other accumulations, the loop's counters against it, the normalisation check and the
    batch-norm statistics."""

    task: Task
    examples: int  # training examples in one pass
    targets_per_example: float
    account: BatchAccount
    held: dict  # the budget as given
    budget: pd.DataFrame  # the same budget at half and double the accumulation
    worked: BatchAccount  # the worked example of the text
    reconciled: pd.DataFrame
    check: pd.DataFrame
    batch_norm: pd.DataFrame

    @property
    def demonstrates_batch_norm(self) -> bool:
        """The batch-norm rows are the classification sample's: the task's model has none."""
        return "norm" in self.batch_norm


def run(params: dict[str, Any], out_dir: Path | None = None,
        progress: bool = False) -> AccountingResult:
    """Notebook 04 from its parameters (it writes nothing until `save`)."""
    task = task_from_params(params)
    items = prepare(task, ("train",)).train
    targets_per_example = sum(task.target_count(it.tensors["labels"]) for it in items) / len(items)
    shape = UpdateShape.from_params(params)
    account = BatchAccount(shape, len(items), params["drop_partial"])
    hold, value, accumulation = params["hold"], params["budget"], shape.accumulation
    budget = account.compare(hold, value, (accumulation // 2 or 1, accumulation,
                                           accumulation * 2), targets_per_example)
    loop_account = BatchAccount(replace(shape, replicas=1),
                                min(len(items), params["reconcile_examples"]),
                                params["drop_partial"])
    cfg = loop_account.shape.train_config(updates=params["reconcile_updates"],
                                          drop_partial=params["drop_partial"],
                                          seed=params["seed"], device=params["device"],
                                          progress=progress)
    steps = train(task, items[: loop_account.examples], cfg).steps
    check = pd.concat([
        normalisation_check(task, items[: params["check_examples"]],
                            (params["check_examples"], 2, 1), params["tolerance"]),
        normalisation_check(task, items[: params["partial_examples"]],
                            (params["partial_examples"], 2, 4), params["tolerance"]),
    ], keys=["equal split", "partial group"]).reset_index(level=0, names="case")
    return AccountingResult(task, len(items), targets_per_example, account,
                            account.budget(hold, value, targets_per_example), budget,
                            BatchAccount(UpdateShape(2, 8), 3200),
                            reconcile(loop_account, steps, items, task), check,
                            batch_norm_demonstration(task, items, shape))


def save(result: AccountingResult, out_dir: Path) -> str:
    """Notebook 04's tables and `summary.json`. The verdict fails when the loop's counters
    differ from the calculator's or an update's gradient depends on how it is split (the
    loop's or the task's own train_step); the wrong normalisation is expected to differ."""
    from .runs import save_table, write_summary

    account, budget, reconciled, check = (result.account, result.budget, result.reconciled,
                                          result.check)
    right = check[~check.normalisation.str.contains("wrong")]
    wrong = check[check.normalisation.str.contains("wrong")]
    own = check[check.normalisation == "the task's train_step"]
    loop_ok, norm_ok = bool(reconciled.match.all()), bool(right.within_tolerance.all())
    for table, name in ((account.table(), "account"), (budget, "budget"),
                        (reconciled, "reconciliation"), (check, "normalisation")):
        save_table(table, out_dir, name)
    verdict = "pass" if loop_ok and norm_ok else "fail"
    write_summary(out_dir, verdict, {
        "examples_per_update": account.examples_per_update,
        "updates_per_pass": account.updates_per_pass,
        "worked_example_updates": result.worked.budget("epochs", 1)["updates"],
        "reconciled": loop_ok, "normalisation_ok": norm_ok,
        "wrong_normalisation_caught": bool(not wrong.iloc[1:].within_tolerance.all()),
        "own_train_step_ok": bool(own.within_tolerance.all()) if len(own) else None,
        "max_deviation": float(right.max_relative_deviation.max())}, task=result.task.name)
    return verdict

