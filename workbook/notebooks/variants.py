"""Notebook 05: memory levers as recorded variants of a control - micro-batch, max length,
activation checkpointing, mixed precision - each measured, and flagged when it changes the
experiment rather than only its cost."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from ..base.errors import WorkbookError
from ..contract.data import Item, encode_examples, prepare
from ..contract.task import Task, load_task
from ..training import campaign
from ..training.devices import check_precision, resolve_device
from ..training.evaluation import evaluate
from ..training.loop import TrainConfig, UpdateShape, apply_activation_checkpointing, train
from ..training.predict import Plan, longest_accepted, predicted_or_reason, sized_batches
from ..training.workload import TRAINING_PHASES, measured_peaks
from .parameters import VariantsParams
from .registry import VARIANTS

NON_FINITE = "non-finite loss or gradient"


@dataclass(frozen=True)
class Variant:
    """One configuration to compare with the control: its update shape and, for truncation,
    the task's `max_length` option (None keeps the control's)."""

    id: str
    shape: UpdateShape
    max_length: int | None = None

    @property
    def effective_batch(self) -> int:
        return self.shape.examples_per_update

    def but(self, id: str, max_length: int | None = None, **shape: Any) -> "Variant":
        """A copy named `id` with some fields of the shape (or the max length) changed."""
        return Variant(id, replace(self.shape, **shape), max_length or self.max_length)


def default_variants(control: Variant, short_length: int) -> list[Variant]:
    """The control, each lever alone, and two combinations. Halving the micro-batch doubles
    accumulation, so the effective batch stays."""
    half = max(control.shape.micro_batch // 2, 1)
    small = control.but("micro-batch/2", micro_batch=half,
                        accumulation=control.effective_batch // half)
    return [
        control, small,
        control.but(f"max_length={short_length}", max_length=short_length),
        control.but("checkpointing", activation_checkpointing=True),
        control.but("bf16", precision="bf16"),
        control.but("fp16+scaler", precision="fp16"),
        small.but("micro-batch/2+checkpointing", activation_checkpointing=True),
        control.but("bf16+checkpointing", precision="bf16", activation_checkpointing=True),
    ]


def _targets(task: Task, items: list[Item]) -> dict:
    return {it.id: task.target_count(it.tensors["labels"]) for it in items}


def training_flags(steps: list, precision: str) -> list[str]:
    """A variant's training judged: a non-finite loss or gradient breaks it, except the fp16
    updates the GradScaler skipped while the loss stays finite - it skips exactly those whose
    scaled gradients overflowed and halves its scale (from 65536), by design at the start, so
    a short run may apply none (05 --smoke on an H200: 3 of 3 skipped)."""
    broken = [s.step for s in steps if not (math.isfinite(s.loss) and
                                            math.isfinite(s.grad_norm))]
    applied = sum(math.isfinite(s.grad_norm) for s in steps)
    if not broken:
        return []
    if precision == "fp16" and all(math.isfinite(s.loss) for s in steps):
        said = f"{applied} of {len(steps)} updates applied" if applied else \
            f"none of the {len(steps)} updates applied: not judged - give 05 more updates"
        return [f"GradScaler skipped updates {broken[:5]} (fp16 gradients overflowed at its "
                f"scale, which it then halved): {said}"]
    return [f"{NON_FINITE} at updates {broken[:5]}"]


@dataclass
class VariantStudy:
    """Everything shared by the variants: the task path, the data, the measurement sizes."""

    task_path: str
    task_options: dict
    updates: int = 20  # updates timed and trained for the quality proxy
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    eval_batch: int = 16
    length: int = 0  # positions of the measured batches (0: the data's longest)
    train_limit: int = 0
    val_limit: int = 64
    plan: Plan | None = None  # the rental size to predict each variant at

    def __post_init__(self):
        self.control_task = load_task(self.task_path, **self.task_options)
        if self.plan is not None and self.plan.length is None:  # the model's longest
            self.plan = replace(self.plan, length=longest_accepted(self.control_task))
        control = prepare(self.control_task, limits={"train": self.train_limit,
                                                     "validation": self.val_limit})
        self.splits, self.control_val, control_train = control.raw, control.validation, \
            control.train
        self.control_targets = _targets(self.control_task, control_train)
        self.control_lengths = {it.id: self.control_task.length(it.tensors)
                                for it in control_train}

    def task_for(self, variant: Variant) -> Task:
        if variant.max_length is None:
            return self.control_task
        return load_task(self.task_path, **{**self.task_options,
                                            "max_length": variant.max_length})

    def measure(self, variant: Variant, control: Variant) -> dict:
        """One recorded row: memory per phase, time per update, quality proxy and flags."""
        shape = variant.shape
        row = {"id": variant.id, "micro_batch": shape.micro_batch,
               "accumulation": shape.accumulation, "max_length": variant.max_length,
               "activation_checkpointing": shape.activation_checkpointing,
               "precision": shape.precision, "effective_batch": variant.effective_batch,
               "status": "measured", "reason": "", "flags": []}
        try:
            task = self.task_for(variant)
            check_precision(shape.precision, resolve_device(self.device), task)
            if shape.activation_checkpointing:  # does the model have blocks to wrap?
                apply_activation_checkpointing(task, task.build_model())
        except WorkbookError as exc:  # recorded, never a silent fallback
            return {**row, "status": "not applicable", "reason": exc.problem}
        train_items = encode_examples(task, self.splits["train"])
        targets = _targets(task, train_items)
        shortened = sum(task.length(it.tensors) < self.control_lengths[it.id]
                        for it in train_items)
        lost = {i: self.control_targets[i] - n for i, n in targets.items()
                if n < self.control_targets[i]}
        if lost and all(n == 0 for n in targets.values()):  # its row kept, the others run
            return {**row, "status": "not applicable", "reason": (
                f"max_length {variant.max_length} leaves no target in any example (shorter "
                "than every prompt): give short_length above the longest prompt")}
        flags = row["flags"]
        if lost:
            flags.append(f"changes the experiment: truncation removes {sum(lost.values())} "
                         f"targets from {len(lost)} examples "
                         f"({sum(n == 0 for n in targets.values())} left with none)")
        elif shortened:
            flags.append(f"truncation shortens the input of {shortened} examples (their "
                         "labels stay: check that the evidence does too)")
        if variant.effective_batch != control.effective_batch:
            flags.append(f"effective batch changed: {variant.effective_batch} instead of "
                         f"{control.effective_batch}")
        if shape.accumulation > control.shape.accumulation:
            flags.append("accumulation does not free weights or optimizer state: only the "
                         "activations of a smaller micro-batch")
        # memory: the core's phase measurement at the variant's shape (two micro-batches of
        # accumulation show what a later one adds)
        val_items = encode_examples(task, self.splits["validation"])
        measured = replace(shape, accumulation=min(shape.accumulation, 2))
        sized = Plan(measured, min(self.length, variant.max_length or self.length) or None,
                     self.eval_batch)
        peaks = measured_peaks(task, TrainConfig(measured, lr=self.lr, seed=self.seed,
                                                 device=self.device),
                               *sized_batches(task, train_items, val_items, sized))
        for phase in TRAINING_PHASES:
            row[f"peak_{phase}"] = peaks[phase]
        row["peak_bytes"] = max(peaks.values())
        cfg = TrainConfig(shape, updates=self.updates, lr=self.lr, seed=self.seed,
                          device=self.device)
        result = train(task, train_items, cfg)
        flags += training_flags(result.steps, shape.precision)
        times = [s.time_s for s in result.steps[1:]] or [result.steps[0].time_s]
        row["time_per_update_s"] = statistics.median(times)
        # quality on the CONTROL's validation examples, so truncation cannot flatter itself
        row["val_loss"] = evaluate(task, result.model, self.control_val, self.eval_batch,
                                   resolve_device(self.device)).loss
        row["examples_seen"] = sum(s.examples for s in result.steps)
        if self.plan is not None:
            scale = shape.micro_batch / control.shape.micro_batch
            length = self.plan.length
            if variant.max_length and length:
                length = min(length, variant.max_length)
            planned = replace(shape, micro_batch=max(1, round(self.plan.shape.micro_batch *
                                                              scale)),
                              accumulation=self.plan.shape.accumulation)
            plan = replace(self.plan, shape=planned, length=length)
            predicted = predicted_or_reason(task, train_items, val_items, plan, lr=self.lr,
                                            device=self.device, campaign=True)
            row["plan"] = plan.label()
            row["plan_model"] = campaign.which(task)
            row["plan_peak_bytes"] = predicted.predicted_peak_bytes.max()
            row["flags"] += [f"plan {r.phase}: {r.note}" for r in predicted.itertuples()
                             if r.note]
        return row

    def run(self, variants: list[Variant]) -> pd.DataFrame:
        """Measure every variant; ratios are relative to the first (the control)."""
        control = variants[0]
        rows = [self.measure(v, control) for v in variants]
        table = pd.DataFrame(rows)
        base = table.iloc[0]
        for col, ref in (("memory_ratio", "peak_bytes"), ("time_ratio", "time_per_update_s")):
            table[col] = (table[ref] / base[ref]).round(3)
        table["val_loss_delta"] = (table.val_loss - base.val_loss).round(6)
        table["flags"] = table["flags"].map(lambda f: "; ".join(f))
        return table


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """Variants for people, in numbers: MiB, ratios, the plan's peak. Their words are
    `words_table`'s: beside a dozen numbers they made this table wider than a 1280 px page."""
    cols = ["id", "micro_batch", "accumulation", "effective_batch", "max_length", "precision",
            "activation_checkpointing", "status", "memory_ratio", "time_ratio",
            "val_loss_delta"]
    out = table[[c for c in cols if c in table]].copy()
    out.insert(8, "peak_mib", (table.peak_bytes / 2**20).round(2))
    if "plan_peak_bytes" in table:
        out["plan_peak_mib"] = (table.plan_peak_bytes / 2**20).round(1)
    return out


