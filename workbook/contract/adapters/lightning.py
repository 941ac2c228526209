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
loader yields them; a loader over an `IterableDataset` (a streaming dataset) is read in turn,
never indexed, its first item giving the structure. While the pilot calls the module's hooks,
`self.trainer` is a `PilotTrainer`: the Trainer attributes modules read, with the pilot's own
values (`campaign_differs_in` on the Task says which differ from the campaign's). Needs
`lightning` (`pip install -e .[lightning]`)."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from .. import kinds
from ..run import DEFAULT_UPDATES, EXAMPLE_WEIGHT
from ..task import Task
from .base import Adapter, rescale
from .lightning_batches import flat_items, model_inputs_of, shape_of
from .lightning_hooks import call_piece, fire, lightning
from .lightning_optimizers import (
    Schedule,
    optimizer_and_schedule,
    own_lr,
    stepped_per_pass_but_sized_per_update,
)
from .lightning_trainer import PilotFit
from .lightning_validation import Validation
from .torch import LABELS, Stream, from_torch, probe_on_meta, streams

CHECKPOINT = "lightning.ckpt"


def loss_of(returned: Any) -> torch.Tensor:
    """The loss a `training_step` returned (a tensor, or a dict's 'loss'), or what is wrong."""
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


def read_loaders(datamodule: Any) -> dict[str, torch.utils.data.DataLoader]:
    """The datamodule's train and validation loaders, after `prepare_data` and
    `setup("fit")`, as `Trainer.fit` gets them."""
    call_piece("prepare_data", datamodule.prepare_data)
    call_piece("setup", datamodule.setup, "fit")
    loaders = {}
    for split, method in (("train", "train_dataloader"), ("validation", "val_dataloader")):
        loader = call_piece(method, getattr(datamodule, method))
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise WorkbookError(f"{type(datamodule).__name__}.{method} returns a "
                                f"{type(loader).__name__}, not one DataLoader",
                                "return one torch DataLoader per split")
        loaders[split] = loader
    if loaders["train"].batch_sampler is not None and type(
            loaders["train"].batch_sampler) is not torch.utils.data.BatchSampler:
        raise WorkbookError(f"the train loader batches with its own "
                            f"{type(loaders['train'].batch_sampler).__name__}",
                            "the pilot makes the micro-batches: give the loader a batch_size "
                            "(and a sampler for the order) instead of a batch_sampler")
    return loaders


class LightningAdapter(Adapter):
    """A LightningModule factory and its LightningDataModule, read once; the Task's steps run
    them as `Trainer.fit` would (see `from_lightning`)."""

    def __init__(self, module_factory: Callable[[], nn.Module], datamodule: Any, *, name: str,
                 criterion: Any = None, kind: str = "classification",
                 fields: Sequence[str] | None = None,
                 group_of: Callable[[int, Any], Any] | None = None,
                 gradient_clip_val: float | None = None,
                 model_inputs: Sequence[str] | None = None, callbacks: Sequence[Any] = (),
                 **task_fields: Any):
        self.pl = lightning()
        self.module_factory, self.datamodule, self.name = module_factory, datamodule, name
        self.criterion, self.kind, self.group_of = criterion, kind, group_of
        self.callbacks = list(callbacks)
        self.task_fields = dict(task_fields)
        self.schedules: weakref.WeakKeyDictionary[torch.optim.Optimizer, Schedule] = \
            weakref.WeakKeyDictionary()
        self.read_datasets()
        self.fit = PilotFit(datamodule, self.loaders["validation"], gradient_clip_val,
                            self.pass_items, self.loader_batch)
        self.probe = self.read_module()
        self.read_batches(fields, model_inputs)
        ends_epoch = type(self.probe).on_validation_epoch_end is not \
            self.pl.LightningModule.on_validation_epoch_end
        self.validation = Validation(self, ends_epoch)
        self.evaluates = ends_epoch or type(self.probe).validation_step is not \
            self.pl.LightningModule.validation_step

    # -- reading the datasets ------------------------------------------------------------------

    def read_datasets(self) -> None:
        """The loaders and their datasets; an iterable dataset (a streaming one) is read in
        turn, never indexed."""
        self.loaders = read_loaders(self.datamodule)
        self.datasets = {split: Stream(loader.dataset, split) if streams(loader.dataset) else
                         loader.dataset for split, loader in self.loaders.items()}
        train_set = self.datasets["train"]
        self.streamed = isinstance(train_set, Stream)
        if not self.streamed and not len(train_set):
            raise WorkbookError("the train dataset has no items", "pass the data you train on")
        self.loader_batch = self.loaders["train"].batch_size or 1
        self.train_length = train_set.length() if self.streamed else len(train_set)
        # a pass when no run says: the train set, or a stream without a length: the default
        # run's
        self.pass_items = DEFAULT_UPDATES * self.loader_batch if self.train_length is None \
            else self.train_length

    def read_module(self) -> nn.Module:
        """The module built on the meta device, checked, and the learning rate its own
        configure_optimizers sets."""
        probe = probe_on_meta(self.module_factory, "module", "pass a factory that builds the "
                              "module (no download, no data inside it)")
        if not isinstance(probe, self.pl.LightningModule):
            raise WorkbookError(f"the module factory builds a {type(probe).__name__}, not a "
                                "LightningModule", "pass the LightningModule class or a "
                                "factory; a plain nn.Module goes to from_torch")
        if not probe.automatic_optimization:
            raise WorkbookError("the module sets automatic_optimization = False (manual "
                                "optimization steps its optimizers inside training_step)",
                                "write a workbook.Task with a train_step that does what it "
                                "does")
        with self.fit.hooks(probe, self.fit.run_of(probe), "train"):
            optimizer, schedule = optimizer_and_schedule(
                call_piece("configure_optimizers", probe.configure_optimizers))
        self.own_lr = own_lr(optimizer, schedule)
        return probe

    # -- the batch structure -------------------------------------------------------------------

    def read_batches(self, fields: Sequence[str] | None,
                     model_inputs: Sequence[str] | None) -> None:
        """The structure of the items and of the batches the train loader's collate makes,
        and the fields the pilot's own checks pass to the model."""
        train_set = self.datasets["train"]
        firsts = [it for _, it in islice(train_set.items(), 2)] if self.streamed else \
            [train_set[i] for i in range(min(2, len(train_set)))]
        self.item_shape = shape_of(firsts[0], fields, "the train dataset's item 0")
        self.user_collate = self.loaders["train"].collate_fn
        first = call_piece("collate_fn (the train loader's)", self.user_collate, firsts)
        self.batch_shape = shape_of(first, fields, "the train loader's batch")
        for shape, where in ((self.item_shape, "the train dataset's items"),
                             (self.batch_shape, "the train loader's batches")):
            if LABELS not in shape.names():
                raise WorkbookError(f"{where} have no field named 'labels' (fields "
                                    f"{shape.names()})", "name the target 'labels' in "
                                    "fields=, e.g. fields=('x', 'labels', 'w'), or key it "
                                    "'labels' in a dict")
        names = self.batch_shape.names()
        self.model_inputs = tuple(model_inputs) if model_inputs else model_inputs_of(
            self.probe, names, self.batch_shape.form == "dict")
        unknown = [n for n in self.model_inputs if n not in names]
        if unknown:
            raise WorkbookError(f"model_inputs names {unknown}, not fields of the batch "
                                f"({names})", "name fields of the collated batch")

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The pilot's flat items through the user's collate, flattened back."""
        made = self.user_collate([self.item_shape.build(it) for it in items])
        return self.batch_shape.flatten(made, "the collated batch")

    def users(self, batch: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> Any:
        """The batch as the user's collate made it: their tuple, dict or nesting, real rows
        only."""
        rows = {k: v[keep] if keep is not None and isinstance(v, torch.Tensor) and v.dim()
                and len(v) == len(keep) else v for k, v in batch.items() if k != EXAMPLE_WEIGHT}
        return self.batch_shape.build(rows)

    # -- the optimizer and schedule ------------------------------------------------------------

    def build_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """configure_optimizers for the run being built; its schedule sized to the run and its
        rates scaled to `lr`."""
        module = self.unwrap(model)
        # a validation left open ends before a new run
        self.validation.close(module, self.fit.run_of(module))
        run = self.fit.new_run(module)
        with self.fit.hooks(module, run, "train"):
            opt, sched = optimizer_and_schedule(call_piece("configure_optimizers",
                                                           module.configure_optimizers))
        self.fit.runs[opt] = run
        wrong = stepped_per_pass_but_sized_per_update(sched, run.length.updates, run.max_epochs)
        if wrong is not None:
            raise wrong
        if lr != self.own_lr:
            rescale(opt, sched.scheduler if sched is not None else None, lr / self.own_lr)
        if sched is not None:
            sched.examples_per_pass = max(self.train_length or run.pass_examples, 1)
            sched.estimated = run.length.updates
            self.schedules[opt] = sched
        return opt

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Schedule | None:
        return self.schedules.get(optimizer)

    # -- training ------------------------------------------------------------------------------

    def train_step(self, model: nn.Module, opt: torch.optim.Optimizer,
                   micro_batches: list) -> float:
        """One update as `Trainer.fit` makes it: training_step per micro-batch, its loss
        divided by their number (accumulate_grad_batches), the train hooks around it, the
        Trainer's gradient clipping, the optimizer step."""
        module, callbacks = self.unwrap(model), self.callbacks
        run = self.fit.run_of(module, opt)
        self.validation.close(module, run)  # Lightning ends a validation before training on
        total, count = 0.0, len(micro_batches)
        rows = sum(len(b[LABELS]) for b in micro_batches)
        with self.fit.hooks(module, run, "train"):
            if not run.started:
                run.started = True
                fire("on_fit_start", module, callbacks)
                fire("on_train_start", module, callbacks)
            if run.batch_idx == 0:
                fire("on_train_epoch_start", module, callbacks)
            for i, batch in enumerate(micro_batches):
                given, index = self.users(batch), run.batch_idx
                fire("on_train_batch_start", module, callbacks, given, index)
                returned = call_piece("training_step", module.training_step, given, index)
                loss = loss_of(returned)
                scaled = loss / count  # as accumulate_grad_batches divides
                fire("on_before_backward", module, callbacks, scaled)
                scaled.backward()
                fire("on_after_backward", module, callbacks)
                total += float(loss.detach())
                run.batch_idx += 1
                if i < count - 1:
                    fire("on_train_batch_end", module, callbacks, returned, given, index)
            fire("on_before_optimizer_step", module, callbacks, opt)
            if self.fit.gradient_clip_val:
                nn.utils.clip_grad_norm_(model.parameters(), self.fit.gradient_clip_val)
            opt.step()
            fire("on_before_zero_grad", module, callbacks, opt)
            opt.zero_grad(set_to_none=True)
            passes = run.current_epoch
            run.global_step += 1
            run.examples_seen += rows
            fire("on_train_batch_end", module, callbacks, returned, given, index)
            if run.current_epoch > passes:
                fire("on_train_epoch_end", module, callbacks)
                run.batch_idx = 0
        sched = self.schedules.get(opt)
        if sched is not None:
            sched.pending = rows
        return total / count

    def make_sampler(self, n: int, seed: int) -> Any:
        """The train loader's own sampler, seeded, when the pilot trains on the whole train
        set; on a subset (--smoke, train_limit) the pilot's own seeded order."""
        if n != len(self.datasets["train"]):
            return None
        own = copy.deepcopy(self.loaders["train"].sampler)
        if isinstance(getattr(own, "generator", None), torch.Generator):
            own.generator = torch.Generator().manual_seed(seed)
        elif isinstance(getattr(own, "seed", None), int):
            own.seed = seed
        return own

    @property
    def own_order(self) -> bool:
        """The train loader samples in its own order (not plain random or in sequence)."""
        return not self.streamed and not isinstance(
            self.loaders["train"].sampler, (torch.utils.data.RandomSampler,
                                             torch.utils.data.SequentialSampler))

    # -- checkpoints ---------------------------------------------------------------------------

    def save_state(self, folder: Any, objects: dict) -> None:
        """A Lightning-shaped checkpoint through on_save_checkpoint."""
        model, opt, sched = objects["model"], objects["optimizer"], objects.get("scheduler")
        run = self.fit.run_of(self.unwrap(model), opt)
        checkpoint = {"epoch": run.current_epoch, "global_step": run.global_step,
                      "loops": {"pilot": {"examples_seen": run.examples_seen,
                                          "batch_idx": run.batch_idx}},
                      "state_dict": model.state_dict(),
                      "optimizer_states": [opt.state_dict()] if opt is not None else [],
                      "lr_schedulers": [sched.state_dict()] if sched is not None else []}
        with self.fit.hooks(self.unwrap(model), run, "train"):
            call_piece("on_save_checkpoint", model.on_save_checkpoint, checkpoint)
        torch.save(checkpoint, Path(folder) / CHECKPOINT)

    def restore_state(self, folder: Any, objects: dict) -> None:
        """The checkpoint back through on_load_checkpoint: weights, the Trainer's counters, the
        optimizer and the schedule."""
        model, opt, sched = objects["model"], objects["optimizer"], objects.get("scheduler")
        module = self.unwrap(model)
        try:
            checkpoint = torch.load(Path(folder) / CHECKPOINT, weights_only=True)
        except Exception as exc:
            raise WorkbookError(f"{CHECKPOINT} does not load with weights_only=True: "
                                f"{reason(exc)}", "keep what on_save_checkpoint adds to "
                                "tensors, numbers, strings, lists and dicts") from exc
        run = self.fit.run_of(module, opt)
        with self.fit.hooks(module, run, "train"):
            call_piece("on_load_checkpoint", model.on_load_checkpoint, checkpoint)
        model.load_state_dict(checkpoint["state_dict"])
        self.validation.forget(module)
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

    # -- the task ------------------------------------------------------------------------------

    def task(self) -> Task:
        fields = dict(self.task_fields)
        own_loss, criterion, kind = fields.pop("loss", None), self.criterion, self.kind
        if own_loss is not None and criterion is None and not kinds.of(kind).per_position:
            criterion = nn.MSELoss() if kinds.of(kind).float_targets else nn.CrossEntropyLoss()
        item_shape, group_of = self.item_shape, self.group_of
        flat = {s: flat_items(data, item_shape, s) for s, data in self.datasets.items()}
        base = from_torch(flat, self.module_factory, criterion, name=self.name, kind=kind,
                          group_of=(lambda j, it: group_of(j, item_shape.build(it)))
                          if group_of else None, collate_fn=self.collate, **fields)
        task = dataclasses.replace(
            base, model_inputs=self.model_inputs,
            **({"loss": own_loss} if own_loss is not None else {}),
            train_step=self.train_step,
            eval_step=self.validation if self.evaluates else None,
            build_optimizer=self.build_optimizer, build_scheduler=self.build_scheduler,
            save_state=self.save_state, restore_state=self.restore_state,
            make_sampler=self.make_sampler if self.own_order else None,
            lr=fields.get("lr", self.own_lr),
            grad_clip=fields.get("grad_clip", self.fit.gradient_clip_val or None))
        task.framework.campaign_differs_in = self.fit.differs
        # how Lightning reduces each logged metric over ranks, filled as the validation runs
        task.framework.metric_reductions = self.validation.reductions
        return task


def from_lightning(module_factory: Callable[[], nn.Module], datamodule: Any, *, name: str,
                   criterion: Any = None, kind: str = "classification",
                   fields: Sequence[str] | None = None,
                   group_of: Callable[[int, Any], Any] | None = None,
                   gradient_clip_val: float | None = None,
                   model_inputs: Sequence[str] | None = None, callbacks: Sequence[Any] = (),
                   **task_fields: Any) -> Task:
    """A Task that runs a LightningModule as `Trainer.fit` would. `module_factory()` builds the
    module; `datamodule` gives the train and validation datasets and the train loader's
    `collate_fn` (its `prepare_data` and `setup("fit")` are called); a loader's
    `IterableDataset` is read lazily, as `from_torch` reads one. Items and batches keep
    their structure for the module's steps; `fields` names their elements in order (depth
    first; the target 'labels', e.g. ('x', 'labels', 'w') for (x, y, sample_weight)), dicts
    are named by their keys. `model_inputs` (default: the fields the module's forward takes,
    by name or the first ones) are what the pilot's own checks pass to the model. `criterion`
    is the loss the pilot's own checks (01-03) compute per target, as in `from_torch` (None for
    generation: the task's token cross-entropy; pass `decode`), or give `loss(outputs, batch)
    -> (sum, count)` itself (a sample-weighted loss); 04 checks it against what
    `training_step` returns. `gradient_clip_val` and `callbacks` (Lightning `Callback`s, whose
    fit and validation hooks run before the module's) are the Trainer's. Other Task fields pass
    through (`lr` defaults to the one configure_optimizers sets). The Task's
    `campaign_differs_in` says which Trainer values the module read differ from the
    campaign's."""
    return LightningAdapter(module_factory, datamodule, name=name, criterion=criterion,
                            kind=kind, fields=fields, group_of=group_of,
                            gradient_clip_val=gradient_clip_val, model_inputs=model_inputs,
                            callbacks=callbacks, **task_fields).task()
