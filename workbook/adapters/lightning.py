"""`from_lightning`: a `LightningModule` factory and its `LightningDataModule` as a Task, run as
`Trainer.fit` would run them - the module's own `training_step` (its loss divided by the number
of micro-batches, as `accumulate_grad_batches` does), `configure_optimizers` (one optimizer; its
scheduler stepped per update or per pass as the task's `build_scheduler`), `validation_step`
with what it logs (weighted by the logged `batch_size`, as Lightning's epoch means are),
`on_save_checkpoint`/`on_load_checkpoint` around a Lightning-shaped checkpoint, and the
datamodule's datasets and `collate_fn`. Needs `lightning` (`pip install -e .[lightning]`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import WorkbookError, reason
from ..loop import EXAMPLE_WEIGHT
from ..task import Task
from .torch import LABELS, from_torch

CHECKPOINT = "lightning.ckpt"
SCALED = ("lr", "initial_lr", "max_lr", "min_lr")  # group keys a scheduler reads its rate from


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
    """One of the module's own methods; a failure names it (and the Trainer it reached for)."""
    try:
        return fn(*args)
    except WorkbookError:
        raise
    except Exception as exc:
        text = reason(exc, 300)
        fix = ("it reached for self.trainer, which the pilot does not build: read what it "
               "needs from the module's own attributes (hparams)" if "Trainer" in text
               else f"fix {piece}")
        raise WorkbookError(f"the module's {piece} failed: {text}", fix) from exc


@contextlib.contextmanager
def _logged(module: nn.Module):
    """What `self.log` / `self.log_dict` record during one call: {name: (value, batch_size)}."""
    seen: dict[str, tuple[float, int | None, str]] = {}

    def log(name, value, *args, batch_size=None, reduce_fx="mean", **kwargs):
        value = value.detach() if isinstance(value, torch.Tensor) else value
        seen[name] = (float(value), batch_size, str(reduce_fx))

    def log_dict(values, *args, batch_size=None, reduce_fx="mean", **kwargs):
        for name, value in dict(values).items():
            log(name, value, batch_size=batch_size, reduce_fx=reduce_fx)

    module.log, module.log_dict = log, log_dict
    try:
        yield seen
    finally:
        del module.log, module.log_dict


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