def words_table(table: pd.DataFrame) -> pd.DataFrame:
    """What each variant is and what it changed, in words: the model its plan's peak is of
    (measured on the pilot's model, planned on this one), its flags, why not applicable."""
    cols = ["id", "effective_batch", "status", "plan_model", "flags", "reason"]
    return table[[c for c in cols if c in table]]


@dataclass
class VariantsResult:
    """Notebook 05: the variants of the control and their measured table."""

    task: Task  # the control's
    variants: list[Variant]
    table: pd.DataFrame


def run(params: VariantsParams | Mapping[str, Any], out_dir: Path | None = None) -> VariantsResult:
    """Notebook 05 from its parameters: the control, each lever alone and two combinations,
    measured (it writes nothing until `save`)."""
    params = VARIANTS.check(params)
    study = VariantStudy(params.task, params.task_options, params.updates,
                         params.lr, params.seed, params.device, params.eval_batch,
                         params.length, params.train_limit, params.val_limit,
                         Plan(params.shape("plan_"), params.plan_length or None,
                              params.plan_eval_batch))
    variants = default_variants(Variant("control", params.shape()),
                                params.short_length)
    return VariantsResult(study.control_task, variants, study.run(variants))


def save(result: VariantsResult, out_dir: Path) -> str:
    """Variant rows and `summary.json`: the verdict fails only when a measured variant trained
    to a non-finite loss or gradient (a variant that changes the experiment is flagged, not
    failed)."""
    from ..storage.runs import save_table, write_summary

    table = result.table
    save_table(table, out_dir, "variants")
    measured = table[table.status == "measured"]
    failed = measured[measured["flags"].str.contains(NON_FINITE)]
    ckpt = measured[measured.id == "checkpointing"]
    figures = {"variants": len(table), "measured": len(measured),
               "not_applicable": table.id[table.status != "measured"].tolist(),
               "changes_experiment": measured.id[measured["flags"].str.contains(
                   "changes the experiment")].tolist(),
               "checkpointing_memory_ratio": float(ckpt.memory_ratio.iloc[0]) if len(ckpt)
               else None,
               "checkpointing_time_ratio": float(ckpt.time_ratio.iloc[0]) if len(ckpt)
               else None}
    verdict = "fail" if len(failed) else "pass"
    write_summary(out_dir, verdict, figures, task=result.task.name)
    return verdict
