"""`from_accelerate`: a training loop written on Hugging Face Accelerate (the `*_no_trainer.py`
scripts of transformers, accelerate's `examples/`) as a Task, from the script's own pieces: the
model and optimizer factories, the (optional) scheduler factory, the DataLoaders, and the loop
body `training_step(accelerator, model, optimizer, lr_scheduler, batch)` that calls
`accelerator.backward` inside `accelerator.accumulate(model)`. The pilot shapes every update
(micro-batch x accumulation): before one of N micro-batches the accelerator's
`gradient_accumulation_steps` is set to N and its step counter to 0, so the script's
`optimizer.step()` (an `AcceleratedOptimizer`) applies once, after the N-th micro-batch, and its
`lr_scheduler.step()` (an `AcceleratedScheduler`) steps with it. `eval_step(accelerator, model,
batch)` returns what the script passes to `gather_for_metrics`: the pilot hands it the real rows
of a batch only (no padding copies to drop) and adds each process's values itself. Needs
`accelerate`."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...base.errors import WorkbookError
from .. import kinds
from ..metric_reduction import ROWS
from ..outputs import accepted
from ..run import EXAMPLE_WEIGHT, current_run
from ..task import Task, own_code
from .base import Adapter, rescale
from .torch import LABELS, from_torch, probe_on_meta

SCRIPT = "the script's"  # whose code the pieces are, in errors
EVAL_LOSS = "eval_loss"  # the metric eval_step's values make, as run_clm_no_trainer logs it


def accelerate() -> Any:
    """The `accelerate` package, or the error that says how to install it."""
    try:
        import accelerate as acc
        from accelerate.optimizer import AcceleratedOptimizer  # noqa: F401
        from accelerate.scheduler import AcceleratedScheduler  # noqa: F401
    except ImportError as exc:
        raise WorkbookError("from_accelerate needs Accelerate, which is not installed",
                            "pip install accelerate") from exc
    return acc


class Unscheduled:
    """The `lr_scheduler` a training_step receives when the script has none (or the pilot's
    checks hand their own optimizer): its step() changes nothing."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


class ScriptSchedule:
    """The script's prepared scheduler as the loop steps it after each update: the script's
    loop body steps it itself (run_clm_no_trainer's `lr_scheduler.step()`), so the loop's step
    is skipped for an update that did; one whose body does not (the workbook's own update, a
    body without it) gets the step the script would give it after `optimizer.step()`."""

    def __init__(self, accelerated: Any):
        self.accelerated = accelerated
        self.stepped = False  # the last update's training_step stepped it

    @property
    def scheduler(self) -> Any:
        return self.accelerated.scheduler

    def step(self) -> None:
        if self.stepped:
            self.stepped = False
            return
        self.accelerated.step()

    def get_last_lr(self) -> list[float]:
        return self.accelerated.get_last_lr()

    def state_dict(self) -> dict:
        return self.accelerated.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.accelerated.load_state_dict(state)


def schedule_position(scheduler: Any) -> Any:
    inner = getattr(scheduler, "scheduler", scheduler)
    return getattr(inner, "last_epoch", None), getattr(inner, "_step_count", None)


