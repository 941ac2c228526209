"""`from_lightning`: a `LightningModule` factory and its `LightningDataModule` as a Task, run as
`Trainer.fit` would run them - the module's own `training_step` (its loss divided by the number
of micro-batches, as `accumulate_grad_batches` does, with the train hooks around it),
`configure_optimizers` (one optimizer; its scheduler stepped per update or per pass as the task's
`build_scheduler`), the validation loop's hooks (`on_validation_model_eval`,
`on_validation_epoch_start`, `validation_step` with `batch_idx` counting up,
`on_validation_epoch_end`, `on_validation_model_train`) with what they log (weighted by the
logged `batch_size`, as Lightning's epoch means are; an epoch-end log is a whole-epoch value),
`on_save_checkpoint`/`on_load_checkpoint` around a Lightning-shaped checkpoint, and the
datamodule's datasets and `collate_fn`, whose batches reach the module's steps exactly as the
loader yields them. While the pilot calls the module's hooks, `self.trainer` is a `PilotTrainer`:
the Trainer attributes modules read, with the pilot's own values (`campaign_differs_in` on the
Task says which differ from the campaign's). Needs `lightning` (`pip install -e .[lightning]`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from .. import kinds
from ..run import DEFAULT_UPDATES, EXAMPLE_WEIGHT, current_run
from ..task import Task, accepted_inputs
from .torch import LABELS, from_torch, probe_on_meta

CHECKPOINT = "lightning.ckpt"
SCALED = ("lr", "initial_lr", "max_lr", "min_lr")  # group keys a scheduler reads its rate from
# the run's number of updates when the pilot's own configuration cannot be found (a direct call
# of task.optimizer): the loop's default budget
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as exc:
            raise WorkbookError("from_lightning needs Lightning, which is not installed",
                                "pip install -e '.[lightning]' (or pip install lightning)"
                                ) from exc
    return pl


def _call(piece: str, fn: Callable, *args: Any) -> Any:
    """One of the module's own methods; a failure names it."""
    try:
        return fn(*args)
    except WorkbookError:
        raise
    except Exception as exc:
        text = reason(exc, 300)
        fix = ("a LightningModule the pilot does not build reached for its trainer (one "
               "created inside the module, not a child of it): read what it needs from the "
               "module's own attributes (hparams)" if "attached to a `Trainer`" in text
               else f"fix {piece}")
        raise WorkbookError(f"the module's {piece} failed: {text}", fix) from exc


# ---------------------------------------------------------------------------------------------
# the run the pilot makes, and the Trainer stand-in that reports it

@dataclasses.dataclass
class _Run:
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


def _run_of_build(default_examples: int, micro_batch: int) -> _Run:
    """The run whose optimizer is being built (`loop.current_run()`, set by `build_stepper`).
    Outside one (a direct call), DEFAULT_UPDATES updates of the train loader's batch over the
    whole train set."""
    run = current_run()
    if run is None:
        return _Run(DEFAULT_UPDATES, max(micro_batch, 1), 1, default_examples)
    shape = run.shape
    return _Run(run.updates, shape.micro_batch, shape.accumulation,
                run.examples if run.examples is not None else default_examples,
                shape.precision, shape.replicas, run.drop_partial,
                "the run's configuration" + ("" if run.examples is not None else
                                             " (examples: the whole train set)"))


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

    def __init__(self, run: _Run, module: nn.Module, datamodule: Any, stage: str,
                 differs: dict[str, str], scratch: Callable[[], str], val_batches: int,
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
            "or ask for it to be added to workbook.contract.adapters.lightning.PilotTrainer")

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
    def num_val_batches(self) -> list[int]:
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
def _attached(module: nn.Module, trainer: PilotTrainer) -> Iterator[None]:
    """`module.trainer = trainer` as Lightning attaches its own (the setter reaches child
    LightningModules too), put back as it was after."""
    before = module._trainer
    module.trainer = trainer
    try:
        yield
    finally:
        module.trainer = before


def _logged_value(value: Any) -> tuple[float, bool]:
    """A logged value as a float, and whether it is a metric object (torchmetrics' Metric, or
    anything with compute()): Lightning computes those at the epoch's end, over the epoch."""
    if callable(getattr(value, "compute", None)) and not isinstance(value, torch.Tensor):
        computed = value.compute()
        return float(computed.detach() if isinstance(computed, torch.Tensor) else computed), True
    value = value.detach() if isinstance(value, torch.Tensor) else value
    return float(value), False


