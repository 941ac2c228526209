"""Notebook 06's design: everything fixed before the first trial (`StudyDesign`), taken from
the notebook's parameters, written to design.json and read back checked."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated

import torch
from pydantic import Field

from ...contract.data import Item
from ...contract.task import Task
from ...storage import schemas
from ...storage.artifacts import read_json, verify_file
from ...storage.schemas import (
    Count,
    Index,
    Multiple,
    Name,
    Options,
    Positive,
    Seed,
    StrictStr,
)
from ...training.evaluation import evaluate
from ...training.loop import UpdateShape
from ..parameters import StudyParams

DESIGN = "design.json"
FIX = "fix the study parameters before the first trial"


@dataclass
class StudyDesign:
    """Everything fixed before the first trial: the trials, the budget, evaluation, stopping."""

    name: Name
    task: Name
    task_options: Options = field(default_factory=dict)
    # control first; empty: a range test chooses them (written here before the first trial)
    lrs: list[Positive] = field(default_factory=lambda: [1e-4, 5e-5, 2e-4])
    seeds: Annotated[list[Seed], Field(min_length=1)] = field(default_factory=lambda: [0])
    updates: Count = 200
    shape: UpdateShape = UpdateShape(micro_batch=2, accumulation=8)
    eval_every: Count = 50  # updates, never seconds
    eval_batch: Count = 32  # at least the micro-batch
    eval_sample: Index = 0  # validation examples evaluated periodically (0: all)
    metric: Name = "loss"  # "loss" or a metric of the task, e.g. "accuracy"
    top_n: Count = 2  # best checkpoints kept per trial, plus the last
    divergence_multiple: Multiple = 3.0  # stop when the median loss of the last 5 updates
    # exceeds this x the median of the first 5 (loop.loss_rise)
    prediction_examples: Index = 4  # validation examples whose predictions are kept
    extra_trials: Index = 0  # trials the study may add past the grid's edge (`support`)
    device: StrictStr = "cpu"
    notes: StrictStr = ""

    @property
    def mode(self) -> str:
        """"min" for the loss and error-like metrics (mae, rmse, perplexity...), else "max"."""
        lower = ("loss", "error", "mae", "mse", "perplexity")
        return "min" if any(w in self.metric.lower() for w in lower) else "max"

    def validate(self, task: Task, val: list[Item]) -> "StudyDesign":
        """The design, its fields checked by their types, then its budget, evaluation batch
        and metric against each other and the task (a WorkbookError naming each problem)."""
        return schemas.checked(self, "study design", FIX, lambda: [
            (problem, FIX) for problem in self._conflicts(task, val)])

    def _conflicts(self, task: Task, val: list[Item]) -> list[str]:
        found = []
        if self.eval_every > self.updates:
            found.append(f"eval_every {self.eval_every} must be between 1 and the budget of "
                         f"{self.updates} updates")
        if self.eval_batch < self.shape.micro_batch:
            found.append(f"eval_batch {self.eval_batch} is below the micro-batch "
                         f"{self.shape.micro_batch} (evaluation keeps no activations: it can "
                         "be larger)")
        if self.metric != "loss":
            produced = evaluate(task, task.build_model(), val[:2], 2, torch.device("cpu"))
            if self.metric not in produced.metrics:
                found.append(f"metric {self.metric!r} is not produced by the task (it gives "
                             f"{['loss', *produced.metrics]})")
        return found

    def trials(self) -> list[dict]:
        """The planned trials: every (lr, seed) of the grid."""
        return [{"lr": lr, "seed": seed} for lr in self.lrs for seed in self.seeds]

    def better(self, a: float, b: float | None) -> bool:
        return b is None or (a < b if self.mode == "min" else a > b)


def read_design(path: Path) -> StudyDesign:
    """design.json back as a StudyDesign, or a clear error for a damaged or edited file: it is
    verified against its manifest, parsed bounded and checked against its schema
    (every field present and of its type, learning rates positive and finite, seeds in NumPy's
    range, a divergence multiple above 1, counts of 1 or more; the schema derived from
    StudyDesign's fields, every one required) before any value is used."""
    verify_file(path, "study design")
    data = UpdateShape.nested(read_json(path, "study design"))
    if isinstance(data, dict):
        data.setdefault("extra_trials", 0)  # a design written before studies extended
    fix = "use an intact study folder, or start a new study (a new out_dir)"
    schemas.check(schemas.derived(StudyDesign, every_field=True), data, path, "study design",
                  fix)
    return schemas.build(StudyDesign, data)


def design_from_params(params: StudyParams) -> StudyDesign:
    """A study design from notebook 06's parameters: every one the design declares."""
    p = params
    return StudyDesign(**{f.name: getattr(p, f.name) for f in fields(StudyDesign)
                          if f.name in p.names() and f.name not in ("lrs", "seeds", "shape")},
                       lrs=list(p.lrs), seeds=list(p.seeds), shape=p.shape(),
                       name=p.study_name)
