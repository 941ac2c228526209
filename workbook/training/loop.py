"""The one training loop. Overfit, gates, variants, studies and resume all call `train`."""

from __future__ import annotations

import functools
import random
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from ..base.errors import WorkbookError
from ..base.progress import progress_bar
from ..contract import run as run_context
from ..contract.data import (
    Batch,
    Item,
    collate_items,
    encode_example,
    epoch_order,
    epoch_updates,
    loader,
)
from ..contract.pipeline import DataPosition, Pipeline
from ..contract.run import DEFAULT_UPDATES, EXAMPLE_WEIGHT, RunLength, current_run  # noqa: F401
from ..contract.shape import UpdateShape
from ..contract.state import Carry, carrying
from ..contract.task import Task, own_code
from ..storage import schemas
from ..storage.records import EvalRecord, StepRecord
from ..storage.schemas import Count, Index, NonNegative, Positive, Seed, StrictBool, StrictStr
from .devices import PRECISIONS, check_precision, resolve_device
from .evaluation import evaluate, target_count
from .update_failure import update_failure

FIX = "give each field a value of the type and range TrainConfig's annotation of it declares"


@dataclass
class TrainConfig:
    """How to train: the shape of an update, the budget, evaluation and the device."""

    shape: UpdateShape = UpdateShape(micro_batch=2, accumulation=8)
    updates: Count = DEFAULT_UPDATES  # optimizer steps in the budget
    lr: Positive = 1e-3
    warmup_updates: Index = 0  # linear warm-up, then constant
    seed: Seed = 0
    device: StrictStr = "auto"  # "cpu", "cuda" or "auto"
    eval_every: Index = 0  # evaluate every N updates (0: never); steps, never seconds
    eval_batch: Count = 32
    drop_partial: StrictBool = False  # leave out the examples that do not fill a whole update
    grad_clip: NonNegative | None = None  # max gradient norm (0: no clipping, the norm still
    # recorded; None: the task's own grad_clip)
    workers: Index = 0  # DataLoader worker processes
    encode_each_pass: StrictBool = True  # encode the raw examples in the loader on every pass
    progress: StrictBool = False  # show a tqdm bar
    own_step: StrictBool = True  # run the task's train_step (its clipping, not grad_clip) if
    # it has one
    pipeline: StrictBool = False  # draw from the task's train_pipeline (its workers: `workers`)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """A configuration stored as a dict (a checkpoint's recipe) back, checked; a recipe
        written before the shape was one field (flat micro_batch, ...) reads too."""
        return schemas.built(cls, UpdateShape.nested(data), "training configuration", FIX)

    def validate(self, n_train: int | None = None) -> "TrainConfig":
        """The configuration, its fields checked by their types, then against the `n_train`
        training examples and the device (a WorkbookError naming each problem)."""
        schemas.checked(self, "training configuration", FIX, lambda: self._conflicts(n_train))
        check_precision(self.shape.precision, resolve_device(self.device))
        return self

    def _conflicts(self, n_train: int | None) -> list[tuple[str, str]]:
        """What the shape cannot do with `n_train` training examples, each with its fix."""
        shape, found = self.shape, []
        if n_train is not None and shape.micro_batch > n_train:
            found.append((f"micro_batch {shape.micro_batch} is larger than the {n_train} "
                          "training examples", "lower micro_batch or give the task more "
                          "examples"))
        per_process = shape.micro_batch * shape.accumulation
        if n_train is not None and self.drop_partial and n_train < per_process:
            found.append((f"with drop_partial, one update needs {per_process} examples but "
                          f"there are {n_train}", "lower micro_batch x accumulation or keep "
                          "partial"))
        return found


@dataclass
class TrainResult:
    """What a training run leaves: the model and optimizer, one record per update and eval."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    stop_reason: str = ""  # why the run stopped before its budget ("" when it did not)
    averaged: nn.Module | None = None  # the task's averaged model (Task.averaged_model)


