"""The Trainer side of `from_lightning`: the pilot's run as a Trainer would describe it
(`LightningRun`), the `PilotTrainer` a module reads as `self.trainer` while the pilot calls its
hooks, and what the module logs with `self.log` meanwhile."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from ...base.errors import WorkbookError
from ..metric_reduction import GATHERED, MAX, MEAN, MIN, OWN, ROWS, SUM
from ..run import DEFAULT_UPDATES, current_run

# the pilot's precision as Lightning names it (`trainer.precision`)
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


@dataclasses.dataclass
class LightningRun:
    """The pilot's run as a Trainer would describe it: the configuration (from the loop's
    `loop.TrainConfig` when found, else defaults) and the counters the train step advances."""

    updates: int
    micro_batch: int
    accumulation: int
    examples: int  # training examples of one pass
    precision: str = "fp32"
    replicas: int = 1
    drop_partial: bool = False
    source: str = "defaults"
    global_step: int = 0  # updates made
    examples_seen: int = 0
    batch_idx: int = 0  # micro-batches into the current pass
    started: bool = False  # on_fit_start / on_train_start called

    @property
    def pass_examples(self) -> int:
        per_update = self.micro_batch * self.accumulation
        n = self.examples // per_update * per_update if self.drop_partial else self.examples
        return max(n, 1)

    @property
    def updates_per_pass(self) -> int:
        return max(math.ceil(self.pass_examples / (self.micro_batch * self.accumulation)), 1)

    @property
    def batches_per_pass(self) -> int:
        return math.ceil(self.pass_examples / self.micro_batch)

    @property
    def max_epochs(self) -> int:
        return math.ceil(self.updates / self.updates_per_pass)

    @property
    def current_epoch(self) -> int:
        return self.examples_seen // self.pass_examples


def run_of_build(default_examples: int, micro_batch: int) -> LightningRun:
    """The run whose optimizer is being built (`loop.current_run()`, set by `build_stepper`).
    Outside one (a direct call), DEFAULT_UPDATES updates of the train loader's batch over the
    whole train set."""
    run = current_run()
    if run is None:
        return LightningRun(DEFAULT_UPDATES, max(micro_batch, 1), 1, default_examples)
    shape = run.shape
    return LightningRun(run.updates, shape.micro_batch, shape.accumulation,
                run.examples if run.examples is not None else default_examples,
                shape.precision, shape.replicas, run.drop_partial,
                "the run's configuration" + ("" if run.examples is not None else
                                             " (examples: the whole train set)"))


RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module or optimizer -> LightningRun


class TrainerAttributeMissing(WorkbookError):
    """The module read a Trainer attribute the pilot's stand-in does not provide."""


# what differs from the campaign's Trainer, per attribute (the pilot's value is added on read)
DIFFERS = {
    "estimated_stepping_batches": "the updates of the pilot's run; the campaign's Trainer "
                                  "counts its own max_epochs/max_steps over the whole data",
    "max_steps": "the updates of the pilot's run",
    "max_epochs": "the passes the pilot's run makes",
    "num_training_batches": "micro-batches per pass over the pilot's training examples",
    "num_val_batches": "the datamodule's validation loader here (the pilot evaluates in its "
                       "own batches)",
    "accumulate_grad_batches": "the pilot's update shape (05 and 08 choose the campaign's)",
    "precision": "the pilot's precision (the campaign's plan may choose another)",
    "num_devices": "one process here; the campaign runs on its own devices",
    "world_size": "one process here; the campaign runs on its own devices",
    "num_nodes": "one machine here",
    "log_dir": "a scratch folder of the pilot",
    "default_root_dir": "a scratch folder of the pilot",
    "logger": "no logger in the pilot",
    "loggers": "no logger in the pilot",
}