class AccelerateStep:
    """`train_step(model, optimizer, micro_batches)`: the script's loop body once per
    micro-batch in training mode (the script sets it each epoch), the accelerator shaped for an
    update of that many (see the module's docstring); a plain optimizer (04's recorder) is
    wrapped as `accelerator.prepare` wraps one. Returns the mean of the losses the body
    returned, as the script totals them."""

    def __init__(self, adapter: "AccelerateAdapter"):
        self.adapter = adapter
        self.described = "the gradient of an update through your training_step"  # findings

    @contextlib.contextmanager
    def shaped(self, micro_batches: int) -> Iterator[None]:
        """The accelerator set for one update of `micro_batches`: its accumulation steps and
        its step counter, given back after (the script's own values)."""
        acc = self.adapter.accelerator
        state = acc.gradient_state
        steps, counter = state.plugin_kwargs.get("num_steps", 1), acc.step
        acc.gradient_accumulation_steps, acc.step = micro_batches, 0
        try:
            yield
        finally:
            state.plugin_kwargs["num_steps"], acc.step = steps, counter
            state._set_sync_gradients(True)

    def run(self, model: nn.Module, optimizer: Any, micro_batches: list[dict],
            train: bool = True) -> list[Any]:
        """The body once per micro-batch (in training mode unless `train` is off); what each
        returned."""
        adapter = self.adapter
        opt = adapter.prepared(optimizer)
        schedule = adapter.schedules.get(optimizer)
        lr_scheduler = schedule.accelerated if schedule is not None else Unscheduled(opt)
        before = schedule_position(lr_scheduler)
        returned, acc = [], adapter.accelerator
        if train:
            model.train()  # the script's `model.train()` at each epoch's start
        with self.shaped(len(micro_batches)):
            for batch in micro_batches:
                returned.append(own_code(
                    "training_step", adapter.training_step, acc, model, opt,
                    lr_scheduler, adapter.given(batch), whose=SCRIPT, receives="(accelerator, "
                    "model, optimizer, lr_scheduler, batch) and returns the loss"))
            entered = acc.step  # accelerator.accumulate counts the micro-batches it wraps
        if entered == 0 and len(micro_batches) > 1:
            raise WorkbookError(
                f"your training_step never enters accelerator.accumulate(model): over an "
                f"update of {len(micro_batches)} micro-batches the accelerator counted none, so "
                "its gradients count as synchronised after each and optimizer.step() applies "
                "after every micro-batch - the campaign with gradient_accumulation_steps > 1 "
                "would step as often", "wrap the loop body in `with "
                "accelerator.accumulate(model):` (or run the notebooks with accumulation=1)")
        if schedule is not None:
            schedule.stepped = schedule_position(lr_scheduler) != before
        return returned

    def __call__(self, model: nn.Module, optimizer: Any,
                 micro_batches: list[dict]) -> torch.Tensor:
        losses = []
        for i, value in enumerate(self.run(model, optimizer, micro_batches)):
            value = value.get("loss") if isinstance(value, dict) else value
            if not isinstance(value, (torch.Tensor, float, int)) or isinstance(value, bool):
                raise WorkbookError(f"the script's training_step returned "
                                    f"{type(value).__name__} for micro-batch {i}, not the loss",
                                    "end the loop body with `return loss` (the tensor it "
                                    "back-propagated)")
            losses.append(torch.as_tensor(value).detach().float().reshape(-1).mean().cpu())
        return torch.stack(losses).mean()

    def explain_split(self, model: nn.Module, micro_batches: list[dict]) -> str | None:
        """Why this update's gradient depends on how it is split, in Accelerate's terms, by
        experiment on the script's body: the calls of `accelerator.backward` and of a tensor's
        own `backward()` counted over one update, and the gradient of the update split in
        micro-batches against the same rows in one (a step of a plain optimizer at lr 0)."""
        acc = self.adapter.accelerator
        calls = {"accelerator": 0, "tensor": 0}
        own_backward, tensor_backward = acc.backward, torch.Tensor.backward

        def counted_accelerator(loss: Any, **kwargs: Any) -> None:
            calls["accelerator"] += 1
            torch.Tensor.backward = tensor_backward  # its own loss.backward() is not the user's
            try:
                own_backward(loss, **kwargs)
            finally:
                torch.Tensor.backward = counted_tensor

        def counted_tensor(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            calls["tensor"] += 1
            tensor_backward(tensor, *args, **kwargs)

        acc.backward, torch.Tensor.backward = counted_accelerator, counted_tensor
        try:
            split = self.gradient(model, micro_batches)
        finally:
            torch.Tensor.backward = tensor_backward
            del acc.backward
        if calls["tensor"] == 0 or calls["accelerator"] > 0:
            return None  # it calls accelerator.backward: the cause is elsewhere
        k = len(micro_batches)
        whole = joined(micro_batches)
        ratio = ""
        if whole is not None:
            one = self.gradient(model, [whole])
            if one > 0:
                ratio = (f" - measured: the gradient of {k} micro-batches is "
                         f"{split / one:.3g} times that of the same rows in one")
        return (f"your training_step back-propagates with loss.backward() ({calls['tensor']} "
                f"calls over an update of {k} micro-batches, accelerator.backward 0): only "
                "accelerator.backward(loss) divides the loss by the accelerator's "
                "gradient_accumulation_steps, so each update's gradient is that many times "
                f"the mean over its micro-batches{ratio} - call accelerator.backward(loss) in "
                "place of loss.backward()")

    def explain_loss(self, divisor: int) -> str | None:
        """The cause, in Accelerate's terms, of a body whose loss and gradient were measured at
        1/`divisor` of the task's: the script's gradient_accumulation_steps divided in by hand
        before accelerator.backward, which divides by it again."""
        steps = self.adapter.accelerator.gradient_accumulation_steps
        if divisor != steps:
            return None
        return (f"it equals the script's gradient_accumulation_steps ({steps}), and "
                "accelerator.backward(loss) divides by it again under accelerator.accumulate, "
                f"so each update's gradient is 1/{steps} of the mean over its micro-batches: "
                "drop the division - accelerator.backward(loss) already divides")

    def gradient(self, model: nn.Module, micro_batches: list[dict]) -> float:
        """The norm of the gradient the body steps with over these micro-batches (a plain SGD
        at learning rate 0 records it and changes nothing), in the mode the model is in."""
        model.zero_grad(set_to_none=True)
        recorder = torch.optim.SGD(model.parameters(), lr=0.0)
        norms = []

        def record(optimizer: Any, args: Any, kwargs: Any) -> None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
            norms.append(float(nn.utils.get_total_norm(grads)) if grads else 0.0)
        handle = recorder.register_step_pre_hook(record)
        try:
            self.run(model, recorder, micro_batches, train=False)
        finally:
            handle.remove()
            model.zero_grad(set_to_none=True)
        return norms[-1] if norms else 0.0


def joined(micro_batches: list[dict]) -> dict | None:
    """The micro-batches' rows as one batch (None when their tensors do not stack)."""
    try:
        return {k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]}
    except (RuntimeError, TypeError):
        return None