class HeldBehaviour:
    """While active, every module of the model stays in eval behaviour whatever mode the
    task's own code sets (`model.train()` included): dropout draws nothing and batch norm uses
    and keeps its running statistics, so two runs of the same code over the same examples
    differ only by how they are split. `asked` lists the modes the code asked for."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.asked: list[bool] = []

    def __enter__(self) -> "HeldBehaviour":
        self.modes = {m: m.training for m in self.model.modules()}
        # a train() the task set on an instance (an override of its own) comes back after
        self.own_train = {m: vars(m)["train"] for m in self.modes if "train" in vars(m)}
        for m in self.modes:
            m.training = False
            # an instance attribute: Module.train (and eval) recurses through these
            m.train = functools.partial(self._asked, m)
        return self

    def _asked(self, module: nn.Module, mode: bool = True) -> nn.Module:
        if module is self.model:
            self.asked.append(bool(mode))
        return module

    def __exit__(self, *exc: Any) -> None:
        for m, mode in self.modes.items():
            del m.train
            if m in self.own_train:
                m.train = self.own_train[m]
            m.training = mode

    @property
    def sets_train_mode(self) -> bool:
        """Whether the code it held called model.train() (last asked mode True)."""
        return bool(self.asked) and self.asked[-1]


def loss_of(returned: Any, piece: str = "train_step") -> float:
    """The loss a task's own step returned: a tensor, a float, or a dict with "loss"."""
    value = returned.get("loss") if isinstance(returned, dict) else returned
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        shown = (f"a dict with keys {sorted(returned)[:6]}" if isinstance(returned, dict)
                 else type(returned).__name__)
        raise WorkbookError(f"the task's {piece} returned {shown}, not the update's loss",
                            "return the update's loss: a 0-d tensor, a float, or a dict "
                            'with "loss" (the loop records it every update)') from None


DIVERGENCE_WINDOW = 5  # updates whose median is compared: one hard micro-batch is no divergence
RUNAWAY_MULTIPLE = 1e3  # a rise this large over the first update is divergence at once


def loss_rise(losses: list[float], multiple: float = 3.0) -> str:
    """Why a run's losses diverged, in numbers ("" when they did not): the median of the last
    DIVERGENCE_WINDOW updates above `multiple` x the median of the first DIVERGENCE_WINDOW
    (per-update losses of small regression updates vary 40x between batches, so neither end
    is one update), or above RUNAWAY_MULTIPLE x the first update's (a learning rate 1e6 too
    large explodes before any window fills). Non-finite values are the caller's to judge."""
    window = DIVERGENCE_WINDOW
    if len(losses) < 3 or not losses[0] > 0:
        return ""
    recent = statistics.median(losses[-window:])
    if recent > RUNAWAY_MULTIPLE * losses[0]:
        return (f"median loss of the last {min(len(losses), window)} updates {recent:.3g} "
                f"above {RUNAWAY_MULTIPLE:g} x the first update's {losses[0]:.3g}")
    if len(losses) < 2 * window:
        return ""
    start = statistics.median(losses[:window])
    if recent > multiple * start:
        return (f"median loss of the last {window} updates {recent:.3g} above {multiple:g} x "
                f"the median of the first {window}, {start:.3g}")
    return ""


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from one number."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _repeated_block(module: nn.Module) -> bool:
    return getattr(module, "_workbook_block", False)


