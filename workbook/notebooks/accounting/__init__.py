"""Notebook 04: how many examples one update sees and how many updates a budget buys.

A micro-batch is one forward/backward pass; accumulation combines passes into one update; data
replicas multiply the examples of an update (model parallelism does not). These sums predict
neither duration nor quality: they keep comparisons honest."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch

from ...base.errors import WorkbookError
from ...contract.data import Batch, Item, micro_batches, prepare
from ...contract.targets import IGNORE_INDEX
from ...contract.task import Task, load_task
from ...storage.records import StepRecord
from ...training.deviation import relative_deviation
from ...training.loop import Stepper, TrainConfig, UpdateShape, train
from ..parameters import AccountingParams
from ..registry import ACCOUNTING
from .batch_randomness import Draws, collate_draws, step_draws
from .own_code_checks import (
    evaluation_check,
    evaluation_findings,
    one_draw,
    own_step_gradients,
    split_batches,
    step_loss_check,
)

HOLD = ("updates", "examples", "epochs")
OWN_STEP = "the task's train_step"  # the normalisation check's rows of the task's own step


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
    if task is not None and task.target_kind.sampled:  # the forward draws what the loss
        rows = [r for r in rows if r[0] != "targets"]  # counts: no count before it (tokens)
    frame = pd.DataFrame(rows, columns=["counter", "loop", "expected"])
    frame["match"] = frame.loop == frame.expected
    return frame


def update_gradients(task: Task, model: torch.nn.Module, items: list[Item], micro_batch: int,
                     mean_per_micro_batch: bool = False,
                     whole: Batch | None = None) -> dict[str, torch.Tensor]:
    """The gradient of one update over `items` split into micro-batches, through the loop's own
    accumulation - or, with `mean_per_micro_batch`, the classic wrong normalisation (a mean per
    micro-batch divided by the number of micro-batches), to show what the check catches.
    `whole`: the update collated once, whose rows the micro-batches are (`split_batches`)."""
    model.zero_grad(set_to_none=True)
    batches = split_batches(task, items, micro_batch, whole)
    if mean_per_micro_batch:
        for batch in batches:
            summed, count = task.loss(task.forward(model, batch.tensors), batch.tensors)
            (summed / count / len(batches)).backward()
    else:
        Stepper(task, model, torch.optim.SGD(model.parameters(), lr=0.0), None,
                torch.device("cpu")).accumulate(batches)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def normalisation_check(task: Task, items: list[Item], splits: Iterable[int] = (16, 2, 1),
                        tolerance: float = 1e-4, seed: int = 0,
                        per_batch_draw: bool = False) -> pd.DataFrame:
    """One update over the same examples as 1 x N, k x N/k, ..., N x 1 micro-batches (the first
    split is each way's reference): the loop's normalisation, the classic wrong one, and - when
    the task brings one - its own `train_step`. Dropout and batch norm are held in eval
    behaviour (also inside the task's step, which usually calls model.train()): they
    legitimately change with the micro-batch. `per_batch_draw` (a collate drawing per batch:
    mixup, cutmix): the update is collated once and every split's micro-batches are its rows."""
    whole = one_draw(task, items, seed) if per_batch_draw else None
    torch.manual_seed(seed)
    model = task.build_model().eval()
    ways = {"targets of the whole update (loop)": partial(update_gradients, task, model,
                                                          whole=whole),
            "per micro-batch mean (wrong)": partial(update_gradients, task, model,
                                                    mean_per_micro_batch=True, whole=whole)}
    if task.train_step is not None:
        ways[OWN_STEP] = partial(own_step_gradients, task, model, whole=whole)
    rows, reference = [], None
    for way, gradients in ways.items():
        own = way == OWN_STEP
        if own:
            reference = None  # the task's step may normalise its own way: compared with itself
        for micro in splits:
            grads = gradients(items, micro)
            if reference is None:
                reference = grads
            dev = relative_deviation(grads, reference)
            accumulation = math.ceil(len(items) / micro)
            rows.append({"normalisation": way,
                         "micro_batch x accumulation": f"{micro} x {accumulation}",
                         "last_micro_batch": len(items) - (accumulation - 1) * micro,
                         "max_relative_deviation": dev, "within_tolerance": dev <= tolerance})
    return pd.DataFrame(rows)


def batch_draws(task: Task, items: list[Item], seed: int = 0) -> list[Draws]:
    """Where the task's own code draws new random numbers for every batch (its collate, its
    train_step), measured on `items`; for a collate, also how far the loop's exact gradient
    moves when a 2-way split is collated anew (a split of a mixing collate mixes other pairs)."""
    found = [collate_draws(task, items, seed)]
    if task.train_step is not None:
        found.append(step_draws(task, items, seed))
    if found[0].draws and len(items) > 1:
        torch.manual_seed(seed)
        model = task.build_model().eval()
        whole = update_gradients(task, model, items, len(items))
        halves = update_gradients(task, model, items, math.ceil(len(items) / 2))
        found[0] = replace(found[0], split_anew=relative_deviation(halves, whole))
    return [d for d in found if d.draws]


def own_split_cause(task: Task, items: list[Item], check: pd.DataFrame,
                    seed: int = 0) -> str | None:
    """The cause a task's own step gives for its gradient depending on the split (its
    `explain_split(model, micro_batches)`, e.g. from_trainer's reading of compute_loss), when
    the equal split found one; None otherwise."""
    explain = getattr(task.train_step, "explain_split", None)
    own = own_rows(check, "equal split")
    if explain is None or not len(own) or own.within_tolerance.all():
        return None
    torch.manual_seed(seed)
    model = task.build_model().eval()
    return explain(model, [b.tensors for b in micro_batches(task, items, 2)])


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


def reconcile_size(task: Task, shape: UpdateShape, examples: int) -> int:
    """The examples the reconciliation trains on: as given, or one fewer when they would leave
    a micro-batch of one example at the end of a pass and the model has batch norm, which
    cannot train on one (the loop names that for a campaign's own sizes)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    last = examples % shape.examples_per_update % shape.micro_batch
    if last != 1 or examples < 3:
        return examples
    torch.manual_seed(0)
    has_norm = any(isinstance(m, _BatchNorm) for m in task.build_model().modules())
    return examples - 1 if has_norm else examples


def own_rows(check: pd.DataFrame, case: str = "") -> pd.DataFrame:
    """The normalisation check's rows of the task's own train_step (of one `case`: "equal
    split", "partial group")."""
    rows = check[check.normalisation == OWN_STEP]
    return rows[rows.case == case] if case and "case" in rows else rows


def k_times_too_large(rows: pd.DataFrame, tolerance: float = 1e-3) -> str:
    """'2 x 4: 4 times, ...' when every split's gradient is exactly k times the reference for
    its k micro-batches (the deviation on the whole update's scale is then k - 1); '' else."""
    said = []
    for split, dev in zip(rows["micro_batch x accumulation"], rows.max_relative_deviation,
                          strict=True):
        k = int(str(split).split(" x ")[1])
        if k < 2 or abs(dev - (k - 1)) > tolerance * (k - 1):
            return ""
        said.append(f"{split}: {k} times")
    return ", ".join(said)


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
    step_loss: pd.DataFrame | None = None  # the task's train_step loss against its `loss`
    evaluation: pd.DataFrame | None = None  # the task's eval_step as the campaign calls it
    split_cause: str | None = None  # why the task's step depends on the split, in its terms
    draws: list[Draws] = field(default_factory=list)  # own code drawing per batch (mixup, ...)

    @property
    def step_draws(self) -> bool:
        """The task's train_step draws per call: its loss and splits are not comparable."""
        return any(d.where == "train_step" for d in self.draws)

    @property
    def findings(self) -> list[str]:
        """What is wrong with the task's own step and evaluation, in words."""
        found = []
        if self.step_draws:  # the data differed: said in `warnings`, never blamed on the loss
            return evaluation_findings(self.evaluation)
        other_loss = self.step_loss is not None and not self.step_loss.agree.all()
        row = self.step_loss.iloc[0] if other_loss else None
        if other_loss and pd.notna(row.get("divided_by")):
            k = int(row.divided_by)
            found.append(f"your train_step's loss and the gradient it steps with are both 1/{k} "
                         f"of the task's on the same batch ({row.train_step_loss:.6g} against "
                         f"{row.task_loss:.6g}; gradient norms {row.gradient_ratio:.4g} x): it "
                         f"divides the loss by {k} before back-propagating it - " +
                         (row.cause or "drop that division where the loop already averages "
                          "over the update's micro-batches (the campaign's gradient is 1/"
                          f"{k} of the objective's: its learning rate in effect {k} times "
                          "smaller)"))
        elif other_loss:
            found.append(f"your train_step computes another loss than `loss` on the same batch "
                         f"({row.train_step_loss:.6g} against {row.task_loss:.6g}, relative "
                         f"difference {row.relative_difference:.3g}) - e.g. it drops the "
                         "attention mask, adds a term or reads other inputs: make both compute "
                         "the objective the campaign trains")
        own = own_rows(self.check, "equal split")
        off = own[~own.within_tolerance]
        if len(off):
            worst = off.iloc[int(off.max_relative_deviation.to_numpy().argmax())]
            times = k_times_too_large(off)
            cause = (self.split_cause if self.split_cause else
                     "its loss is not the task's either (above), which can be the cause: a "
                     "mask it drops sees other padding in every split" if other_loss else
                     f"the loss is not divided by the number of micro-batches: each split's "
                     f"gradient is exactly that many times the whole update's ({times}), as "
                     "when each micro-batch's mean is back-propagated as is - divide each "
                     "by the number of micro-batches, or sum the losses and divide once by "
                     "the update's targets" if times else
                     "it normalises per micro-batch (e.g. back-propagates each micro-batch's "
                     "mean): sum the losses and divide once by the update's targets")
            who = getattr(getattr(self.task, "train_step", None), "described",
                          "your train_step's gradient")
            found.append(f"{who} depends on how the update is split: "
                         f"micro-batch x accumulation {worst['micro_batch x accumulation']} "
                         f"differs from the whole update in one micro-batch by "
                         f"{worst.max_relative_deviation:.3g} (relative) with dropout and "
                         f"batch norm held fixed - {cause}")
        return found + evaluation_findings(self.evaluation)

    @property
    def partial_only(self) -> pd.DataFrame | None:
        """The task's step's rows off on the partial group when it is exact on equal
        micro-batches (None otherwise, and for a step that draws per call)."""
        partial, equal = own_rows(self.check, "partial group"), own_rows(self.check, "equal split")
        off = partial[~partial.within_tolerance]
        if not len(off) or not equal.within_tolerance.all() or self.step_draws:
            return None
        return off

    @property
    def warnings(self) -> list[str]:
        """Material but not failing: a step exact on equal micro-batches that weighs a final
        partial one as a full one (Lightning's mean divided by accumulate_grad_batches) - only
        the last update of a pass that leaves one over is off."""
        drawn = [d.words() for d in self.draws]  # the campaign's own randomness, named
        off = self.partial_only
        if off is None:
            return drawn
        worst = off.iloc[int(off.max_relative_deviation.to_numpy().argmax())]
        return drawn + [f"your train_step weighs a final partial micro-batch as a full one: split "
                f"{worst['micro_batch x accumulation']} (last micro-batch "
                f"{worst.last_micro_batch}) differs from one micro-batch by "
                f"{worst.max_relative_deviation:.3g} (relative) - only an update that ends a "
                "pass with a partial micro-batch is affected: drop it (DataLoader "
                "drop_last=True, drop_partial=True) or sum the losses and divide once by the "
                "update's targets"]

    @property
    def demonstrates_batch_norm(self) -> bool:
        """The batch-norm rows are the classification sample's: the task's model has none."""
        return "norm" in self.batch_norm


def run(params: AccountingParams | Mapping[str, Any], out_dir: Path | None = None,
        progress: bool = False) -> AccountingResult:
    """Notebook 04 from its parameters (it writes nothing until `save`)."""
    params = ACCOUNTING.check(params)
    task = params.load_task()
    items = prepare(task, ("train",)).train
    draws = batch_draws(task, items[: params.check_examples], params.seed)
    per_batch_draw = any(d.where == "collate" for d in draws)
    targets_per_example = sum(task.target_count(it.tensors["labels"]) for it in items) / len(items)
    shape = params.shape()
    account = BatchAccount(shape, len(items), params.drop_partial)
    hold, value, accumulation = params.hold, params.budget, shape.accumulation
    budget = account.compare(hold, value, (accumulation // 2 or 1, accumulation,
                                           accumulation * 2), targets_per_example)
    loop_account = BatchAccount(replace(shape, replicas=1),
                                reconcile_size(task, shape, min(len(items),
                                                                params.reconcile_examples)),
                                params.drop_partial)
    cfg = TrainConfig(loop_account.shape, updates=params.reconcile_updates,
                      drop_partial=params.drop_partial, seed=params.seed,
                      device=params.device, progress=progress)
    steps = train(task, items[: loop_account.examples], cfg).steps
    check = pd.concat([
        normalisation_check(task, items[: params.check_examples],
                            (params.check_examples, 2, 1), params.tolerance,
                            per_batch_draw=per_batch_draw),
        normalisation_check(task, items[: params.partial_examples],
                            (params.partial_examples, 2, 4), params.tolerance,
                            per_batch_draw=per_batch_draw),
    ], keys=["equal split", "partial group"]).reset_index(level=0, names="case")
    step_loss = (step_loss_check(task, items[: params.check_examples], params.tolerance)
                 if task.train_step is not None else None)
    evaluation = None
    split_cause = own_split_cause(task, items[: params.check_examples], check)
    if task.eval_step is not None:
        val = prepare(task, ("validation",)).validation or items
        evaluation = evaluation_check(
            task, val[: params.check_examples],
            sets_train_mode=bool(step_loss is not None and
                                 step_loss.train_step_sets_train_mode.all()))
    return AccountingResult(task, len(items), targets_per_example, account,
                            account.budget(hold, value, targets_per_example), budget,
                            BatchAccount(UpdateShape(2, 8), 3200),
                            reconcile(loop_account, steps, items, task), check,
                            batch_norm_demonstration(task, items, shape), step_loss, evaluation,
                            split_cause, draws)


def save(result: AccountingResult, out_dir: Path) -> str:
    """Notebook 04's tables and `summary.json`. The verdict fails when the loop's counters
    differ from the calculator's or an update's gradient depends on how it is split (the
    loop's or the task's own train_step); the wrong normalisation is expected to differ."""
    from ...storage.runs import save_table, write_summary

    account, budget, reconciled, check = (result.account, result.budget, result.reconciled,
                                          result.check)
    right = check[~check.normalisation.str.contains("wrong")]
    if result.step_draws:  # a step drawing per call is not comparable across splits
        right = right[right.normalisation != OWN_STEP]
    elif result.partial_only is not None:  # off on the partial group only: warned, not failed
        right = right[~((right.normalisation == OWN_STEP) & (right.case == "partial group"))]
    wrong = check[check.normalisation.str.contains("wrong")]
    own = own_rows(check)
    loop_ok, norm_ok = bool(reconciled.match.all()), bool(right.within_tolerance.all())
    findings = result.findings
    for table, name in ((account.table(), "account"), (budget, "budget"),
                        (reconciled, "reconciliation"), (check, "normalisation"),
                        (result.step_loss, "step_loss"), (result.evaluation, "evaluation")):
        if table is not None:
            save_table(table, out_dir, name)
    verdict = "pass" if loop_ok and norm_ok and not findings else "fail"
    write_summary(out_dir, verdict, {
        "examples_per_update": account.examples_per_update,
        "updates_per_pass": account.updates_per_pass,
        "worked_example_updates": result.worked.budget("epochs", 1)["updates"],
        "reconciled": loop_ok, "normalisation_ok": norm_ok,
        "wrong_normalisation_caught": bool(not wrong.iloc[1:].within_tolerance.all()),
        "own_train_step_ok": bool(own_rows(result.check, "equal split").within_tolerance.all())
        if len(own) and not result.step_draws else None,
        "max_deviation": float(right.max_relative_deviation.max()),
        "own_step_loss_agrees": None if result.step_loss is None or result.step_draws else
        bool(result.step_loss.agree.all()),
        "own_eval_ok": None if result.evaluation is None else bool(result.evaluation.ok.all()),
        "findings": findings, "warned": result.warnings}, task=result.task.name)
    return verdict