class AccelerateEval:
    """`eval_step(model, batch)` -> {"eval_loss": (sum, count)}: the script's eval body on the
    batch's real rows in eval mode (the script's loop sets it), `gather_for_metrics` kept to
    this process's values (the pilot adds the processes' sums, as the gather concatenates
    them); a value per row is summed, anything else (a batch's mean, repeated or not) weighs
    the batch's rows."""

    def __init__(self, adapter: "AccelerateAdapter", eval_step: Callable):
        self.adapter, self.eval_step = adapter, eval_step

    def __call__(self, model: nn.Module, batch: dict) -> dict[str, tuple]:
        adapter, acc = self.adapter, self.adapter.accelerator
        weight = batch.get(EXAMPLE_WEIGHT)
        given = adapter.given(batch)
        if weight is not None:
            keep = weight.reshape(-1) > 0
            given = {k: v[keep] if isinstance(v, torch.Tensor) and v.dim() and
                     len(v) == len(keep) else v for k, v in given.items()}
        rows = len(given[LABELS]) if LABELS in given else len(next(iter(given.values())))
        acc.gather_for_metrics = lambda data, use_gather_object=False: data
        was = model.training
        model.eval()  # the script's `model.eval()` before its evaluation loop
        try:
            value = own_code("eval_step", self.eval_step, acc, model, given, whose=SCRIPT,
                             receives="(accelerator, model, batch) and returns the loss "
                             "tensor it gathers")
        finally:
            del acc.gather_for_metrics
            model.train(was)
        try:
            values = torch.as_tensor(value).detach().float().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise WorkbookError(f"the script's eval_step returned {type(value).__name__}, not "
                                "a loss tensor", "return the (gathered) loss: "
                                "accelerator.gather_for_metrics(loss.repeat(batch_size))"
                                ) from exc
        total = values.sum() if len(values) == rows else values.mean() * rows
        return {EVAL_LOSS: (float(total), float(rows))}