def apply_activation_checkpointing(task: Task, model: nn.Module) -> int:
    """Wrap the task's blocks (default: every element of an nn.ModuleList) with PyTorch's
    non-reentrant activation checkpointing. Returns how many blocks were wrapped."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    if task.checkpoint_blocks is None and getattr(model, "supports_gradient_checkpointing", False):
        # a Hugging Face model: its own switch also turns the KV cache off in training, which
        # recomputed blocks would otherwise append to (60 keys against 30 queries)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return sum(1 for m in model.modules() if getattr(m, "gradient_checkpointing", False))
    check = task.checkpoint_blocks
    if check is None:
        for lst in model.modules():
            if isinstance(lst, nn.ModuleList):
                for block in lst:
                    block._workbook_block = True
        check = _repeated_block
    wrapped = [m for m in model.modules() if check(m)]
    if not wrapped:
        raise WorkbookError(f"activation checkpointing found no blocks in {type(model).__name__}",
                            "set Task.checkpoint_blocks to a function that picks the blocks")
    cw.apply_activation_checkpointing(model, check_fn=check)
    return len(wrapped)


@dataclass
class Stepper:
    """One update's machinery, shared by the loop, the gates and the memory prediction."""

    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    precision: str = "fp32"
    grad_clip: float = 1.0
    scaler: torch.amp.GradScaler | None = None
    sampler: Any = None  # the task's own data order (make_sampler), made by `train`
    carry: Carry | None = None  # the task's carried state between batches (Task.state)
    averaged: nn.Module | None = None  # the task's averaged model (Task.averaged_model)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, summed loss, number of targets) of one micro-batch, in the chosen precision."""
        dtype = PRECISIONS[self.precision]
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            logits = self.task.forward(self.model, batch.tensors)
        return (logits, *self.task.loss(logits, batch.tensors))

    def backward(self, loss_sum: torch.Tensor) -> None:
        (self.scaler.scale(loss_sum) if self.scaler is not None else loss_sum).backward()

    def normalise(self, targets: int) -> None:
        """Divide the accumulated gradients by the targets of the whole update (after unscaling
        them once, when a GradScaler is in use)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / targets)

    def accumulate(self, batches: Iterable[Batch],
                   targets: int | None = None) -> tuple[torch.Tensor, int]:
        """Forward and backward every micro-batch of one update with summed losses, then
        normalise by the number of targets of the WHOLE update, so 1 x 16, 2 x 8 and 16 x 1
        agree. Returns (summed loss, targets). `targets` may be given (fake-tensor prediction).
        """
        loss_sum = torch.zeros((), device=self.device)
        counted = 0  # a count may be a float (weighted targets); read only when not given
        for batch in batches:
            _, summed, count = self.forward_loss(batch.to(self.device))
            self.backward(summed)
            loss_sum += summed.detach().float()
            counted = counted + count  # stays a tensor: fake tensors have no value to read
        n = target_count(float(counted)) if targets is None else targets
        if n == 0:
            raise WorkbookError("an update had no contributing targets (every label is -100)",
                                "check truncation and label masking with notebook 01")
        self.normalise(n)
        return loss_sum, n

    def own_update(self, batches: list[Batch]) -> tuple[float, int | float, float]:
        """One update by the task's own `train_step` (its forward, loss, accumulation, clipping
        and optimizer step) in the configured precision; the schedule then advances as after
        the workbook's update. Returns (the loss it returned, the update's targets, the gradient
        norm it stepped with - read by an optimizer hook, the task's code is not changed)."""
        moved = [b.to(self.device) for b in batches]
        watch = StepWatch(self.optimizer)
        dtype = PRECISIONS[self.precision]
        try:
            with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                returned = own_code("train_step", self.task.train_step, self.model,
                                    self.optimizer, [b.tensors for b in moved],
                                    receives="(model, optimizer, [batch dict per micro-batch])")
        finally:
            watch.remove()
        if watch.steps != 1:
            raise WorkbookError(f"the task's train_step called optimizer.step() {watch.steps} "
                                f"times for one update of {len(batches)} micro-batches",
                                "step once per update, after the last micro-batch")
        loss = loss_of(returned)
        if self.task.schedule_per_update:
            self.scheduler.step()
        # the targets as the workbook counts them (examples, for a task without labels)
        targets = sum(self.task.target_count(b.tensors["labels"]) if "labels" in b.tensors
                      else len(b.ids) for b in batches)
        return loss, targets, watch.norm

    def step(self) -> torch.Tensor:
        """Clip, step (through the scaler when present), advance the schedule, clear grads."""
        norm = nn.utils.clip_grad_norm_(self.params, self.grad_clip or float("inf"))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.task.schedule_per_update:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def pass_begins(self, epoch: int) -> None:
        """A pass over the data starts: every carried stream starts again, and a schedule
        stepped per pass (`Task.scheduler_interval`) steps for the pass that ended."""
        if self.carry is not None:
            self.carry.reset()
        if epoch > 0 and not self.task.schedule_per_update:
            with warnings.catch_warnings():  # a resume at a pass's start steps the restored
                # schedule before this process's first optimizer.step(): in order, not a bug
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                self.scheduler.step()

    def update_averaged(self, step: int) -> None:
        """The averaged model takes in the model after every `Task.average_every`-th update."""
        if self.averaged is not None and step % self.task.average_every == 0:
            self.averaged.update_parameters(self.model)


