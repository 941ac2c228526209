"""Notebook 06's learning-rate range test (L. Smith's; Lightning's `Tuner.lr_find`, fastai's
`lr_find`): the task's own update, through the one loop, with a rate that grows exponentially
from `min_lr` to `max_lr` over a few dozen updates; the loss smoothed as Lightning smooths it
(an exponential average, bias-corrected), the sweep stopped once the smoothed loss exceeds
`stop_multiple` x its best (it diverged), and the suggestion read where the smoothed loss falls
fastest per decade of rate (fastai's "steep"; Lightning's gradient over the rate itself picks
noise among the first rates of so short a sweep). The study's grid is centred a third below the
suggestion: the steepest fall of a short sweep sits above the best constant rate of a longer
run (measured: the generation sample, 0.017 suggested, 0.0057 best of 0.002-0.051 over 200
updates; a tiny linear task, 0.23 and 0.077 under AdamW, 1.5 and 0.5 under SGD)."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from ...base.errors import WorkbookError
from ...contract.data import Item
from ...contract.task import Task
from ...storage.artifacts import read_json
from ...storage.files import write_json, write_text
from ...storage.schemas import Count, Multiple, Positive, Seed, StrictStr
from ...training.loop import Stepper, TrainConfig, UpdateShape, build_stepper, train
from . import support

CURVE, RESULT = "range_test.csv", "range_test.json"
GRID = (1 / 3, 1 / 9, 1.0)  # the study's rates as multiples of the suggestion, control first
MIN_FALL = 0.05  # a smoothed loss that falls less than this share suggests nothing (noise)


@dataclass
class RangeSettings:
    """How the rates are swept: from `min_lr` to `max_lr` in `updates` updates of `shape`."""

    min_lr: Positive = 1e-7
    max_lr: Positive = 10.0
    updates: Count = 50
    beta: float = 0.9  # smoothing: weight of the running average (Lightning: 0.98 over 100)
    stop_multiple: Multiple = 4.0  # stop once the smoothed loss exceeds this x its best
    seed: Seed = 0
    device: StrictStr = "cpu"

    def check(self) -> "RangeSettings":
        problems = []
        if not (math.isfinite(self.min_lr) and math.isfinite(self.max_lr)
                and 0 < self.min_lr < self.max_lr):
            problems.append(f"range_min_lr {self.min_lr:g} must be positive and below "
                            f"range_max_lr {self.max_lr:g}")
        if self.updates < 8:
            problems.append(f"range_updates {self.updates} is too few to read a curve from")
        if not 0 <= self.beta < 1:
            problems.append(f"the smoothing beta {self.beta} must be in [0, 1)")
        if problems:
            raise WorkbookError("range test: " + "; ".join(problems),
                                "e.g. range_min_lr=1e-7, range_max_lr=10, range_updates=50")
        return self

    def rates(self) -> list[float]:
        """The rate of each update: a geometric sequence from min_lr to max_lr."""
        ratio = (self.max_lr / self.min_lr) ** (1 / (self.updates - 1))
        return [self.min_lr * ratio**i for i in range(self.updates)]


@dataclass
class RangeTest:
    """The sweep's curve (update, lr, loss, smoothed), why it ended early ("" when it ran all
    its updates), the suggested rate (None when the smoothed loss never fell) and the result
    in one sentence."""

    settings: RangeSettings
    curve: pd.DataFrame
    stopped: str
    suggestion: float | None
    said: str
    grid: list[float] = field(default_factory=list)  # the study's rates, control first
    optimizer: str = ""  # the task's optimizer class, and the rate it defaults to
    optimizer_lr: float | None = None
    rate_ignored: str = ""  # `ignores_rate`'s sentence when the optimizer sets its own step

    def save(self, folder: Path) -> None:
        """`range_test.csv` (the curve) and `range_test.json` (settings, suggestion, grid)."""
        write_text(folder / CURVE, self.curve.to_csv(index=False))
        write_json(folder / RESULT, {"settings": asdict(self.settings), "stopped": self.stopped,
                                     "suggestion": self.suggestion, "said": self.said,
                                     "grid": self.grid, "rate_ignored": self.rate_ignored})


def smoothed(losses: list[float], beta: float) -> list[float]:
    """Lightning's running average of the losses, bias-corrected: avg = beta avg + (1 - beta)
    loss; smoothed = avg / (1 - beta^n)."""
    out, avg = [], 0.0
    for n, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**n))
    return out


def steepest(lrs: list[float], values: list[float], skip_begin: int,
             skip_end: int = 1) -> int | None:
    """The index where `values` fall fastest per decade of rate (np.gradient over log10 lr),
    leaving out the first `skip_begin` and last `skip_end` points as Lightning's `suggestion`
    does; None when fewer than 3 finite points remain or nowhere falls."""
    idx = [i for i in range(skip_begin, len(values) - skip_end) if math.isfinite(values[i])]
    if len(idx) < 3:
        return None
    slope = np.gradient(np.array([values[i] for i in idx]),
                        np.log10(np.array([lrs[i] for i in idx])))
    best = int(np.argmin(slope))
    return idx[best] if slope[best] < 0 else None


def rate_setter(stepper: Stepper, base: float) -> Callable[[float], None]:
    """Sets every parameter group's rate to its share of a rate (its own rate over `base`, the
    one the optimizer was built with; 1 for a group that holds none, lr=None)."""
    groups = stepper.optimizer.param_groups
    shares = [(g.get("initial_lr") or g["lr"] or base) / base for g in groups]

    def set_rate(lr: float) -> None:
        for group, share in zip(groups, shares, strict=True):
            group["lr"] = share * lr
    return set_rate


PROBE = (1e-5, 1e-1)  # one update at each, from the same start
IGNORED = 10.0  # a step that grows less than this for a 10,000x rate ignores the rate


def step_at(task: Task, items: list[Item], shape: UpdateShape, settings: RangeSettings,
            lr: float) -> float:
    """How far one update at `lr` moves the trainable weights (their change's norm), from the
    start the seed gives."""
    cfg = TrainConfig(shape, updates=1, lr=lr, seed=settings.seed, device=settings.device)
    stepper = build_stepper(task, cfg, examples=len(items))
    rate_setter(stepper, lr)(lr)
    weights = [p for p in stepper.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in weights]
    train(task, items, cfg, stepper=stepper)
    return float(sum(((p.detach() - b) ** 2).sum() for p, b in zip(weights, before,
                                                                    strict=True)) ** 0.5)


def ignores_rate(task: Task, items: list[Item], shape: UpdateShape,
                 settings: RangeSettings) -> str:
    """The experiment that shows an optimizer setting its own step (Adafactor with
    relative_step=True): one update from the same start at two rates 10,000x apart; a step
    that grows less than `IGNORED` x is said in a sentence ("" when the rate matters)."""
    low, high = (step_at(task, items, shape, settings, lr) for lr in PROBE)
    if not (low > 0 and high < IGNORED * low):
        return ""
    return (f"the task's optimizer sets its own step: one update from the same start moved "
            f"the weights by {low:.3g} at lr {PROBE[0]:g} and by {high:.3g} at lr "
            f"{PROBE[1]:g} ({high / low:.2f}x for a {PROBE[1] / PROBE[0]:,.0f}x rate), so "
            "a study of rates would compare one step (Adafactor with relative_step=True "
            "does this) - give the optimizer a rate it uses (e.g. relative_step=False, "
            "lr=1e-3) to choose one")


def sweep(task: Task, items: list[Item], shape: UpdateShape,
          settings: RangeSettings) -> RangeTest:
    """Run the range test on `items` with the task's own optimizer and update (`loop.train`):
    every parameter group's rate is set to its share of the swept rate before each update (the
    task's schedule is overridden for the sweep); the model is thrown away. An optimizer that
    ignores the rate (`ignores_rate`, tried after the sweep) gets no suggestion, and says so."""
    settings.check()
    rates = settings.rates()
    cfg = TrainConfig(shape, updates=settings.updates, lr=settings.min_lr, seed=settings.seed,
                      device=settings.device)  # no bar: the loop's names a trial
    stepper = build_stepper(task, cfg, examples=len(items))
    set_rate = rate_setter(stepper, settings.min_lr)

    losses: list[float] = []
    best = [math.inf]

    def on_update(record, stepper: Stepper, _position) -> str | None:
        losses.append(record.loss)
        if not math.isfinite(record.loss):
            return f"non-finite loss at lr {rates[record.step - 1]:.3g}"
        value = smoothed(losses, settings.beta)[-1]
        if record.step > 1 and value > settings.stop_multiple * best[0]:
            return (f"the smoothed loss {value:.3g} rose above {settings.stop_multiple:g} x "
                    f"its best {best[0]:.3g} at lr {rates[record.step - 1]:.3g}")
        best[0] = min(best[0], value)
        if record.step < len(rates):
            set_rate(rates[record.step])
        return None

    set_rate(rates[0])
    result = train(task, items, cfg, stepper=stepper, on_update=on_update)
    curve = pd.DataFrame({"update": range(1, len(losses) + 1), "lr": rates[:len(losses)],
                          "loss": losses, "smoothed": smoothed(losses, settings.beta)})
    known = {"optimizer": type(stepper.optimizer).__name__,
             "optimizer_lr": class_default(stepper.optimizer)}
    ignored = ignores_rate(task, items, shape, settings)  # after: the sweep is as it was
    if ignored:
        return RangeTest(settings, curve, result.stop_reason, None, ignored, **known,
                         rate_ignored=ignored)
    return replace(read_curve(settings, curve, result.stop_reason), **known)


def read_curve(settings: RangeSettings, curve: pd.DataFrame, stopped: str) -> RangeTest:
    """The suggestion from a sweep's curve, and the study's grid around it."""
    lrs, values = curve.lr.tolist(), curve.smoothed.tolist()
    skip = max(1, settings.updates // 10)
    at = steepest(lrs, values, skip_begin=skip)
    span = f"{settings.min_lr:g} to {lrs[-1]:.3g}" if lrs else "no update"
    low = min((v for v in values[skip:] if math.isfinite(v)), default=math.nan)
    if at is None or not low < values[skip] * (1 - MIN_FALL):
        said = (f"the smoothed training loss did not fall by {MIN_FALL:.0%} over the rates "
                f"swept ({span}, {len(lrs)} updates): the range test suggests no rate (an "
                "optimizer whose step grows over many updates, such as Adadelta, shows no "
                "fall in so short a sweep)")
        return RangeTest(settings, curve, stopped, None, said)
    suggestion = float(f"{lrs[at]:.2g}")  # a rate people can type
    ended = f"; it stopped at update {len(lrs)}: {stopped}" if stopped else ""
    grid = [float(f"{suggestion * f:.2g}") for f in GRID]
    said = (f"range test over {span} in {len(lrs)} updates: the smoothed training loss falls "
            f"fastest at lr {lrs[at]:.3g} (loss {values[at]:.3g}){ended}; suggested lr "
            f"{suggestion:g}, so the study tries a third of it, {grid[0]:g}, with "
            f"{grid[1]:g} and {grid[2]:g} beside")
    return RangeTest(settings, curve, stopped, suggestion, said, grid)


def load(folder: Path) -> RangeTest | None:
    """A range test saved in `folder` (a study reopened reuses it, never sweeps again), or
    None when there is none; a damaged file is refused."""
    path, table = folder / RESULT, folder / CURVE
    if not path.exists():
        return None
    fix = "delete range_test.json and range_test.csv to run the range test again, or give lrs"
    data = read_json(path, "range test")
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise WorkbookError(f"{path} is not a range test", fix)
    try:
        settings = RangeSettings(**data["settings"])
        curve = pd.read_csv(table)
        test = read_curve(settings, curve, str(data.get("stopped") or ""))
    except (TypeError, ValueError, OSError, KeyError) as exc:
        raise WorkbookError(f"{path} cannot be read as a range test ({exc})", fix) from None
    test.rate_ignored = str(data.get("rate_ignored") or "")
    if test.rate_ignored:  # the curve was swept, but the rate it swept did not matter
        test.suggestion = None
    if test.suggestion != data.get("suggestion"):
        raise WorkbookError(f"{path} does not match its curve {table.name} (suggestion "
                            f"{data.get('suggestion')} vs {test.suggestion})", fix)
    grid = data.get("grid")  # as the study placed it: the task's own rate, or the fallback
    if not (isinstance(grid, list) and grid and all(
            isinstance(r, (int, float)) and r > 0 for r in grid)):
        raise WorkbookError(f"{path} holds no grid of positive rates ({grid!r})", fix)
    test.grid, test.said = [float(r) for r in grid], str(data.get("said") or test.said)
    return test


def with_own_rate(test: RangeTest, own: float | None) -> None:
    """The rate the task's script declares (`Task.lr`) is the control of the study when the
    suggestion's grid holds nothing within 1.5x of it: the user's own rate stays the baseline
    every suggested rate must beat (a short sweep can read a batch memorised at a large rate
    as the steepest fall); it takes the place of the grid's lowest multiple."""
    if not own or any(max(own, r) / min(own, r) < 1.5 for r in test.grid):
        return
    test.grid = [own, test.grid[0], test.grid[2]]
    test.said += (f"; the task's own lr {own:g} is none of them: it is the control, with "
                  f"{test.grid[1]:g} and {test.grid[2]:g} beside")


DECADES = (1.0, 1e-2, 1e-1, 1e1, 1e2)  # the grid without a suggestion, control first


def class_default(optimizer: torch.optim.Optimizer) -> float | None:
    """The learning rate the optimizer's class defaults to (Adadelta 1.0, Adam 1e-3, ...), or
    None when it has none."""
    given = inspect.signature(type(optimizer).__init__).parameters.get("lr")
    default = None if given is None else given.default
    return float(default) if isinstance(default, (int, float)) and default > 0 else None


def fallback_grid(task: Task, test: RangeTest) -> tuple[list[float], str]:
    """The grid when the range test suggests no rate: five rates a decade apart around the
    task's own lr, else its optimizer class's default (`class_default`), else 1e-3 - the sweep
    having shown nothing, the study spans the decades its trials can tell apart."""
    control = task.lr or test.optimizer_lr or 1e-3
    who = ("the task's own lr" if task.lr else f"{test.optimizer}'s default lr"
           if test.optimizer_lr else "1e-3")
    grid = [float(f"{control * f:.2g}") for f in DECADES]
    return grid, f"five rates a decade apart around {who} ({control:g}): {support.grid(grid)}"