@contextlib.contextmanager
def _logged(module: nn.Module):
    """What `self.log` / `self.log_dict` record during one call: {name: (value, batch_size,
    reduce_fx, metric object or None)}. Nests: the outer recorder is back after."""
    seen: dict[str, tuple[float, int | None, str, Any]] = {}

    def log(name, value, *args, batch_size=None, reduce_fx="mean", **kwargs):
        number, is_metric = _logged_value(value)
        seen[name] = (number, batch_size, str(reduce_fx), value if is_metric else None)

    def log_dict(values, *args, batch_size=None, reduce_fx="mean", **kwargs):
        for name, value in dict(values).items():
            log(name, value, batch_size=batch_size, reduce_fx=reduce_fx)

    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    module.log, module.log_dict = log, log_dict
    try:
        yield seen
    finally:
        del module.log, module.log_dict
        module.__dict__.update(saved)


def _loss_of(returned: Any) -> torch.Tensor:
    if isinstance(returned, dict):
        if "loss" not in returned:
            raise WorkbookError(f"training_step returns a dict without 'loss' (keys "
                                f"{sorted(returned)})", "return the loss, or a dict whose "
                                "'loss' is the tensor to back-propagate, as Lightning needs")
        returned = returned["loss"]
    if not isinstance(returned, torch.Tensor) or returned.dim() != 0:
        raise WorkbookError(f"training_step returns {type(returned).__name__}"
                            + ("" if returned is None else f" {str(returned)[:60]}")
                            + ", not a scalar loss tensor",
                            "return the loss; a training_step that returns None skips the "
                            "update in Lightning, which the pilot cannot judge")
    return returned


# ---------------------------------------------------------------------------------------------
# the structure of the loader's items and batches, kept for the module's steps

@dataclasses.dataclass(frozen=True)
class _Shape:
    """The structure of an item or a batch: a leaf (named), or a tuple, list or dict of
    shapes. The pilot's batches are flat {name: tensor}; the module's steps get the
    structure back."""

    form: str  # "leaf", "tuple", "list", "dict"
    name: str = ""
    parts: tuple = ()  # shapes (tuple, list) or (key, shape) pairs (dict)

    def names(self) -> list[str]:
        if self.form == "leaf":
            return [self.name]
        shapes = [s for _, s in self.parts] if self.form == "dict" else list(self.parts)
        return [n for s in shapes for n in s.names()]

    def flatten(self, obj: Any, where: str) -> dict[str, Any]:
        if self.form == "leaf":
            return {self.name: obj}
        if self.form == "dict":
            if not isinstance(obj, dict) or list(obj) != [k for k, _ in self.parts]:
                raise _structure_changed(where, self, obj)
            return {n: v for k, s in self.parts for n, v in s.flatten(obj[k], where).items()}
        if not isinstance(obj, (tuple, list)) or len(obj) != len(self.parts):
            raise _structure_changed(where, self, obj)
        return {n: v for s, o in zip(self.parts, obj, strict=True)
                for n, v in s.flatten(o, where).items()}

    def build(self, flat: dict[str, Any]) -> Any:
        if self.form == "leaf":
            return flat[self.name]
        if self.form == "dict":
            return {k: s.build(flat) for k, s in self.parts}
        built = [s.build(flat) for s in self.parts]
        return tuple(built) if self.form == "tuple" else built


def _structure_changed(where: str, shape: _Shape, obj: Any) -> WorkbookError:
    return WorkbookError(f"{where} is a {type(obj).__name__} of another structure than the "
                         f"first one (fields {shape.names()})", "give every item (and every "
                         "batch) the same structure: the same tuple length or dict keys")


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _paths(v, (*path, str(k)))]
    if isinstance(obj, (tuple, list)):
        return [p for i, v in enumerate(obj) for p in _paths(v, (*path, str(i)))]
    return [path]


