"""Notebook 04's checks of a task's own code on tasks written the way users write theirs
(dropout and batch norm, a train_step that calls model.train(), an eval_step of their own):
the clean step's deviation between 1 x N, 2 x N/2 and N x 1 against the planted per-micro-batch
mean, and each planted evaluation bug named or not.

    python benchmarks/own_code_checks.py

Last line: `own_step_separation: clean max <d>, planted min <d>` (a clean step must stay at
float noise, a planted one far above the 1e-4 tolerance)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbook import WorkbookError
from workbook.contract.data import prepare  # noqa: E402
from workbook.contract.task import load_task  # noqa: E402
from workbook.notebooks import accounting as acc  # noqa: E402
from workbook.notebooks.accounting import own_code_checks as checks  # noqa: E402
from workbook.training import loop  # noqa: E402

# (task path, the option planting the per-micro-batch mean, the planted evaluation options)
TASKS = [("tests.careful_task:task", "mean_per_micro_batch",
          ("eval_counts_padding", "eval_without_eval_mode")),
         ("examples.cnn_batchnorm:task", "step_mean_per_micro_batch",
          ("eval_counts_padding",)),
         ("examples.encoder_lm:task", "step_mean_per_micro_batch", ("eval_counts_padding",)),
         ("examples.mlp_dropout:task", "step_mean_per_micro_batch", ("eval_counts_padding",))]


class NotHeld:
    """What the check did before: the task's step sets the mode it wants (for comparison)."""

    sets_train_mode = True

    def __init__(self, model):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def own_deviation(path: str, held: bool = True, **options) -> float:
    """The largest deviation of the task's own step over the splits 8, 2, 1 (and 5: 2, 4);
    `held=False` lets the step's model.train() switch dropout and batch statistics on."""
    checks.HeldBehaviour = loop.HeldBehaviour if held else NotHeld  # run_own_step holds it
    task = load_task(path, **options)
    items = prepare(task, ("train",)).train
    check = acc.normalisation_check(task, items[:8], (8, 2, 1))
    partial = acc.normalisation_check(task, items[:5], (5, 2, 4))
    own = [c[c.normalisation == "the task's train_step"] for c in (check, partial)]
    return max(float(o.max_relative_deviation.max()) for o in own)


def evaluation_named(path: str, **options) -> bool:
    task = load_task(path, **options)
    val = prepare(task, ("validation",)).validation
    return bool(acc.evaluation_findings(acc.evaluation_check(task, val[:10])))


def main() -> None:
    clean, planted = [], []
    print(f"{'task':34} {'not held':>9} {'clean step':>11} {'planted mean':>13}  "
          "evaluation bugs named")
    for path, mean_option, eval_options in TASKS:
        try:
            importlib.import_module(path.split(":")[0])
        except ModuleNotFoundError:
            print(f"{path:34} (not present)")
            continue
        try:
            loose = f"{own_deviation(path, held=False):9.2f}"
        except WorkbookError:  # batch norm in training on a micro-batch of one example
            loose = f"{'crashed':>9}"
        clean.append(own_deviation(path))
        planted.append(own_deviation(path, **{mean_option: True}))
        named = {o: evaluation_named(path, **{o: True}) for o in eval_options}
        named["clean passes"] = not evaluation_named(path)
        print(f"{path:34} {loose} {clean[-1]:11.1e} {planted[-1]:13.2f}  "
              + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in named.items()))
    print(f"own_step_separation: clean max {max(clean):.1e}, planted min {min(planted):.2f}")


if __name__ == "__main__":
    main()