def runs_own_step(task: Task, cfg: TrainConfig) -> bool:
    """Whether a run with this configuration makes its updates with the task's train_step."""
    return task.train_step is not None and cfg.own_step


def update_by(task: Task, cfg: TrainConfig) -> str:
    """Whose code makes each update of a run with this configuration, for summaries."""
    return "the task's train_step" if runs_own_step(task, cfg) else "the workbook's update"


class StepWatch:
    """Counts the optimizer steps taken while it is registered and reads the gradient norm just
    before each: a pre-step hook on the optimizer that really steps - a wrapper's wrapped one
    followed through `.optimizer` (Accelerate's `AcceleratedOptimizer`, which steps it only when
    the gradients are synchronised), else its own `step` wrapped on the instance (a wrapper
    without hooks or a wrapped optimizer). `remove()` puts everything back."""

    def __init__(self, optimizer: Any):
        self.steps, self.norm = 0, float("nan")
        stepping = optimizer
        while isinstance(getattr(stepping, "optimizer", None), torch.optim.Optimizer):
            stepping = stepping.optimizer
        if hasattr(stepping, "_optimizer_step_pre_hooks"):
            self.remove = stepping.register_step_pre_hook(self._before).remove
            return
        had, original = "step" in vars(stepping), stepping.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._before(stepping, args, kwargs)
            return original(*args, **kwargs)

        def remove() -> None:
            if had:
                stepping.step = original
            else:
                del stepping.step
        stepping.step, self.remove = step, remove

    @torch.no_grad()
    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        self.norm = float(nn.utils.get_total_norm(grads)) if grads else 0.0


def build_stepper(task: Task, cfg: TrainConfig, model: nn.Module | None = None,
                  examples: int | None = None) -> Stepper:
    """Model (built with the config's seed unless given), optimizer, schedule and scaler; the
    task's factories see the run's length through `current_run()` (`examples`: its data)."""
    device = resolve_device(cfg.device)
    check_precision(cfg.shape.precision, device)
    if model is None:
        seed_everything(cfg.seed)
        with device:  # built in place: no copy, and fake tensors need no conversion
            model = task.build_model()
    if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
        model = model.to(device)
    if cfg.shape.activation_checkpointing:
        apply_activation_checkpointing(task, model)
    model.train()
    token = run_context.building(RunLength(cfg.updates, cfg.shape, examples, cfg.drop_partial))
    try:
        optimizer = task.optimizer(model, cfg.lr)
        scheduler = task.build_scheduler(optimizer) if task.build_scheduler else None
    finally:
        run_context.done(token)
    for group in optimizer.param_groups:  # lr=None (Adafactor's relative_step): the run's
        if group.get("lr") is None:  # rate, to schedule and record; such an optimizer ignores it
            group["lr"] = cfg.lr
    warmup = max(cfg.warmup_updates, 0)
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    scaler = torch.amp.GradScaler(device.type) if cfg.shape.precision == "fp16" else None
    clip = task.grad_clip if cfg.grad_clip is None else cfg.grad_clip
    return Stepper(task, model, optimizer, scheduler, device, cfg.shape.precision, clip or 0.0,
                   scaler, carry=Carry(task.state) if task.state is not None else None)


def averaged_model(task: Task, model: nn.Module) -> nn.Module | None:
    """The task's averaged model of `model` (None without one), built once per run by `train`
    or by a resume before its checkpoint loads - not by the phase gates and the prediction,
    which size the update without it; anything without `update_parameters(model)` is refused
    with the fix."""
    if task.averaged_model is None:
        return None
    averaged = own_code("averaged_model", task.averaged_model, model,
                        receives="the model and returns its averaged copy, e.g. "
                        "AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))")
    if not isinstance(averaged, nn.Module) or not callable(
            getattr(averaged, "update_parameters", None)):
        raise WorkbookError(f"the task's averaged_model returned a {type(averaged).__name__}, "
                            "not a module with update_parameters(model)",
                            "return torch.optim.swa_utils.AveragedModel(model, ...) or a "
                            "subclass (torchvision's ExponentialMovingAverage)")
    return averaged


