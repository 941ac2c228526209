"""The Trainer side of `from_lightning`: the pilot's run as a Trainer would describe it
(`LightningRun`), the fit every run shares (`PilotFit`), the one declaration of what a module
reads as `self.trainer` while the pilot calls its hooks (`PilotTrainer`), and what it logs with
`self.log` meanwhile (`logged`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from ...base.errors import WorkbookError
from ...storage.files import scratch_folder
from ..metric_reduction import GATHERED, MAX, MEAN, MIN, OWN, ROWS, SUM
from ..run import DEFAULT_UPDATES, RunLength, current_run
from ..shape import UpdateShape
from ..sources import length

# the pilot's precision as Lightning names it (`trainer.precision`)
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


@dataclasses.dataclass
class LightningRun:
    """The pilot's run as a Trainer would describe it: the run being built (`length`, its
    `examples` those of one pass) and the counters the train step advances."""

    length: RunLength
    global_step: int = 0  # updates made
    examples_seen: int = 0
    batch_idx: int = 0  # micro-batches into the current pass
    started: bool = False  # on_fit_start / on_train_start called

    @classmethod
    def current(cls, default_examples: int, micro_batch: int) -> LightningRun:
        """The run whose optimizer is being built (`run.current_run()`, set by `build_stepper`;
        its examples the whole train set when it does not say). Outside one (the module read
        at load, a step with no optimizer built), DEFAULT_UPDATES updates of the train
        loader's batch over the whole train set."""
        run = current_run() or RunLength(DEFAULT_UPDATES, UpdateShape(micro_batch=micro_batch))
        return cls(run if run.examples is not None else
                   dataclasses.replace(run, examples=default_examples))

    @property
    def pass_examples(self) -> int:
        shape, examples = self.length.shape, self.length.examples
        per_update = shape.micro_batch * shape.accumulation
        return max(examples // per_update * per_update if self.length.drop_partial
                   else examples, 1)

    @property
    def batches_per_pass(self) -> int:
        return math.ceil(self.pass_examples / self.length.shape.micro_batch)

    @property
    def max_epochs(self) -> int:
        per_pass = max(math.ceil(self.batches_per_pass / self.length.shape.accumulation), 1)
        return math.ceil(self.length.updates / per_pass)

    @property
    def current_epoch(self) -> int:
        return self.examples_seen // self.pass_examples


class TrainerAttributeMissing(WorkbookError):
    """The module read a Trainer attribute the pilot's stand-in does not provide."""


class Campaign:
    """A Trainer attribute whose pilot value differs from the campaign Trainer's (`differs` says
    how): each read notes it in the fit's `differs` (the latest read wins: the run's, after
    the probe at load)."""

    def __init__(self, read: Callable[[PilotTrainer], Any], differs: str):
        self.read, self.differs, self.__doc__ = read, differs, differs

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: PilotTrainer | None, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        value = self.read(trainer)
        trainer._fit.differs[self.name] = f"{value!r} here: {self.differs}"
        return value


class PilotFit:
    """The `Trainer.fit` a LightningModule runs under in the pilot, built once per
    `from_lightning`: what every run shares (the datamodule, the Trainer's clipping, the
    validation loader's length, a scratch log_dir), the run each module and optimizer is in,
    and which Trainer values the module read differ from the campaign Trainer's (`differs`,
    {attribute: the pilot's value and why}, filled as the module reads them)."""

    def __init__(self, datamodule: Any, val_loader: Any, gradient_clip_val: float | None,
                 default_examples: int, micro_batch: int):
        self.datamodule, self.gradient_clip_val = datamodule, gradient_clip_val
        batches = length(val_loader)
        self.val_batches = math.inf if batches is None else batches  # Lightning's for a stream
        self.default_examples, self.micro_batch = default_examples, micro_batch
        self.differs: dict[str, str] = {}
        self.runs: weakref.WeakKeyDictionary[Any, LightningRun] = weakref.WeakKeyDictionary()
        self._scratch: str | None = None

    def scratch(self) -> str:
        """The Trainer's log_dir: a folder removed at exit."""
        if self._scratch is None:
            self._scratch = scratch_folder("workbook-lightning-")
        return self._scratch

    def new_run(self, module: nn.Module) -> LightningRun:
        """The module's run from now on: the one being built, else the default one."""
        self.runs[module] = run = LightningRun.current(self.default_examples, self.micro_batch)
        return run

    def run_of(self, module: nn.Module, optimizer: Any = None) -> LightningRun:
        """The run of the optimizer, else of the module, else a new one for the module."""
        run = self.runs.get(optimizer) if optimizer is not None else None
        return run or self.runs.get(module) or self.new_run(module)

    @contextlib.contextmanager
    def hooks(self, module: nn.Module, run: LightningRun, stage: str) -> Iterator[dict]:
        """The module with the pilot's Trainer attached as Lightning attaches its own (the
        setter reaches child LightningModules too) and its logging recorded; both as they were
        after."""
        before = module._trainer
        module.trainer = PilotTrainer(self, run, module, stage)
        try:
            with logged(module) as seen:
                yield seen
        finally:
            module.trainer = before