def _shape_of(obj: Any, fields: Sequence[str] | None, where: str) -> _Shape:
    """The structure of `obj` with its leaves named: by `fields` in order (depth first) when
    given for a tuple or list, by their keys (joined by '.') in a dict, and a flat pair by
    from_torch's default ('inputs', 'labels')."""
    paths = _paths(obj)
    if isinstance(obj, dict) and not fields:
        names = [".".join(p) for p in paths]
    elif fields:
        names = list(fields)
        if len(names) != len(paths):
            raise WorkbookError(f"{where} has {len(paths)} fields but fields= names "
                                f"{len(names)} ({names})", "give one name per element (depth "
                                "first), the target named 'labels'")
    elif isinstance(obj, (tuple, list)) and len(obj) == 2 and len(paths) == 2:
        names = ["inputs", LABELS]
    else:
        raise WorkbookError(f"{where} is a {type(obj).__name__} of {len(paths)} fields and "
                            "which one is the target is unknown",
                            "name every element in order, the target 'labels': e.g. "
                            "fields=('x', 'labels', 'w') for (x, y, sample_weight)")
    if len(set(names)) != len(names):
        raise WorkbookError(f"the fields of {where} repeat a name ({names})",
                            "give every element its own name")
    leaves = iter(names)

    def build(o: Any) -> _Shape:
        if isinstance(o, dict):
            return _Shape("dict", parts=tuple((k, build(v)) for k, v in o.items()))
        if isinstance(o, (tuple, list)):
            return _Shape("tuple" if isinstance(o, tuple) else "list",
                          parts=tuple(build(v) for v in o))
        return _Shape("leaf", next(leaves))
    return build(obj)


class _Flat(torch.utils.data.Dataset):
    """A dataset whose items are the user's items flattened to {name: leaf}."""

    def __init__(self, data: Any, shape: _Shape, split: str):
        self.data, self.shape, self.split = data, shape, split

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.shape.flatten(self.data[i], f"the {self.split} dataset's item {i}")


def _model_inputs(probe: nn.Module, names: list[str], dict_batch: bool) -> tuple[str, ...]:
    """The batch fields the module's forward takes: by name for a dict batch, the first ones
    (as many as forward's positional arguments) for a tuple."""
    candidates = [n for n in names if n != LABELS]
    params = [p for name, p in inspect.signature(type(probe).forward).parameters.items()
              if name != "self"]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params) or not candidates:
        return tuple(candidates)
    if dict_batch:
        accepted = accepted_inputs(type(probe))
        taken = [n for n in candidates if "**" in accepted or n in accepted]
        return tuple(taken or candidates[:1])
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return tuple(candidates[:max(len(positional), 1)])


# ---------------------------------------------------------------------------------------------
# the scheduler, stepped as Lightning steps it

