"""Notebook 02: overfit a tiny subset. It proves the mechanics, never generalisation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from .data import Item, collate_items, encode_examples, prepare
from .errors import WorkbookError
from .loop import (
    UpdateShape,
    eval_mode,
    evaluate,
    resolve_device,
    seed_everything,
    train,
    update_by,
)
from .records import to_frame
from .task import Task, contributes, task_from_params


@dataclass
class OverfitResult:
    """The loss curve, the verdict checks, and what the trained model gives back per example."""

    task: Task
    steps: pd.DataFrame
    checks: pd.DataFrame
    reproduction: pd.DataFrame
    figures: dict

    @property
    def verdict(self) -> str:
        return "pass" if bool(self.checks.passed.all()) else "fail"


def exact_targets(task: Task, model: torch.nn.Module, items: list[Item],
                  device: torch.device) -> list[bool]:
    """Per example: does the argmax reproduce every contributing target id? With teacher
    forcing this is the same as greedy decoding reproducing the whole target sequence."""
    batch = collate_items(task, items).to(device).tensors
    labels = task.targets(batch["labels"])
    with eval_mode(model):
        predicted = task.predicted(task.forward(model, batch), labels)
    keep = contributes(labels)
    if task.kind == "regression":  # within 5% of the targets' spread (or 1e-3)
        tolerance = max(float(labels[keep].float().std()) * 0.05 if keep.sum() > 1 else 0, 1e-3)
        wrong = ((predicted - labels).abs() > tolerance) & keep
    else:
        wrong = (predicted != labels) & keep
    return [not bool(w.any()) for w in wrong.reshape(len(items), -1)]


def overfit(task: Task, examples: int = 8, updates: int = 150, lr: float = 3e-3,
            loss_threshold: float = 0.05, init_tolerance: float = 0.5, seed: int = 0,
            device: str = "cpu", progress: bool = False) -> OverfitResult:
    """Train on the first `examples` training examples until memorised and check the mechanics:
    initial loss near ln(outputs), finite at every step, below the threshold, exact ids back."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise WorkbookError(f"examples must be a positive integer, got {examples!r}",
                            "set examples to the size of the subset to memorise (8 is usual)")
    train_split = prepare(task, encode=()).raw["train"]
    raw = train_split[:examples]
    items = encode_examples(task, raw)
    cfg = UpdateShape(len(items)).train_config(updates=updates, lr=lr, seed=seed, device=device,
                                               grad_clip=1.0, progress=progress)
    cfg.validate(len(train_split))
    dev = resolve_device(device)
    seed_everything(seed)
    model = task.build_model().to(dev)
    initial = evaluate(task, model, items, len(items), dev)
    with eval_mode(model):
        outputs = int(task.forward(model, collate_items(task, items[:1]).to(dev)
                                   .tensors).shape[-1])
    labels = collate_items(task, items).tensors["labels"]
    expected = task.expected_initial_loss(outputs, labels)
    # the bar for "memorised": absolute for ids, relative to predicting the mean for regression
    scale = float(labels[contributes(labels)].float().var()) if task.kind == "regression" else 1.0
    result = train(task, items, cfg, model=model)
    final = evaluate(task, result.model, items, len(items), dev, updates)
    steps = to_frame(result.steps).drop(columns=["example_ids"])
    exact = exact_targets(task, result.model, items, dev)
    rows = []
    for ex, it, ok in zip(raw, items, exact, strict=True):
        row = {"example": it.id, "exact_ids": ok}
        if task.kind == "generation" and task.generate is not None:
            row["target"] = ex[task.response_field]
            row["greedy"] = task.generate(result.model, ex)
            row["greedy_exact"] = row["greedy"] == row["target"]
        elif task.kind == "regression":
            batch = collate_items(task, [it]).to(dev).tensors
            with eval_mode(result.model):
                row["predicted"] = task.decode(task.forward(result.model, batch)
                                               .reshape(-1).tolist())
            row["target"] = task.decode(it.tensors["labels"].reshape(-1).tolist())
        elif task.kind == "classification":
            row["target"] = str(ex[task.label_field])
            batch = collate_items(task, [it]).to(dev).tensors
            with eval_mode(result.model):
                row["predicted"] = task.decode([int(task.forward(result.model, batch)
                                                    .argmax(-1)[0])])
        rows.append(row)
    reproduction = pd.DataFrame(rows)
    finite = bool(steps.loss.map(math.isfinite).all() and steps.grad_norm.map(math.isfinite).all())
    init_gap = abs(initial.loss - expected) / max(expected, 1e-12)
    checks = pd.DataFrame([
        {"check": "initial loss near " + ("mean(target^2)" if task.kind == "regression"
                                           else "ln(outputs)"),
         "value": round(initial.loss, 4),
         "expected": f"{expected:.4f} +/- {init_tolerance:.0%}",
         "passed": init_gap <= init_tolerance},
        {"check": "loss finite at every step", "value": finite, "expected": True,
         "passed": finite},
        {"check": "final loss below threshold" + (
            " x the loss of predicting the mean" if task.kind == "regression" else ""),
         "value": round(final.loss, 4), "expected": f"< {loss_threshold * scale:.4g}",
         "passed": final.loss < loss_threshold * scale},
        {"check": "targets reproduced within 5% of their spread" if task.kind == "regression"
         else "exact target ids reproduced", "value": f"{sum(exact)}/{len(exact)}",
         "expected": f"{len(exact)}/{len(exact)}", "passed": all(exact)},
    ])
    if "greedy_exact" in reproduction:
        greedy = int(reproduction.greedy_exact.sum())
        checks.loc[len(checks)] = {"check": "greedy decoding gives the responses back",
                                   "value": f"{greedy}/{len(items)}",
                                   "expected": f"{len(items)}/{len(items)}",
                                   "passed": greedy == len(items)}
    figures = {"examples": len(items), "updates": updates, "lr": lr,
               "update_by": update_by(task, cfg),
               "initial_loss": round(initial.loss, 4), "expected_initial_loss": round(expected, 4),
               "final_loss": round(final.loss, 4), "exact_examples": sum(exact),
               "finite": finite, "loss_threshold": loss_threshold,
               "final_loss_bar": round(loss_threshold * scale, 6),
               "initial_loss_rule": "mean(target^2)" if task.kind == "regression"
               else "ln(outputs)"}
    return OverfitResult(task, steps, checks, reproduction, figures)


def run(params: dict[str, Any], out_dir: Path | None = None,
        progress: bool = False) -> OverfitResult:
    """Notebook 02 from its parameters (it writes nothing until `save`)."""
    return overfit(task_from_params(params), examples=params["examples"],
                   updates=params["updates"], lr=params["lr"],
                   loss_threshold=params["loss_threshold"],
                   init_tolerance=params["init_tolerance"], seed=params["seed"],
                   device=params["device"], progress=progress)


def save(result: OverfitResult, out_dir: Path) -> str:
    """Write the curve, checks, reproduction table and `summary.json` of notebook 02; the
    verdict."""
    from .runs import save_table, write_summary

    save_table(result.steps, out_dir, "steps")
    save_table(result.checks, out_dir, "checks")
    save_table(result.reproduction, out_dir, "reproduction")
    write_summary(out_dir, result.verdict, result.figures, task=result.task.name,
                  failed=result.checks.loc[~result.checks.passed, "check"].tolist())
    return result.verdict