class PilotTrainer:
    """What a LightningModule reads of `self.trainer`, with the pilot's own values, while the
    pilot calls its hooks - the one place it is declared; not a `lightning.Trainer`. It holds
    the Trainer properties Lightning documents that the pilot can answer, what
    LightningModule's own properties and default hooks read of it (`self.global_step`,
    `self.current_epoch`, `self.global_rank`, `self.local_rank`, `self.logger`,
    `self.loggers`, `self.print`, `trainer.model.eval()`) and the Trainer settings a module
    sizes itself by; any other attribute raises `TrainerAttributeMissing` naming it, never a
    silent None."""

    # the stage flags: which loop runs the hook
    training: bool
    validating: bool
    testing = predicting = sanity_checking = False
    # the objects
    lightning_module: nn.Module
    model: nn.Module  # the module itself (Lightning's is the strategy's wrapped module)
    datamodule: Any  # the one from_lightning was given
    gradient_clip_val: float | None  # from_lightning's, as the Trainer's
    # the processes, as one rank sees them
    global_rank = local_rank = 0
    is_global_zero = True

    def __init__(self, fit: PilotFit, run: LightningRun, module: nn.Module, stage: str):
        self.training, self.validating = stage == "train", stage == "validate"
        self.lightning_module = self.model = module
        self.datamodule, self.gradient_clip_val = fit.datamodule, fit.gradient_clip_val
        self._fit, self._run = fit, run

    # where the run stands
    global_step = property(lambda self: self._run.global_step, doc="Updates made.")
    current_epoch = property(lambda self: self._run.current_epoch,
                             doc="Passes over the train set completed.")
    # the run's configuration: the pilot's, not the campaign's
    estimated_stepping_batches = Campaign(
        lambda self: self._run.length.updates, "the updates of the pilot's run; the campaign's "
        "Trainer counts its own max_epochs/max_steps over the whole data")
    max_steps = Campaign(lambda self: self._run.length.updates, "the updates of the pilot's run")
    max_epochs = Campaign(lambda self: self._run.max_epochs, "the passes the pilot's run makes")
    num_training_batches = Campaign(lambda self: self._run.batches_per_pass, "micro-batches "
                                    "per pass over the pilot's training examples")
    num_val_batches = Campaign(  # inf: an unsized (streaming) loader, as Lightning
        lambda self: [self._fit.val_batches], "the datamodule's validation loader here (the "
        "pilot evaluates in its own batches)")
    accumulate_grad_batches = Campaign(lambda self: self._run.length.shape.accumulation,
                                       "the pilot's update shape (05 and 08 choose the "
                                       "campaign's)")
    precision = Campaign(
        lambda self: LIGHTNING_PRECISION.get(self._run.length.shape.precision,
                                             self._run.length.shape.precision),
        "the pilot's precision (the campaign's plan may choose another)")
    # the processes: one here
    num_devices = Campaign(lambda self: 1, "one process here; the campaign runs on its own "
                           "devices")
    world_size = Campaign(lambda self: self._run.length.shape.replicas, "one process here; "
                          "the campaign runs on its own devices")
    # files and loggers
    log_dir = Campaign(lambda self: self._fit.scratch(), "a scratch folder of the pilot")
    logger = Campaign(lambda self: None, "no logger in the pilot")
    loggers = Campaign(lambda self: [], "no logger in the pilot")

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
        return f"PilotTrainer(training={self.training}, global_step={self.global_step})"


PROVIDED = sorted(n for n in {*vars(PilotTrainer), *PilotTrainer.__annotations__}
                  if not n.startswith("_"))


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