class PilotTrainer:
    """What a LightningModule reads from `self.trainer`, with the pilot's own values, while
    the pilot calls its hooks: not a `lightning.Trainer`. Attributes it does not provide raise
    `TrainerAttributeMissing` naming them (never a silent None)."""

    def __init__(self, run: LightningRun, module: nn.Module, datamodule: Any, stage: str,
                 differs: dict[str, str], scratch: Callable[[], str], val_batches: float,
                 gradient_clip_val: float | None):
        self._run, self._module, self._datamodule, self._stage = run, module, datamodule, stage
        self._differs, self._scratch, self._val_batches = differs, scratch, val_batches
        self._clip = gradient_clip_val

    def _note(self, name: str, value: Any) -> Any:
        if name in DIFFERS:  # the latest value read: the run's, after the build-time probe
            self._differs[name] = f"{value!r} here: {DIFFERS[name]}"
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith(("_repr", "_ipython")):
            raise AttributeError(name)
        raise TrainerAttributeMissing(
            f"the module reads self.trainer.{name}, which the pilot does not provide (its "
            "stand-in for the Trainer gives " + ", ".join(PROVIDED) + ")",
            f"read {name} from the module's own attributes (hparams) while the pilot runs it, "
            "or ask for it to be added to "
            "workbook.contract.adapters.lightning_trainer.PilotTrainer")

    def __repr__(self) -> str:
        return f"PilotTrainer(stage={self._stage!r}, global_step={self._run.global_step})"

    # the run
    @property
    def estimated_stepping_batches(self) -> int:
        return self._note("estimated_stepping_batches", self._run.updates)

    @property
    def max_steps(self) -> int:
        return self._note("max_steps", self._run.updates)

    @property
    def max_epochs(self) -> int:
        return self._note("max_epochs", self._run.max_epochs)

    @property
    def num_training_batches(self) -> int:
        return self._note("num_training_batches", self._run.batches_per_pass)

    @property
    def num_val_batches(self) -> list[float]:  # inf: an unsized (streaming) loader, as Lightning
        return self._note("num_val_batches", [self._val_batches])

    @property
    def accumulate_grad_batches(self) -> int:
        return self._note("accumulate_grad_batches", self._run.accumulation)

    @property
    def precision(self) -> str:
        return self._note("precision", LIGHTNING_PRECISION.get(self._run.precision,
                                                                self._run.precision))

    @property
    def gradient_clip_val(self) -> float | None:
        return self._clip

    # where it stands
    @property
    def global_step(self) -> int:
        return self._run.global_step

    @property
    def current_epoch(self) -> int:
        return self._run.current_epoch

    @property
    def training(self) -> bool:
        return self._stage == "train"

    @property
    def validating(self) -> bool:
        return self._stage == "validate"

    @property
    def testing(self) -> bool:
        return False

    @property
    def predicting(self) -> bool:
        return False

    @property
    def sanity_checking(self) -> bool:
        return False

    @property
    def fast_dev_run(self) -> bool:
        return False

    # the processes
    @property
    def num_devices(self) -> int:
        return self._note("num_devices", 1)

    @property
    def world_size(self) -> int:
        return self._note("world_size", self._run.replicas)

    @property
    def num_nodes(self) -> int:
        return self._note("num_nodes", 1)

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return True

    # files and loggers
    @property
    def log_dir(self) -> str:
        return self._note("log_dir", self._scratch())

    @property
    def default_root_dir(self) -> str:
        return self._note("default_root_dir", self._scratch())

    @property
    def logger(self) -> None:
        return self._note("logger", None)

    @property
    def loggers(self) -> list:
        return self._note("loggers", [])

    # the objects
    @property
    def datamodule(self) -> Any:
        return self._datamodule

    @property
    def lightning_module(self) -> nn.Module:
        return self._module

    @property
    def model(self) -> nn.Module:
        return self._module


PROVIDED = sorted(n for n, v in vars(PilotTrainer).items() if isinstance(v, property))


@contextlib.contextmanager
def attached(module: nn.Module, trainer: PilotTrainer) -> Iterator[None]:
    """`module.trainer = trainer` as Lightning attaches its own (the setter reaches child
    LightningModules too), put back as it was after."""
    before = module._trainer
    module.trainer = trainer
    try:
        yield
    finally:
        module.trainer = before


def logged_value(value: Any) -> tuple[float, bool]:
    """A logged value as a float, and whether it is a metric object (torchmetrics' Metric, or
    anything with compute()): Lightning computes those at the epoch's end, over the epoch."""
    if callable(getattr(value, "compute", None)) and not isinstance(value, torch.Tensor):
        computed = value.compute()
        return float(computed.detach() if isinstance(computed, torch.Tensor) else computed), True
    value = value.detach() if isinstance(value, torch.Tensor) else value
    return float(value), False


class Logged(NamedTuple):
    """One `self.log` call: the value, its batch_size, reduce_fx ("mean", "sum", "max",
    "min"), the metric object logged (None for a number) and sync_dist."""

    value: float
    size: int | None
    reduce_fx: str
    metric: Any
    sync_dist: bool = False

    def reduction(self, epoch_end: bool) -> str:
        """How Lightning combines it over ranks: a torchmetrics Metric syncs its own states
        (gathered); a step log's epoch mean weighs every rank's rows (sync_dist sums values and
        batch sizes); an epoch-end number is reduced by reduce_fx over the ranks' values with
        sync_dist ("sum": a count), and without it is each rank's own value."""
        if self.metric is not None:
            return GATHERED if _is_torchmetric(self.metric) else ROWS
        if self.reduce_fx == "sum":
            return SUM
        if not epoch_end:
            return ROWS
        if not self.sync_dist:
            return OWN
        return {"max": MAX, "min": MIN}.get(self.reduce_fx, MEAN)


def _is_torchmetric(value: Any) -> bool:
    return any(c.__module__.startswith("torchmetrics") and c.__name__ == "Metric"
               for c in type(value).__mro__)


@contextlib.contextmanager
def logged(module: nn.Module):
    """What `self.log` / `self.log_dict` record during one call: {name: Logged}. Nests: the
    outer recorder is back after."""
    seen: dict[str, Logged] = {}

    def log(name, value, *args, batch_size=None, reduce_fx="mean", sync_dist=False, **kwargs):
        number, is_metric = logged_value(value)
        seen[name] = Logged(number, batch_size, getattr(reduce_fx, "__name__", str(reduce_fx)),
                            value if is_metric else None, bool(sync_dist))

    def log_dict(values, *args, batch_size=None, reduce_fx="mean", sync_dist=False, **kwargs):
        for name, value in dict(values).items():
            log(name, value, batch_size=batch_size, reduce_fx=reduce_fx, sync_dist=sync_dist)

    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    module.log, module.log_dict = log, log_dict
    try:
        yield seen
    finally:
        del module.log, module.log_dict
        module.__dict__.update(saved)