@dataclass(frozen=True)
class Position:
    """Where the data stream stands between updates: the pass and the next update in it.
    (Checkpoints are taken between updates, so no accumulation group is ever half done.)"""

    epoch: int = 0
    group: int = 0
    sampler_state: Any = None  # a task's own sampler: its state_dict at the start of the pass
    data: Any = None  # a task's train_pipeline: its DataPosition here (after the update)


def pass_order(sampler: Any, n: int, seed: int, epoch: int) -> tuple[list[int], Any]:
    """The example order of one pass and the sampler state it started from: the workbook's
    order is a pure function of (seed, epoch); a task's own sampler gets `set_epoch(epoch)` when
    it has one, and its `state_dict()` (when it has one) is kept so a resume can rebuild the
    pass."""
    if sampler is None:
        return epoch_order(n, seed, epoch), None
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)
    state = sampler.state_dict() if callable(getattr(sampler, "state_dict", None)) else None
    order = [int(i) for i in sampler]
    wrong = [i for i in order if not 0 <= i < n]
    if wrong:
        raise WorkbookError(f"the task's sampler gave indices outside 0..{n - 1} (e.g. "
                            f"{wrong[:3]})", "make_sampler(n, seed) must yield indices of the "
                            "n training examples")
    return order, state


def make_sampler(task: Task, n: int, seed: int) -> Any:
    """The task's own sampler for `n` training examples (None without make_sampler); a task
    carrying state across batches without one is read in order, as a TBPTT loop reads its
    streams position by position."""
    if task.make_sampler is None:
        return range(n) if task.state is not None else None
    return own_code("make_sampler", task.make_sampler, n, seed, receives="(n, seed)")


def _updates(task: Task, items: list[Item], cfg: TrainConfig, start: Position = Position(),
             sampler: Any = None):
    """Endless stream of (position of the update, [micro-batches]), pass after pass. The order
    of a pass is rebuilt exactly on resume (`pass_order`), and the updates already done are
    skipped without loading their data."""
    epoch, skip = start.epoch, start.group
    if sampler is not None and start.sampler_state is not None:
        if not callable(getattr(sampler, "load_state_dict", None)):
            raise WorkbookError("the task's sampler has state_dict but no load_state_dict: a "
                                "resumed run cannot restore its order",
                                "give the sampler load_state_dict(state)")
        sampler.load_state_dict(start.sampler_state)
    while True:
        order, state = pass_order(sampler, len(items), cfg.seed, epoch)
        groups = epoch_updates(order, cfg.shape.micro_batch, cfg.shape.accumulation,
                               cfg.drop_partial)[skip:]
        batches = iter(loader(task, items, [mb for g in groups for mb in g], cfg.workers,
                              seed=cfg.seed * 100_003 + epoch, encode=cfg.encode_each_pass))
        for index, group in enumerate(groups, start=skip):
            yield Position(epoch, index, state), [next(batches) for _ in group]
        epoch, skip = epoch + 1, 0


def _pipeline_updates(task: Task, cfg: TrainConfig, start: Position, pipe: Pipeline):
    """Endless stream of (the update's position, with the pipeline's data position after it;
    [micro-batches]) read from the task's pipeline: `micro_batch x accumulation` examples an
    update, encoded and collated here; a pass that ends mid-update closes a partial update
    (dropped with `drop_partial`). Nothing of the next pass is read before an update ends, so
    the position is never read ahead."""
    per_update, micro = cfg.shape.examples_per_update, cfg.shape.micro_batch
    examples = pipe.read(start.data if start.data is not None else DataPosition())
    group, pending = start.group, []
    while True:
        pass_of, _, example = next(examples)
        if example is not None:
            pending.append(encode_example(task, example))
        if len(pending) == per_update or (example is None and pending and not cfg.drop_partial):
            batches = [collate_items(task, pending[i:i + micro], training=True)
                       for i in range(0, len(pending), micro)]
            yield Position(pass_of, group, None, pipe.position()), batches
            group, pending = group + 1, []
        if example is None:  # the pass ended
            group, pending = 0, []


