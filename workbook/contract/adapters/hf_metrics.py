"""`compute_metrics` in `from_hf`: the Trainer's whole-split metrics through the workbook's
per-batch sums, exactly (`SplitMetrics`), and the check that it leaves padding rows out."""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable

import numpy as np
from torch import nn

from ...base.errors import WorkbookError, reason
from ..metric_reduction import GATHERED
from ..outputs import eval_mode
from ..run import EXAMPLE_WEIGHT
from ..targets import IGNORE_INDEX
from ..task import Task

ROW = "hf_row"  # which dataset row an encoded example is (split offset + index), for eval_step
ROW_OFFSET = 1 << 40  # split s's row i is s * ROW_OFFSET + i


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """Batches joined along the rows; sequences of other widths padded with -100, as the
    Trainer's `nested_concat` pads them."""
    if not parts:
        return np.zeros((0,))
    if parts[0].ndim < 2 or len({p.shape[1] for p in parts}) == 1:
        return np.concatenate(parts)
    width = max(p.shape[1] for p in parts)
    return np.concatenate([np.pad(p, [(0, 0), (0, width - p.shape[1])] +
                                  [(0, 0)] * (p.ndim - 2), constant_values=IGNORE_INDEX)
                           for p in parts])


def _metric_values(compute_metrics: Callable, predictions: np.ndarray,
                   label_ids: np.ndarray) -> dict[str, float]:
    from transformers import EvalPrediction

    try:
        got = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
    except Exception as exc:
        raise WorkbookError(f"from_hf: compute_metrics raised {type(exc).__name__}: "
                            f"{reason(exc, 300)}", "fix compute_metrics: it receives a "
                            "transformers.EvalPrediction (predictions, label_ids) of the whole "
                            "eval split, as Trainer.evaluate calls it") from exc
    try:
        return {str(k): float(v) for k, v in dict(got).items()}
    except (TypeError, ValueError) as exc:
        raise WorkbookError(f"from_hf: compute_metrics returned {str(got)[:80]!r}, not a dict "
                            "of numbers", "return {name: float}, e.g. "
                            '{"accuracy": 0.91}') from exc


class SplitMetrics:
    """`compute_metrics` as the Trainer calls it - once, on the predictions and labels of the
    whole eval split - mapped onto the workbook's per-batch sums without approximation: each
    batch adds the rows seen so far to one running split, calls compute_metrics on all of it
    and returns, per metric, (N_k x M_k - N_k-1 x M_k-1, rows of the batch). The sums over the
    split telescope to (N x M, N), so the ratio the workbook reports is M, the Trainer's value,
    for any metric (F1 too), any batching. A new evaluation starts when the model's weights
    changed, a row comes again or another split begins. Rows with label -100 (padding, the
    loop's zero-weight copies) never reach compute_metrics."""

    def __init__(self, compute_metrics: Callable, preprocess: Callable | None):
        self.compute_metrics, self.preprocess = compute_metrics, preprocess
        self.key: Any = None
        self.split: int | None = None
        self.seen: set[int] = set()
        self.predictions: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.rows, self.values = 0, {}
        # over data-parallel ranks the Trainer gathers every rank's predictions and labels
        # before calling compute_metrics once: each metric is the whole split's (09)
        self.reductions: dict[str, str] = {}

    def __call__(self, task: Task, model: nn.Module, batch: dict) -> dict[str, tuple]:
        with eval_mode(model):
            logits = task.forward(model, batch)
        labels = batch["labels"]
        real = ~(labels == IGNORE_INDEX).reshape(len(labels), -1).all(1)
        if EXAMPLE_WEIGHT in batch:
            real &= batch[EXAMPLE_WEIGHT].reshape(-1) > 0
        rows = batch[ROW].reshape(-1)[real].tolist() if ROW in batch else []
        split = rows[0] // ROW_OFFSET if rows else None
        key = (weakref.ref(model), _version(model))  # a dead model's ref equals no other
        if key != self.key or set(rows) & self.seen or (
                split is not None and self.split is not None and split != self.split):
            self.seen, self.predictions, self.labels = set(), [], []
            self.rows, self.values, self.split = 0, {}, None
        self.key, self.split = key, split if split is not None else self.split
        self.seen.update(rows)
        n = int(real.sum())
        if not n:
            return {name: (0.0, 0.0) for name in self.values}
        mine = logits[real]
        if self.preprocess is not None:
            mine = self.preprocess(mine, labels[real])
        self.predictions.append(mine.float().cpu().numpy())
        self.labels.append(labels[real].cpu().numpy())
        values = _metric_values(self.compute_metrics, _concat(self.predictions),
                                _concat(self.labels))
        self.reductions.update(dict.fromkeys(values, GATHERED))
        total = self.rows + n
        out = {name: (total * v - self.rows * self.values.get(name, 0.0), float(n))
               for name, v in values.items()}
        self.rows, self.values = total, values
        return out


def _version(model: nn.Module) -> int:
    """A counter every in-place change of the weights advances (an update, a restore)."""
    try:
        return sum(p._version for p in model.parameters())
    except (AttributeError, RuntimeError):
        return 0


def probe_padding(compute_metrics: Callable, labels: list, num_labels: int) -> None:
    """The Trainer hands compute_metrics every row of the eval set, its padding rows (label
    -100) too: with perfect predictions on the real rows, the metrics must not change when the
    padding rows are left out - else compute_metrics counts them."""
    ids = np.asarray(labels)
    real = ids != IGNORE_INDEX
    predictions = np.eye(num_labels)[np.where(real, ids, 0).clip(0, num_labels - 1)]
    every = _metric_values(compute_metrics, predictions, ids)
    only = _metric_values(compute_metrics, predictions[real], ids[real])
    changed = {k: (every[k], only.get(k)) for k in every
               if only.get(k) is None or not math.isclose(every[k], only[k], rel_tol=1e-9,
                                                          abs_tol=1e-12)}
    if changed:
        name, (a, b) = next(iter(changed.items()))
        raise WorkbookError(
            f"from_hf: compute_metrics counts the eval dataset's {int((~real).sum())} padding "
            f"rows (label -100), which Trainer.evaluate passes it: with perfect predictions "
            f"{name} is {a:.4g} with them and {b:.4g} without, so the campaign's reported "
            f"{', '.join(changed)} would be off",
            "keep only the rows that count in compute_metrics: mask = labels != -100; "
            "predictions, labels = predictions[mask], labels[mask]")