class AccelerateAdapter(Adapter):
    """A script's Accelerate pieces, read once; the Task's steps run them as the script's loop
    does (see `from_accelerate`)."""

    def __init__(self, make_model: Callable[[], nn.Module], make_optimizer: Callable,
                 train_dataloader: Any, training_step: Callable, *, name: str,
                 accelerator: Any = None, make_scheduler: Callable | None = None,
                 eval_dataloader: Any = None, eval_step: Callable | None = None,
                 kind: str | None = None, **task_fields: Any):
        acc = accelerate()
        loaders = {"train": train_dataloader, "eval": eval_dataloader}
        for which, loader in loaders.items():
            if loader is not None and not isinstance(loader, torch.utils.data.DataLoader):
                raise WorkbookError(f"the {which} dataloader is a {type(loader).__name__}, not "
                                    "a torch DataLoader", f"pass the script's {which}_dataloader"
                                    " (before or after accelerator.prepare)")
        if eval_step is not None and eval_dataloader is None:
            raise WorkbookError("eval_step is given without eval_dataloader",
                                "pass the script's eval_dataloader too")
        for piece, fn in (("make_model", make_model), ("make_optimizer", make_optimizer),
                          ("training_step", training_step), ("make_scheduler", make_scheduler),
                          ("eval_step", eval_step)):
            if fn is not None and not callable(fn):
                raise WorkbookError(f"{piece} is a {type(fn).__name__}, not callable",
                                    f"pass {piece} as a function (see from_accelerate)")
        self.accelerator = accelerator if accelerator is not None else acc.Accelerator()
        self.make_model, self.make_optimizer = make_model, make_optimizer
        self.make_scheduler, self.training_step = make_scheduler, training_step
        self.loaders, self.name, self.task_fields = loaders, name, dict(task_fields)
        self.eval = AccelerateEval(self, eval_step) if eval_step is not None else None
        self.schedules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.probe = probe_on_meta(make_model, "model", "pass a factory that builds the model "
                                   "as the script does, before accelerator.prepare")
        self.kind = kind or ("classification" if type(self.probe).__name__.endswith(
            "ForSequenceClassification") else "generation")
        self.own_lr = self.optimizer_of(self.probe).param_groups[0]["lr"]
        self.fields: tuple[str, ...] = ()

    def optimizer_of(self, model: nn.Module) -> torch.optim.Optimizer:
        """The script's optimizer over `model`'s parameters, unwrapped when it comes
        prepared."""
        opt = own_code("make_optimizer", self.make_optimizer, model, whose=SCRIPT,
                       receives="the model and returns the optimizer over its parameters")
        inner = getattr(opt, "optimizer", opt)
        if not isinstance(inner, torch.optim.Optimizer):
            raise WorkbookError(f"make_optimizer returned a {type(opt).__name__}, not a torch "
                                "optimizer", "return the optimizer the script builds, e.g. "
                                "torch.optim.AdamW(model.parameters(), lr=...)")
        return inner

    # -- the optimizer and schedule ------------------------------------------------------------

    def build_optimizer(self, model: nn.Module, lr: float) -> Any:
        """The script's optimizer at the run's learning rate (its groups' rates scaled
        together), `prepared`."""
        opt = self.optimizer_of(self.unwrap(model))
        rescale(opt, None, lr / self.own_lr)
        return self.prepared(opt)

    def prepared(self, optimizer: Any) -> Any:
        """`optimizer` wrapped as `accelerator.prepare` wraps one (not registered with the
        accelerator: the pilot builds many; 04's recorder too)."""
        from accelerate.optimizer import AcceleratedOptimizer

        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        return AcceleratedOptimizer(optimizer, device_placement=False,
                                    scaler=self.accelerator.scaler)

    def build_scheduler(self, optimizer: Any) -> ScriptSchedule:
        """The script's scheduler over the optimizer, wrapped as `accelerator.prepare` wraps
        it; a make_scheduler taking `num_training_steps` gets the run's updates."""
        from accelerate.scheduler import AcceleratedScheduler

        inner = getattr(optimizer, "optimizer", optimizer)
        run = current_run()
        sized = {"num_training_steps": run.updates} if run is not None and \
            "num_training_steps" in accepted(self.make_scheduler) else {}
        made = own_code("make_scheduler", self.make_scheduler, inner, **sized, whose=SCRIPT,
                        receives="the optimizer and returns its scheduler")
        if not isinstance(made, AcceleratedScheduler):
            acc = self.accelerator
            made = AcceleratedScheduler(made, optimizer,
                                        step_with_optimizer=acc.step_scheduler_with_optimizer,
                                        split_batches=acc.split_batches)
        schedule = self.schedules[optimizer] = ScriptSchedule(made)
        return schedule

    # -- the batch structure -------------------------------------------------------------------

    def given(self, batch: dict) -> dict:
        """The batch as the script's collate made it (the pilot's own keys left out)."""
        return {k: v for k, v in batch.items() if k in self.fields} if self.fields else \
            {k: v for k, v in batch.items() if k != EXAMPLE_WEIGHT}

    # -- the task ------------------------------------------------------------------------------

    def task(self) -> Task:
        train, evaluation = (getattr(loader, "dataset", None) for loader in
                             self.loaders.values())
        datasets = {"train": train, "validation": evaluation} if evaluation is not None \
            else train
        fields = dict(self.task_fields)
        generation = kinds.of(self.kind).causal
        if generation:  # a causal LM's labels are its input_ids, shifted inside the model
            fields.setdefault("label_shift", 1 if hasattr(self.probe, "config") else 0)
            fields.setdefault("decode", lambda ids: " ".join(str(int(i)) for i in ids))
        base = from_torch(datasets, self.make_model, None if generation else
                          nn.CrossEntropyLoss(), name=self.name, kind=self.kind,
                          collate_fn=self.loaders["train"].collate_fn, **fields)
        self.fields = (*base.model_inputs, LABELS)
        step = AccelerateStep(self)
        task = dataclasses.replace(
            base, train_step=step,
            eval_step=self.eval if self.eval is not None else base.eval_step,
            build_optimizer=self.build_optimizer,
            build_scheduler=self.build_scheduler if self.make_scheduler is not None else
            base.build_scheduler,
            lr=fields.get("lr", self.own_lr), grad_clip=fields.get("grad_clip"))
        if self.eval is not None:  # the gathered losses of every process: a mean over rows
            task.framework.metric_reductions = {EVAL_LOSS: ROWS}
        return task