def train(task: Task, items: list[Item], cfg: TrainConfig, *, model: nn.Module | None = None,
          val_items: list[Item] | None = None,
          on_update: Callable[[StepRecord, Stepper, Position], str | None] | None = None,
          on_eval: Callable[[EvalRecord, Stepper], None] | None = None,
          stepper: Stepper | None = None, start: Position = Position(),
          first_step: int = 1, pipeline: Pipeline | None = None) -> TrainResult:
    """Train until update `cfg.updates` and return the model with one record per update.
    `on_update` sees each update with the machinery and the data position after it, and may
    return a reason to stop early (divergence); `on_eval` sees every evaluation (checkpoints).
    A resumed run passes its restored `stepper`, data `start` and `first_step`; with
    `pipeline` (the task's train_pipeline opened) the updates are read from it, not `items`."""
    if cfg.shape.replicas != 1:
        raise WorkbookError(f"train runs one process; this update shape has "
                            f"{cfg.shape.replicas} replicas",
                            "run replicas with notebook 09 (workbook.parallel), or set "
                            "replicas=1 here")
    examples = None if pipeline is not None else len(items)
    cfg.validate(examples)
    own = runs_own_step(task, cfg)
    if own:  # only here: the phase gates and the prediction size the workbook's update
        check_precision(cfg.shape.precision, resolve_device(cfg.device), task)
    stepper = stepper if stepper is not None else build_stepper(task, cfg, model, examples)
    if stepper.sampler is None and pipeline is None:
        stepper.sampler = make_sampler(task, len(items), cfg.seed)
    if stepper.averaged is None:
        stepper.averaged = averaged_model(task, stepper.model)
    result = TrainResult(stepper.model, stepper.optimizer, config=asdict(cfg),
                         averaged=stepper.averaged)
    stream = (_pipeline_updates(task, cfg, start, pipeline) if pipeline is not None else
              _updates(task, items, cfg, start, stepper.sampler))
    bar = progress_bar(total=cfg.updates, initial=first_step - 1, disable=not cfg.progress,
               desc=f"lr {cfg.lr:g} seed {cfg.seed}")  # says which trial of a study runs
    for step in range(first_step, cfg.updates + 1):
        begin = time.perf_counter()
        position, batches = next(stream)
        data_s = time.perf_counter() - begin
        if position.group == 0:
            stepper.pass_begins(position.epoch)
        lr = stepper.optimizer.param_groups[0]["lr"]
        try:
            with carrying(stepper.carry):
                if own:
                    loss, targets, norm = stepper.own_update(batches)
                else:
                    loss_sum, targets = stepper.accumulate(batches)
                    norm = stepper.step()
                    loss = float(loss_sum) / targets
        except (ValueError, RuntimeError, WorkbookError) as exc:
            named = update_failure(exc, task, batches, examples, cfg.shape)
            if named is None:
                raise
            raise named from exc
        stepper.update_averaged(step)
        ids = [i for b in batches for i in b.ids]
        record = StepRecord(step, position.epoch, len(batches), len(ids), targets, loss, lr,
                            float(norm), time.perf_counter() - begin, data_s, ids)
        result.steps.append(record)
        after = Position(position.epoch, position.group + 1, position.sampler_state,
                         position.data)
        reason = on_update(record, stepper, after) if on_update is not None else None
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if reason:
            result.stop_reason = reason
            break
        if val_items and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.updates):
            record = evaluate(task, stepper.model, val_items, cfg.eval_batch, stepper.device,
                              step, cfg.shape.precision, averaged=stepper.averaged)
            result.evals.append(record)
            if on_eval is not None:
                on_eval(record, stepper)
    bar.close()
    return result