@dataclasses.dataclass
class _Schedule:
    """The scheduler `configure_optimizers` returned, stepped as Lightning steps it: every
    `frequency` updates (`interval` "step") or passes over the train set ("epoch"). The
    workbook steps it once per update; `train_step` counts the examples each update saw.
    A scheduler whose `total_steps` is the stand-in's `estimated_stepping_batches` holds its
    last rate when a measurement makes more updates than its configuration says (03's gates
    make two on a configuration of one); any other total is the module's own and steps on."""

    scheduler: Any
    interval: str
    frequency: int
    examples_per_pass: int = 1
    examples_seen: int = 0
    updates: int = 0
    pending: int = 0  # examples of the update just made, counted by train_step
    estimated: int | None = None  # the estimated_stepping_batches the module was given
    held: int = 0  # steps not taken past that total

    def step(self) -> None:
        passes = self.examples_seen // self.examples_per_pass
        self.updates += 1
        self.examples_seen += self.pending
        self.pending = 0
        due = [self.updates] if self.interval == "step" else \
            range(passes + 1, self.examples_seen // self.examples_per_pass + 1)
        total = getattr(self.scheduler, "total_steps", None)
        for count in due:
            if count % self.frequency:
                continue
            if total is not None and total == self.estimated and \
                    getattr(self.scheduler, "last_epoch", 0) >= total:
                self.held += 1
                continue
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "examples_seen": self.examples_seen,
                "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.examples_seen, self.updates = state["examples_seen"], state["updates"]


SCHEDULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Schedule
RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module or optimizer -> _Run


def _optimizer_and_schedule(configured: Any) -> tuple[torch.optim.Optimizer, _Schedule | None]:
    """Lightning's return forms of configure_optimizers, with one optimizer."""
    schedulers: list = []
    if isinstance(configured, dict):
        optimizers, schedulers = [configured.get("optimizer")], [configured.get("lr_scheduler")]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and all(
            isinstance(part, (list, tuple)) for part in configured):
        optimizers, schedulers = list(configured[0]), list(configured[1])
    elif isinstance(configured, (list, tuple)):
        optimizers = list(configured)
    else:
        optimizers = [configured]
    schedulers = [s for s in schedulers if s is not None]
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        raise WorkbookError(f"configure_optimizers returns {len(optimizers)} optimizers "
                            f"({', '.join(type(o).__name__ for o in optimizers)})",
                            "the pilot maps one optimizer with at most one scheduler (GANs and "
                            "manual optimization: write a workbook.Task with its own train_step)")
    if len(schedulers) > 1:
        raise WorkbookError(f"configure_optimizers returns {len(schedulers)} schedulers",
                            "return one scheduler (chain them with SequentialLR)")
    if not schedulers:
        return optimizers[0], None
    given = schedulers[0] if isinstance(schedulers[0], dict) else {"scheduler": schedulers[0]}
    scheduler = given.get("scheduler")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or given.get("monitor"):
        raise WorkbookError("configure_optimizers returns a scheduler that monitors a metric "
                            "(ReduceLROnPlateau)", "the pilot's runs are too short for it: drop "
                            "it for the pilot, or give a schedule by update count")
    interval = given.get("interval", "epoch")
    if interval not in ("step", "epoch"):
        raise WorkbookError(f"the scheduler's interval is {interval!r}",
                            "give interval 'step' or 'epoch', as Lightning takes")
    return optimizers[0], _Schedule(scheduler, interval, int(given.get("frequency", 1)))


def _rescale(optimizer: torch.optim.Optimizer, schedule: _Schedule | None, ratio: float) -> None:
    """Every rate the module configured times `ratio` (the study's lr over the module's own):
    the groups keep their ratios and the schedule its shape."""
    for group in optimizer.param_groups:
        for key in SCALED:
            if isinstance(group.get(key), (int, float)):
                group[key] *= ratio
    if schedule is not None:
        sched = schedule.scheduler
        for name in ("base_lrs", "_last_lr"):
            if isinstance(getattr(sched, name, None), list):
                setattr(sched, name, [v * ratio for v in getattr(sched, name)])


def _own_lr(optimizer: torch.optim.Optimizer, schedule: _Schedule | None) -> float:
    """The rate the module configured, as the workbook reads a schedule's start (its
    `initial_lr`): the scheduler's base rate (before a warm-up lowered it; a one-cycle
    schedule's max_lr / div_factor), else the optimizer's."""
    if schedule is not None and hasattr(schedule.scheduler, "base_lrs"):
        return float(schedule.scheduler.base_lrs[0])
    return float(optimizer.param_groups[0]["lr"])


# ---------------------------------------------------------------------------------------------
# the validation epoch

@dataclasses.dataclass
class _ValEpoch:
    """One validation epoch Lightning would run, opened by the first batch of an evaluation.
    The loop evaluates batch by batch and says neither where an evaluation starts nor where
    it ends, so a new one is told from the last by what changes between evaluations: the
    weights (an update or a restore), the updates counted, the device, the mode the model
    is handed in and the evaluation batch size; a batch with padding copies is an
    evaluation's last. An epoch-end log is reported telescoped: batch k adds E_k * N_k -
    E_(k-1) * N_(k-1) over its n_k rows (E_k the epoch-end value over the first k batches,
    N_k their rows), so the loop's sum over the evaluation is the whole epoch's value."""

    key: tuple
    modes: list[bool]  # every submodule's mode after on_validation_model_eval
    batch_idx: int = 0
    rows: int = 0
    reported: dict[str, float] = dataclasses.field(default_factory=dict)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)  # logged Metric objects
    last: bool = False


VALIDATION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> _ValEpoch


def _weights_key(module: nn.Module) -> int:
    """Changes when any parameter or buffer is replaced or changed in place (an optimizer
    step, a restore)."""
    return hash(tuple((id(t), t._version) for t in (*module.parameters(), *module.buffers())
                      if not t.is_inference()))


def _modes(module: nn.Module) -> list[bool]:
    return [m.training for m in module.modules()]


def _set_modes(module: nn.Module, modes: list[bool]) -> None:
    for m, mode in zip(module.modules(), modes, strict=True):
        m.training = mode


def _shadow(module: nn.Module) -> nn.Module:
    """A copy of the module sharing its parameters (buffers and every other state copied), to
    run on_validation_epoch_end mid-epoch without touching the epoch's own state (a hook that
    resets its accumulator or clears its outputs)."""
    memo = {id(p): p for p in module.parameters()}
    return copy.deepcopy(module, memo)


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # 09 passes it inside DistributedDataParallel