def from_accelerate(make_model: Callable[[], nn.Module], make_optimizer: Callable,
                    train_dataloader: Any, training_step: Callable, *, name: str,
                    accelerator: Any = None, make_scheduler: Callable | None = None,
                    eval_dataloader: Any = None, eval_step: Callable | None = None,
                    kind: str | None = None, **task_fields: Any) -> Task:
    """A Task that runs an Accelerate training loop as the script writes it.
    `make_model()` builds the model as the script does (before `accelerator.prepare`);
    `make_optimizer(model)` returns its optimizer; `train_dataloader` (and `eval_dataloader`)
    are the script's DataLoaders, prepared or not: their datasets give the examples (dicts
    with 'labels', e.g. `group_texts` blocks) and the train loader's `collate_fn` makes every
    batch. `training_step(accelerator, model, optimizer, lr_scheduler, batch) -> loss` is the
    loop body (`with accelerator.accumulate(model): ... accelerator.backward(loss);
    optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()`), run once per micro-batch
    with the accelerator shaped for the pilot's update; `accelerator` is the script's
    (`gradient_accumulation_steps`, `mixed_precision`; default `Accelerator()`).
    `make_scheduler(optimizer)` returns the script's scheduler (a `num_training_steps`
    parameter receives the run's updates, for `get_scheduler`); `eval_step(accelerator, model,
    batch)` returns the loss tensor the script gathers with `gather_for_metrics` (reported as
    "eval_loss"). `kind` is read from the model (a `...ForSequenceClassification` classifies,
    anything else generates: labels aligned with input_ids). Other Task fields pass through
    (`lr` defaults to the optimizer's, `grad_clip` to None: the body clips, if at all)."""
    return AccelerateAdapter(make_model, make_optimizer, train_dataloader, training_step,
                             name=name, accelerator=accelerator, make_scheduler=make_scheduler,
                             eval_dataloader=eval_dataloader, eval_step=eval_step, kind=kind,
                             **task_fields).task()
