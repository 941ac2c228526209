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

import contextlib
import copy
import dataclasses
import math
import weakref
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from ...storage.files import scratch_folder
from .. import kinds
from ..run import DEFAULT_UPDATES, EXAMPLE_WEIGHT
from ..sources import length
from ..task import Task
from .lightning_batches import _flat, _model_inputs, _shape_of
from .lightning_hooks import _call, fire, modes_of
from .lightning_optimizers import (
    SCHEDULES,
    _optimizer_and_schedule,
    _own_lr,
    _rescale,
    stepped_per_pass_but_sized_per_update,
)
from .lightning_trainer import (
    RUNS,
    Logged,
    PilotTrainer,
    _attached,
    _logged,
    _logged_value,
    _Run,
    _run_of_build,
)
from .torch import LABELS, Stream, from_torch, probe_on_meta, streams

CHECKPOINT = "lightning.ckpt"


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
    summed: dict[str, float] = dataclasses.field(default_factory=dict)  # reduce_fx="sum" logs
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
    pl = _lightning()
    callbacks = list(callbacks)
    differs: dict[str, str] = {}
    scratch_dir: list[str] = []

    def scratch() -> str:
        if not scratch_dir:
            scratch_dir.append(scratch_folder("workbook-lightning-"))
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
        loaders[split] = loader
    # an iterable dataset (a streaming one) is read in turn, never indexed
    datasets = {split: Stream(loader.dataset, split) if streams(loader.dataset) else
                loader.dataset for split, loader in loaders.items()}
    train_set = datasets["train"]
    streamed = isinstance(train_set, Stream)
    if loaders["train"].batch_sampler is not None and type(
            loaders["train"].batch_sampler) is not torch.utils.data.BatchSampler:
        raise WorkbookError(f"the train loader batches with its own "
                            f"{type(loaders['train'].batch_sampler).__name__}",
                            "the pilot makes the micro-batches: give the loader a batch_size "
                            "(and a sampler for the order) instead of a batch_sampler")
    if not streamed and not len(train_set):
        raise WorkbookError("the train dataset has no items", "pass the data you train on")
    val_batches = length(loaders["validation"])
    val_batches = math.inf if val_batches is None else val_batches  # Lightning's, unsized
    loader_batch = loaders["train"].batch_size or 1
    train_length = train_set.length() if streamed else len(train_set)
    # a pass when no run says: the train set, or a stream without a length: the default run's
    pass_items = DEFAULT_UPDATES * loader_batch if train_length is None else train_length

    def run_of(module: nn.Module, optimizer: Any = None) -> _Run:
        run = RUNS.get(optimizer) if optimizer is not None else None
        run = run or RUNS.get(module)
        if run is None:
            run = RUNS[module] = _Run(DEFAULT_UPDATES, loader_batch, 1, pass_items)
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
    probe_run = _Run(DEFAULT_UPDATES, loader_batch, 1, pass_items)
    with hooks(probe, probe_run, "train"):
        optimizer, schedule = _optimizer_and_schedule(
            _call("configure_optimizers", probe.configure_optimizers))
    own_lr = _own_lr(optimizer, schedule)

    # the structure of the items and of the batches the train loader's collate makes
    firsts = [it for _, it in islice(train_set.items(), 2)] if streamed else \
        [train_set[i] for i in range(min(2, len(train_set)))]
    item_shape = _shape_of(firsts[0], fields, "the train dataset's item 0")
    user_collate = loaders["train"].collate_fn
    first = _call("collate_fn (the train loader's)", user_collate, firsts)
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
    flat = {s: _flat(data, item_shape, s) for s, data in datasets.items()}
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
        run = RUNS[module] = _run_of_build(pass_items, loader_batch)
        with hooks(module, run, "train"):
            opt, sched = _optimizer_and_schedule(_call("configure_optimizers",
                                                       module.configure_optimizers))
        RUNS[opt] = run
        wrong = stepped_per_pass_but_sized_per_update(sched, run.updates, run.max_epochs)
        if wrong is not None:
            raise wrong
        if lr != own_lr:
            _rescale(opt, sched, lr / own_lr)
        if sched is not None:
            sched.examples_per_pass = max(train_length or run.pass_examples, 1)
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
                fire("on_fit_start", module, callbacks)
                fire("on_train_start", module, callbacks)
            if run.batch_idx == 0:
                fire("on_train_epoch_start", module, callbacks)
            for i, batch in enumerate(micro_batches):
                given, index = users(batch), run.batch_idx
                fire("on_train_batch_start", module, callbacks, given, index)
                returned = _call("training_step", module.training_step, given, index)
                loss = _loss_of(returned)
                scaled = loss / count  # as accumulate_grad_batches divides
                fire("on_before_backward", module, callbacks, scaled)
                scaled.backward()
                fire("on_after_backward", module, callbacks)
                total += float(loss.detach())
                run.batch_idx += 1
                if i < count - 1:
                    fire("on_train_batch_end", module, callbacks, returned, given,
                          index)
            fire("on_before_optimizer_step", module, callbacks, opt)
            if gradient_clip_val:
                nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
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
                fire("on_validation_epoch_end", module, callbacks)
                ended = dict(seen)
                for metric in epoch.metrics.values():
                    if callable(getattr(metric, "reset", None)):
                        metric.reset()
                fire("on_validation_end", module, callbacks)
                fire("on_validation_model_train", module, callbacks)
        finally:
            _set_modes(module, found)
        return ended

    def epoch_so_far(module: nn.Module, run: _Run) -> dict:
        """What on_validation_epoch_end would log now, run on a shadow of the module."""
        shadow = _shadow(module)
        with hooks(shadow, run, "validate") as seen, torch.no_grad():
            _call("on_validation_epoch_end", shadow.on_validation_epoch_end)
        return dict(seen)

    reductions: dict[str, str] = {}

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
                    fire("on_validation_model_eval", module, callbacks)
                    fire("on_validation_start", module, callbacks)
                    fire("on_validation_epoch_start", module, callbacks)
                    epoch = VALIDATION[module] = _ValEpoch(key, _modes(module))
                    seen.clear()
                else:
                    _set_modes(module, epoch.modes)
                index = epoch.batch_idx
                fire("on_validation_batch_start", module, callbacks, given, index,
                     evaluating=modes_of(module))
                returned = fire("validation_step", module, callbacks, given, index,
                                evaluating=modes_of(module))
                fire("on_validation_batch_end", module, callbacks, returned, given, index,
                     evaluating=modes_of(module))
                stepped = dict(seen)
                whole = {n: _logged_value(got.metric)[0] for n, got in stepped.items()
                         if got.metric is not None}  # metric objects: their value over the epoch
            epoch.batch_idx += 1
            epoch.rows += rows
            epoch.last = keep is not None and not bool(keep.all())
            epoch.metrics.update({n: got.metric for n, got in stepped.items()
                                  if got.metric is not None})
            for n, got in stepped.items():  # a step log summed over the epoch (a count)
                if got.metric is None and got.reduce_fx == "sum" and math.isfinite(got.value):
                    epoch.summed[n] = whole[n] = epoch.summed.get(n, 0.0) + got.value
            ended = close_validation(module, run) if epoch.last else \
                epoch_so_far(module, run) if ends_epoch else {}
        finally:
            _set_modes(module, found)
        whole.update({n: got.value for n, got in ended.items()})
        reductions.update({n: got.reduction(n in ended) for n, got in
                           (*stepped.items(), *ended.items())})
        if not stepped and not whole and isinstance(returned, torch.Tensor) and \
                returned.dim() == 0:
            stepped["val_loss"] = Logged(float(returned), None, "mean", None)
        if not stepped and not whole:
            raise WorkbookError("validation_step logs nothing and returns no loss",
                                "self.log('val_loss', loss) in validation_step (or the epoch's "
                                "metric in on_validation_epoch_end), as Lightning's "
                                "checkpointing and early stopping need")
        out = {}
        for metric, got in stepped.items():
            if got.metric is not None or got.reduce_fx != "mean" or \
                    not math.isfinite(got.value):
                continue
            count = rows if got.size is None else got.size
            out[metric] = (got.value * count, count)
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
    own_order = not streamed and not isinstance(sampler, (torch.utils.data.RandomSampler,
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

    # how Lightning reduces each logged metric over data-parallel ranks (09 reads it)
    eval_step.metric_reductions = reductions  # type: ignore[attr-defined]
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