@dataclasses.dataclass
class _Schedule:
    """The scheduler `configure_optimizers` returned, stepped as Lightning steps it: every
    `frequency` updates (`interval` "step") or passes over the train set ("epoch"). The
    workbook steps it once per update; `train_step` counts the examples each update saw."""

    scheduler: Any
    interval: str
    frequency: int
    examples_per_pass: int = 1
    examples_seen: int = 0
    updates: int = 0
    pending: int = 0  # examples of the update just made, counted by train_step

    def step(self) -> None:
        passes = self.examples_seen // self.examples_per_pass
        self.updates += 1
        self.examples_seen += self.pending
        self.pending = 0
        due = [self.updates] if self.interval == "step" else \
            range(passes + 1, self.examples_seen // self.examples_per_pass + 1)
        for count in due:
            if count % self.frequency == 0:
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


def from_lightning(module_factory: Callable[[], nn.Module], datamodule: Any, *, name: str,
                   criterion: Any = None, kind: str = "classification",
                   fields: Sequence[str] | None = None,
                   group_of: Callable[[int, Any], Any] | None = None,
                   gradient_clip_val: float | None = None, **task_fields: Any) -> Task:
    """A Task that runs a LightningModule as `Trainer.fit` would. `module_factory()` builds the
    module; `datamodule` gives the train and validation datasets and the train loader's
    `collate_fn` (its `prepare_data` and `setup("fit")` are called). `criterion` is the loss
    the pilot's own checks (01-03) compute per target, as in `from_torch` (None for
    generation: the task's token cross-entropy; pass `decode`); 04 checks it against what
    `training_step` returns. `gradient_clip_val` is the Trainer's. Other Task fields pass
    through (`lr` defaults to the one configure_optimizers sets)."""
    pl = _lightning()
    try:
        with torch.device("meta"):
            probe = module_factory()
    except Exception as exc:
        raise WorkbookError(f"the module factory failed on the meta device: {reason(exc)}",
                            "pass a factory that builds the module (no download, no data "
                            "inside it)") from exc
    if not isinstance(probe, pl.LightningModule):
        raise WorkbookError(f"the module factory builds a {type(probe).__name__}, not a "
                            "LightningModule", "pass the LightningModule class or a factory; "
                            "a plain nn.Module goes to from_torch")
    if not probe.automatic_optimization:
        raise WorkbookError("the module sets automatic_optimization = False (manual "
                            "optimization steps its optimizers inside training_step)",
                            "write a workbook.Task with a train_step that does what it does")
    optimizer, schedule = _optimizer_and_schedule(
        _call("configure_optimizers", probe.configure_optimizers))
    # the rate configured, before a warm-up scheduler lowered it
    own_lr = float(schedule.scheduler.base_lrs[0] if schedule is not None and hasattr(
        schedule.scheduler, "base_lrs") else optimizer.param_groups[0]["lr"])

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
    tuple_items = len(train_set) and not isinstance(train_set[0], dict)
    if loaders["train"].batch_sampler is not None and type(
            loaders["train"].batch_sampler) is not torch.utils.data.BatchSampler:
        raise WorkbookError(f"the train loader batches with its own "
                            f"{type(loaders['train'].batch_sampler).__name__}",
                            "the pilot makes the micro-batches: give the loader a batch_size "
                            "(and a sampler for the order) instead of a batch_sampler")

    base = from_torch({s: loader.dataset for s, loader in loaders.items()}, module_factory,
                      criterion, name=name, kind=kind, fields=fields, group_of=group_of,
                      collate_fn=loaders["train"].collate_fn, **task_fields)
    inputs = base.model_inputs

    def users(batch: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> Any:
        """The batch as the user's collate made it: their tuple or dict, real rows only."""
        rows = {k: v if keep is None else v[keep] for k, v in batch.items()
                if k != EXAMPLE_WEIGHT}
        return tuple(rows[k] for k in (*inputs, LABELS)) if tuple_items else rows

    def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
        module = getattr(model, "module", model)  # 09 passes it inside DistributedDataParallel
        opt, sched = _optimizer_and_schedule(_call("configure_optimizers",
                                                   module.configure_optimizers))
        if lr != own_lr:
            _rescale(opt, sched, lr / own_lr)
        if sched is not None:
            sched.examples_per_pass = max(len(train_set), 1)
            SCHEDULES[opt] = sched
        return opt

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, micro_batches: list) -> Any:
        total = 0.0
        with _logged(model):
            for i, batch in enumerate(micro_batches):
                loss = _loss_of(_call("training_step", model.training_step, users(batch), i))
                (loss / len(micro_batches)).backward()  # as accumulate_grad_batches divides
                total += float(loss.detach())
        if gradient_clip_val:
            nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = SCHEDULES.get(opt)
        if sched is not None:
            sched.pending = sum(len(b[LABELS]) for b in micro_batches)
        return total / len(micro_batches)

    def eval_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, tuple]:
        weight = batch.get(EXAMPLE_WEIGHT)
        keep = weight > 0 if weight is not None else None  # Lightning's last batch is short
        rows = int(keep.sum()) if keep is not None else len(batch[LABELS])
        was = model.training  # Lightning's validation loop: eval mode, no grad, then back
        model.eval()
        try:
            with _logged(model) as seen, torch.no_grad():
                returned = _call("validation_step", model.validation_step,
                                 users(batch, keep), 0)
        finally:
            model.train(was)
        if not seen and isinstance(returned, torch.Tensor) and returned.dim() == 0:
            seen["val_loss"] = (float(returned), None, "mean")
        if not seen:
            raise WorkbookError("validation_step logs nothing and returns no loss",
                                "self.log('val_loss', loss) in validation_step, as Lightning's "
                                "checkpointing and early stopping need")
        out = {}
        for metric, (value, size, reduce_fx) in seen.items():
            if reduce_fx != "mean" or not math.isfinite(value):
                continue
            count = rows if size is None else size
            out[metric] = (value * count, count)
        return out

    def save_state(folder: Any, objects: dict) -> None:
        model, opt, sched = objects["model"], objects["optimizer"], objects.get("scheduler")
        checkpoint = {"state_dict": model.state_dict(),
                      "optimizer_states": [opt.state_dict()] if opt is not None else [],
                      "lr_schedulers": [sched.state_dict()] if sched is not None else []}
        _call("on_save_checkpoint", model.on_save_checkpoint, checkpoint)
        torch.save(checkpoint, Path(folder) / CHECKPOINT)

    def restore_state(folder: Any, objects: dict) -> None:
        model, opt, sched = objects["model"], objects["optimizer"], objects.get("scheduler")
        try:
            checkpoint = torch.load(Path(folder) / CHECKPOINT, weights_only=True)
        except Exception as exc:
            raise WorkbookError(f"{CHECKPOINT} does not load with weights_only=True: "
                                f"{reason(exc)}", "keep what on_save_checkpoint adds to "
                                "tensors, numbers, strings, lists and dicts") from exc
        _call("on_load_checkpoint", model.on_load_checkpoint, checkpoint)
        model.load_state_dict(checkpoint["state_dict"])
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

    overridden = type(probe).validation_step is not pl.LightningModule.validation_step
    return dataclasses.replace(
        base, train_step=train_step, eval_step=eval_step if overridden else None,
        build_optimizer=build_optimizer, build_scheduler=SCHEDULES.get, save_state=save_state,
        restore_state=restore_state, make_sampler=make_sampler if own_order else None,
        lr=task_fields.get("lr", own_lr))