def from_lightning(module_factory: Callable[[], nn.Module], datamodule: Any, *, name: str,
                   criterion: Any = None, kind: str = "classification",
                   fields: Sequence[str] | None = None,
                   group_of: Callable[[int, Any], Any] | None = None,
                   gradient_clip_val: float | None = None,
                   model_inputs: Sequence[str] | None = None, **task_fields: Any) -> Task:
    """A Task that runs a LightningModule as `Trainer.fit` would. `module_factory()` builds the
    module; `datamodule` gives the train and validation datasets and the train loader's
    `collate_fn` (its `prepare_data` and `setup("fit")` are called). Items and batches keep
    their structure for the module's steps; `fields` names their elements in order (depth
    first; the target 'labels', e.g. ('x', 'labels', 'w') for (x, y, sample_weight)), dicts
    are named by their keys. `model_inputs` (default: the fields the module's forward takes,
    by name or the first ones) are what the pilot's own checks pass to the model. `criterion`
    is the loss the pilot's own checks (01-03) compute per target, as in `from_torch` (None for
    generation: the task's token cross-entropy; pass `decode`), or give `loss(outputs, batch)
    -> (sum, count)` itself (a sample-weighted loss); 04 checks it against what
    `training_step` returns. `gradient_clip_val` is the Trainer's. Other Task fields pass
    through (`lr` defaults to the one configure_optimizers sets). The Task's
    `campaign_differs_in` says which Trainer values the module read differ from the
    campaign's."""
    pl = _lightning()
    differs: dict[str, str] = {}
    scratch_dir: list[str] = []

    def scratch() -> str:
        if not scratch_dir:
            scratch_dir.append(tempfile.mkdtemp(prefix="workbook-lightning-"))
        return scratch_dir[0]

    loaders = {}
    _call("prepare_data", datamodule.prepare_data)
    _call("setup", datamodule.setup, "fit")
    for split, method in (("train", "train_dataloader"), ("validation", "val_dataloader")):
        loader = _call(method, getattr(datamodule, method))
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise WorkbookError(f"{type(datamodule).__name__}.{method} returns a "
                                f"{type(loader).__name__}, not one DataLoader",
                                "return one torch DataLoader per split")
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise WorkbookError(f"the {split} loader's dataset is an IterableDataset",
                                "the pilot needs map-style datasets (len and indexing)")
        loaders[split] = loader
    train_set = loaders["train"].dataset
    if loaders["train"].batch_sampler is not None and type(
            loaders["train"].batch_sampler) is not torch.utils.data.BatchSampler:
        raise WorkbookError(f"the train loader batches with its own "
                            f"{type(loaders['train'].batch_sampler).__name__}",
                            "the pilot makes the micro-batches: give the loader a batch_size "
                            "(and a sampler for the order) instead of a batch_sampler")
    if not len(train_set):
        raise WorkbookError("the train dataset has no items", "pass the data you train on")
    val_batches = len(loaders["validation"])
    loader_batch = loaders["train"].batch_size or 1

    def run_of(module: nn.Module, optimizer: Any = None) -> _Run:
        run = RUNS.get(optimizer) if optimizer is not None else None
        run = run or RUNS.get(module)
        if run is None:
            run = RUNS[module] = _Run(DEFAULT_UPDATES, loader_batch, 1, len(train_set))
        return run

    @contextlib.contextmanager
    def hooks(module: nn.Module, run: _Run, stage: str):
        """The module with the pilot's Trainer attached and its logging recorded."""
        trainer = PilotTrainer(run, module, datamodule, stage, differs, scratch, val_batches,
                               gradient_clip_val)
        with _attached(module, trainer), _logged(module) as seen:
            yield seen

    probe = probe_on_meta(module_factory, "module", "pass a factory that builds the module "
                          "(no download, no data inside it)")
    if not isinstance(probe, pl.LightningModule):
        raise WorkbookError(f"the module factory builds a {type(probe).__name__}, not a "
                            "LightningModule", "pass the LightningModule class or a factory; "
                            "a plain nn.Module goes to from_torch")
    if not probe.automatic_optimization:
        raise WorkbookError("the module sets automatic_optimization = False (manual "
                            "optimization steps its optimizers inside training_step)",
                            "write a workbook.Task with a train_step that does what it does")
    probe_run = _Run(DEFAULT_UPDATES, loader_batch, 1, len(train_set))
    with hooks(probe, probe_run, "train"):
        optimizer, schedule = _optimizer_and_schedule(
            _call("configure_optimizers", probe.configure_optimizers))
    own_lr = _own_lr(optimizer, schedule)

    # the structure of the items and of the batches the train loader's collate makes
    item_shape = _shape_of(train_set[0], fields, "the train dataset's item 0")
    user_collate = loaders["train"].collate_fn
    first = _call("collate_fn (the train loader's)", user_collate,
                  [train_set[i] for i in range(min(2, len(train_set)))])
    batch_shape = _shape_of(first, fields, "the train loader's batch")
    for shape, where in ((item_shape, "the train dataset's items"),
                         (batch_shape, "the train loader's batches")):
        if LABELS not in shape.names():
            raise WorkbookError(f"{where} have no field named 'labels' (fields "
                                f"{shape.names()})", "name the target 'labels' in fields=, "
                                "e.g. fields=('x', 'labels', 'w'), or key it 'labels' in a dict")
    given_inputs = tuple(model_inputs) if model_inputs else _model_inputs(
        probe, batch_shape.names(), batch_shape.form == "dict")
    unknown = [n for n in given_inputs if n not in batch_shape.names()]
    if unknown:
        raise WorkbookError(f"model_inputs names {unknown}, not fields of the batch "
                            f"({batch_shape.names()})", "name fields of the collated batch")

    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        made = user_collate([item_shape.build(it) for it in items])
        return batch_shape.flatten(made, "the collated batch")

    own_loss = task_fields.pop("loss", None)
    if own_loss is not None and criterion is None and not kinds.of(kind).per_position:
        criterion = nn.MSELoss() if kinds.of(kind).float_targets else nn.CrossEntropyLoss()
    flat = {s: _Flat(loader.dataset, item_shape, s) for s, loader in loaders.items()}
    base = from_torch(flat, module_factory, criterion, name=name, kind=kind,
                      group_of=(lambda j, it: group_of(j, item_shape.build(it)))
                      if group_of else None, collate_fn=collate, **task_fields)
    base = dataclasses.replace(base, model_inputs=given_inputs,
                               **({"loss": own_loss} if own_loss is not None else {}))

    def users(batch: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> Any:
        """The batch as the user's collate made it: their tuple, dict or nesting, real rows
        only."""
        rows = {k: v[keep] if keep is not None and isinstance(v, torch.Tensor) and v.dim()
                and len(v) == len(keep) else v for k, v in batch.items() if k != EXAMPLE_WEIGHT}
        return batch_shape.build(rows)

    def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
        module = _unwrap(model)
        close_validation(module, run_of(module))  # a validation left open ends before a new run
        run = RUNS[module] = _run_of_build(len(train_set), loader_batch)
        with hooks(module, run, "train"):
            opt, sched = _optimizer_and_schedule(_call("configure_optimizers",
                                                       module.configure_optimizers))
        RUNS[opt] = run
        if lr != own_lr:
            _rescale(opt, sched, lr / own_lr)
        if sched is not None:
            sched.examples_per_pass = max(len(train_set), 1)
            sched.estimated = run.updates
            SCHEDULES[opt] = sched
        return opt

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, micro_batches: list) -> Any:
        module = _unwrap(model)
        run = run_of(module, opt)
        close_validation(module, run)  # Lightning ends a validation before training on
        total, count = 0.0, len(micro_batches)
        rows = sum(len(b[LABELS]) for b in micro_batches)
        with hooks(module, run, "train"):
            if not run.started:
                run.started = True
                _call("on_fit_start", module.on_fit_start)
                _call("on_train_start", module.on_train_start)
            if run.batch_idx == 0:
                _call("on_train_epoch_start", module.on_train_epoch_start)
            for i, batch in enumerate(micro_batches):
                given, index = users(batch), run.batch_idx
                _call("on_train_batch_start", module.on_train_batch_start, given, index)
                returned = _call("training_step", module.training_step, given, index)
                loss = _loss_of(returned)
                scaled = loss / count  # as accumulate_grad_batches divides
                _call("on_before_backward", module.on_before_backward, scaled)
                scaled.backward()
                _call("on_after_backward", module.on_after_backward)
                total += float(loss.detach())
                run.batch_idx += 1
                if i < count - 1:
                    _call("on_train_batch_end", module.on_train_batch_end, returned, given,
                          index)
            _call("on_before_optimizer_step", module.on_before_optimizer_step, opt)
            if gradient_clip_val:
                nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
            opt.step()
            _call("on_before_zero_grad", module.on_before_zero_grad, opt)
            opt.zero_grad(set_to_none=True)
            passes = run.current_epoch
            run.global_step += 1
            run.examples_seen += rows
            _call("on_train_batch_end", module.on_train_batch_end, returned, given, index)
            if run.current_epoch > passes:
                _call("on_train_epoch_end", module.on_train_epoch_end)
                run.batch_idx = 0
        sched = SCHEDULES.get(opt)
        if sched is not None:
            sched.pending = rows
        return total / count

    ends_epoch = type(probe).on_validation_epoch_end is not \
        pl.LightningModule.on_validation_epoch_end

    def close_validation(module: nn.Module, run: _Run) -> dict:
        """End the module's open validation epoch as Lightning ends one: on_validation_epoch_end
        (what it logs is returned), the logged metric objects reset, on_validation_end and
        on_validation_model_train - the modes the pilot set are back after."""
        epoch = VALIDATION.pop(module, None)
        if epoch is None:
            return {}
        found = _modes(module)
        try:
            with hooks(module, run, "validate") as seen, torch.no_grad():
                _set_modes(module, epoch.modes)
                _call("on_validation_epoch_end", module.on_validation_epoch_end)
                ended = dict(seen)
                for metric in epoch.metrics.values():
                    if callable(getattr(metric, "reset", None)):
                        metric.reset()
                _call("on_validation_end", module.on_validation_end)
                _call("on_validation_model_train", module.on_validation_model_train)
        finally:
            _set_modes(module, found)
        return ended

    def epoch_so_far(module: nn.Module, run: _Run) -> dict:
        """What on_validation_epoch_end would log now, run on a shadow of the module."""
        shadow = _shadow(module)
        with hooks(shadow, run, "validate") as seen, torch.no_grad():
            _call("on_validation_epoch_end", shadow.on_validation_epoch_end)
        return dict(seen)

    def eval_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple]:
        module = _unwrap(model)
        run = run_of(module)
        weight = batch.get(EXAMPLE_WEIGHT)
        keep = weight > 0 if weight is not None else None  # Lightning's last batch is short
        rows = int(keep.sum()) if keep is not None else len(batch[LABELS])
        key = (len(batch[LABELS]), _weights_key(module), run.global_step, module.training,
               str(batch[LABELS].device))
        epoch = VALIDATION.get(module)
        if epoch is not None and (epoch.last or epoch.key != key):
            close_validation(module, run)
            epoch = None
        found = _modes(module)  # Lightning's validation loop: eval mode, no grad, then back
        given = users(batch, keep)
        try:
            with hooks(module, run, "validate") as seen, torch.no_grad():
                if epoch is None:
                    _call("on_validation_model_eval", module.on_validation_model_eval)
                    _call("on_validation_start", module.on_validation_start)
                    _call("on_validation_epoch_start", module.on_validation_epoch_start)
                    epoch = VALIDATION[module] = _ValEpoch(key, _modes(module))
                    seen.clear()
                else:
                    _set_modes(module, epoch.modes)
                index = epoch.batch_idx
                _call("on_validation_batch_start", module.on_validation_batch_start, given,
                      index)
                returned = _call("validation_step", module.validation_step, given, index)
                _call("on_validation_batch_end", module.on_validation_batch_end, returned,
                      given, index)
                stepped = dict(seen)
                whole = {n: _logged_value(metric)[0] for n, (_, _, _, metric) in stepped.items()
                         if metric is not None}  # metric objects: their value over the epoch
            epoch.batch_idx += 1
            epoch.rows += rows
            epoch.last = keep is not None and not bool(keep.all())
            epoch.metrics.update({n: m for n, (_, _, _, m) in stepped.items() if m is not None})
            ended = close_validation(module, run) if epoch.last else \
                epoch_so_far(module, run) if ends_epoch else {}
        finally:
            _set_modes(module, found)
        whole.update({n: value for n, (value, _, _, _) in ended.items()})
        if not stepped and not whole and isinstance(returned, torch.Tensor) and \
                returned.dim() == 0:
            stepped["val_loss"] = (float(returned), None, "mean", None)
        if not stepped and not whole:
            raise WorkbookError("validation_step logs nothing and returns no loss",
                                "self.log('val_loss', loss) in validation_step (or the epoch's "
                                "metric in on_validation_epoch_end), as Lightning's "
                                "checkpointing and early stopping need")
        out = {}
        for metric, (value, size, reduce_fx, obj) in stepped.items():
            if obj is not None or reduce_fx != "mean" or not math.isfinite(value):
                continue
            count = rows if size is None else size
            out[metric] = (value * count, count)
        for metric, value in whole.items():  # telescoped: the evaluation's sum is the epoch's
            if not math.isfinite(value):
                continue
            total = value * epoch.rows
            out[metric] = (total - epoch.reported.get(metric, 0.0), rows)
            epoch.reported[metric] = total
        return out

    def save_state(folder: Any, objects: dict) -> None:
        model, opt, sched = objects["model"], objects["optimizer"], objects.get("scheduler")
        run = run_of(_unwrap(model), opt)
        checkpoint = {"epoch": run.current_epoch, "global_step": run.global_step,
                      "loops": {"pilot": {"examples_seen": run.examples_seen,
                                          "batch_idx": run.batch_idx}},
                      "state_dict": model.state_dict(),
                      "optimizer_states": [opt.state_dict()] if opt is not None else [],
                      "lr_schedulers": [sched.state_dict()] if sched is not None else []}
        with hooks(_unwrap(model), run, "train"):
            _call("on_save_checkpoint", model.on_save_checkpoint, checkpoint)
        torch.save(checkpoint, Path(folder) / CHECKPOINT)

    def restore_state(folder: Any, objects: dict) -> None:
        model, opt, sched = objects["model"], objects["optimizer"], objects.get("scheduler")
        module = _unwrap(model)
        try:
            checkpoint = torch.load(Path(folder) / CHECKPOINT, weights_only=True)
        except Exception as exc:
            raise WorkbookError(f"{CHECKPOINT} does not load with weights_only=True: "
                                f"{reason(exc)}", "keep what on_save_checkpoint adds to "
                                "tensors, numbers, strings, lists and dicts") from exc
        run = run_of(module, opt)
        with hooks(module, run, "train"):
            _call("on_load_checkpoint", model.on_load_checkpoint, checkpoint)
        model.load_state_dict(checkpoint["state_dict"])
        VALIDATION.pop(module, None)
        pilot = checkpoint.get("loops", {}).get("pilot", {})
        step = getattr(objects.get("step"), "value", None)  # a StepCount; None until restored
        run.global_step = int(checkpoint.get("global_step", step or 0))
        run.examples_seen = int(pilot.get("examples_seen", 0))
        run.batch_idx = int(pilot.get("batch_idx", 0))
        run.started = run.global_step > 0
        if opt is None:  # a model-only restore (06 evaluates a saved trial)
            return
        if not checkpoint.get("optimizer_states"):
            raise WorkbookError("the checkpoint holds no optimizer state after "
                                "on_load_checkpoint (Lightning: 'Trying to restore optimizer "
                                "state but checkpoint contains only the model')",
                                "keep checkpoint['optimizer_states'] in on_load_checkpoint")
        opt.load_state_dict(checkpoint["optimizer_states"][0])
        if sched is not None and checkpoint.get("lr_schedulers"):
            sched.load_state_dict(checkpoint["lr_schedulers"][0])

    sampler = loaders["train"].sampler
    own_order = not isinstance(sampler, (torch.utils.data.RandomSampler,
                                         torch.utils.data.SequentialSampler))

    def make_sampler(n: int, seed: int) -> Any:
        """The train loader's own sampler, seeded, when the pilot trains on the whole train
        set; on a subset (--smoke, train_limit) the pilot's own seeded order."""
        if n != len(train_set):
            return None
        own = copy.deepcopy(sampler)
        if isinstance(getattr(own, "generator", None), torch.Generator):
            own.generator = torch.Generator().manual_seed(seed)
        elif isinstance(getattr(own, "seed", None), int):
            own.seed = seed
        return own

    evaluates = type(probe).validation_step is not pl.LightningModule.validation_step or \
        ends_epoch
    task = dataclasses.replace(
        base, train_step=train_step, eval_step=eval_step if evaluates else None,
        build_optimizer=build_optimizer, build_scheduler=SCHEDULES.get, save_state=save_state,
        restore_state=restore_state, make_sampler=make_sampler if own_order else None,
        lr=task_fields.get("lr", own_lr))
    # which Trainer values the module read differ from what the campaign's Trainer will have
    # ({attribute: the pilot's value and why}), filled as the module reads them
    task.campaign_differs_in = differs
    return task
