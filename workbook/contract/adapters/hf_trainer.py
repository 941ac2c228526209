"""The Trainer's own code in `from_hf`: its AdamW parameter groups, its schedule with the
callbacks stepped along (`_Schedule`), and its checkpoint files."""

from __future__ import annotations

import copy
import math
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from ...storage.files import scratch_folder
from .. import fine_tuning
from ..run import current_run
from ..task import adamw

MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> model


def _trainer_updates(args: Any, train_rows: int) -> int:
    """The number of updates the Trainer itself would make: max_steps, else epochs x updates
    per epoch (one process)."""
    if getattr(args, "max_steps", -1) and getattr(args, "max_steps", -1) > 0:
        return int(args.max_steps)
    per_update = getattr(args, "per_device_train_batch_size", 8) * \
        getattr(args, "gradient_accumulation_steps", 1)
    return max(1, math.ceil(getattr(args, "num_train_epochs", 3.0) *
                            math.ceil(train_rows / per_update)))


def _warmup(args: Any, total: int) -> int:
    ratio = getattr(args, "warmup_ratio", 0) or 0  # transformers < 5; 5 folds it into steps
    steps = getattr(args, "warmup_steps", 0) or 0
    if steps and callable(getattr(args, "get_warmup_steps", None)):
        return int(args.get_warmup_steps(total))
    if steps:
        return int(steps) if steps >= 1 else math.ceil(total * steps)
    return math.ceil(total * ratio)


class _Callbacks:
    """The Trainer's callbacks, called as `CallbackHandler` calls them - (args, state, control,
    model=..., processing_class=..., optimizer=..., lr_scheduler=...), a returned control
    replacing the current one - with the failure of one named. `DefaultFlowCallback` comes
    first, as in the Trainer, so control.should_save follows save_strategy."""

    def __init__(self, callbacks: list, args: Any, tokenizer: Any):
        from transformers.trainer_callback import DefaultFlowCallback

        self.callbacks = [DefaultFlowCallback()] + [c() if isinstance(c, type) else c
                                                    for c in callbacks]
        self.args, self.tokenizer = args, tokenizer

    def fresh(self, max_steps: int) -> tuple[Any, Any]:
        from transformers import TrainerControl, TrainerState

        args = self.args
        state = TrainerState(max_steps=max_steps, num_train_epochs=int(math.ceil(
            getattr(args, "num_train_epochs", 1))),
            train_batch_size=getattr(args, "per_device_train_batch_size", None),
            logging_steps=_steps(getattr(args, "logging_steps", 500), max_steps),
            eval_steps=_steps(getattr(args, "eval_steps", None) or
                              getattr(args, "logging_steps", 500), max_steps),
            save_steps=_steps(getattr(args, "save_steps", 500), max_steps))
        return state, TrainerControl()

    def event(self, name: str, schedule: "_Schedule", **extra: Any) -> None:
        """Every callback's hook `name`. A model in training mode stays so: the Trainer's
        training_step calls model.train() before every update, so a callback's model.eval()
        (in on_step_end, on_evaluate, ...) never reaches one - nor here."""
        model = schedule.model
        training = model is not None and model.training
        try:
            self._event(name, schedule, **extra)
        finally:
            if training and not model.training:
                model.train()

    def _event(self, name: str, schedule: "_Schedule", **extra: Any) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, name, None)
            if hook is None:
                continue
            try:
                got = hook(self.args, schedule.state, schedule.control, model=schedule.model,
                           processing_class=self.tokenizer, optimizer=schedule.optimizer,
                           lr_scheduler=schedule.inner, **extra)
            except WorkbookError:
                raise
            except Exception as exc:
                raise WorkbookError(
                    f"from_hf: the callback {type(callback).__name__}.{name} raised "
                    f"{type(exc).__name__}: {reason(exc, 300)} (at global_step "
                    f"{schedule.state.global_step})",
                    f"fix {type(callback).__name__}.{name}: it receives (args, state, control, "
                    "**kwargs) as the Trainer calls it") from exc
            if got is not None:
                schedule.control = got


def _steps(value: Any, max_steps: int) -> int:
    """A Trainer step interval: a float below 1 is a share of max_steps."""
    if value is None:
        return 500
    return int(value) if value >= 1 else math.ceil(max_steps * value)


class _Schedule:
    """The Trainer's schedule (`get_scheduler(lr_scheduler_type, ...)`), stepped by the pilot
    after every update; each step advances `state.global_step` and calls the callbacks'
    `on_step_end`, as the Trainer does after its optimizer and scheduler steps."""

    def __init__(self, inner: Any, model: Any, optimizer: Any, hooks: _Callbacks | None,
                 max_steps: int):
        self.inner, self.model, self.optimizer, self.hooks = inner, model, optimizer, hooks
        self.state, self.control = hooks.fresh(max_steps) if hooks else (None, None)
        self.max_steps = max_steps
        if hooks:
            hooks.event("on_train_begin", self)

    def step(self) -> None:
        self.inner.step()
        if self.hooks:
            self.state.global_step += 1
            self.hooks.event("on_step_end", self)

    def get_last_lr(self) -> list[float]:
        return self.inner.get_last_lr()

    def state_dict(self) -> dict:
        return {"scheduler": self.inner.state_dict(),
                "global_step": self.state.global_step if self.state else None}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["scheduler"])
        if self.state is not None and state.get("global_step") is not None:
            self.state.global_step = int(state["global_step"])


def _is_fake(model: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(p.is_meta or is_fake(p) for p in model.parameters()) if model is not None \
        else False


def _scheduler_factory(args: Any, train_rows: int, hooks: _Callbacks | None,
                       notes: list[str]) -> Callable[[torch.optim.Optimizer], _Schedule]:
    from transformers import get_scheduler

    name = str(getattr(getattr(args, "lr_scheduler_type", "linear"), "value",
                       getattr(args, "lr_scheduler_type", "linear")))
    if name == "reduce_lr_on_plateau":
        raise WorkbookError("from_hf: lr_scheduler_type 'reduce_lr_on_plateau' follows an "
                            "evaluation metric, which the pilot's updates do not feed it",
                            "pilot with 'linear', 'cosine' or 'constant_with_warmup' (the "
                            "schedule's shape, not its trigger, is what the pilot checks)")

    def build_scheduler(optimizer: torch.optim.Optimizer) -> _Schedule:
        # the Trainer's own count, stretched to the pilot run being built (`current_run`) when
        # it makes more updates (a schedule that ends before the run would train its last
        # updates at lr 0)
        run = current_run()
        total = max(_trainer_updates(args, train_rows), run.updates if run else 0, 2)
        warmup = _warmup(args, total)
        try:
            hf = get_scheduler(name, optimizer, num_warmup_steps=warmup,
                               num_training_steps=total,
                               scheduler_specific_kwargs=getattr(args, "lr_scheduler_kwargs",
                                                                 None) or {})
        except Exception as exc:
            raise WorkbookError(f"from_hf: building the Trainer's schedule ({name}, warm-up "
                                f"{warmup} of {total} updates) failed: {reason(exc)}",
                                "check lr_scheduler_type and lr_scheduler_kwargs") from exc
        lambdas = getattr(hf, "lr_lambdas", None)
        if not lambdas or len(lambdas) != len(optimizer.param_groups):
            inner = hf
        else:  # the Trainer's warm-up starts at lr 0, an update that moves nothing: the
            # pilot's warm-up counts from 1 (update k of it at k / warmup), the rest is HF's
            def factor(step: int, of: Callable = lambdas[0], warmup: int = warmup) -> float:
                return of(step + 1 if step < warmup else step)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"]
            inner = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        model = MODELS.get(optimizer)
        return _Schedule(inner, model, optimizer, None if _is_fake(model) else hooks, total)

    notes.append(f"from_hf: the Trainer's schedule {name!r} (warm-up "
                 f"{getattr(args, 'warmup_steps', 0) or getattr(args, 'warmup_ratio', 0)}) over "
                 "the Trainer's own number of updates, or a pilot run's where it makes more")
    return build_scheduler


def _checkpoint_code(args: Any, hooks: _Callbacks | None, save_only_model: bool):
    """save_state/restore_state writing what the Trainer's `_save_checkpoint` writes, as plain
    files: config.json and model.safetensors (a PEFT model: adapter_model.safetensors and
    adapter_config.json, the adapters only - the base is rebuilt, not saved), optimizer.pt,
    scheduler.pt, scaler.pt, trainer_state.json; then the callbacks' `on_save`.
    `save_only_model=True` leaves the optimizer and schedule out, as the Trainer does (a
    checkpoint it cannot resume from)."""
    from safetensors.torch import load_model, save_model

    def save_state(folder: Any, objects: dict) -> None:
        folder = Path(folder)
        model, sched = objects["model"], objects.get("scheduler")
        if fine_tuning.saves_adapters(model):  # as the Trainer saves a PEFT model
            model.save_pretrained(str(folder))
        else:
            if hasattr(model, "config") and callable(getattr(model.config, "to_json_file",
                                                             None)):
                model.config.to_json_file(folder / "config.json")
            save_model(model, str(folder / "model.safetensors"))
        if not save_only_model:
            for name in ("optimizer", "scheduler", "scaler"):
                if objects.get(name) is not None:
                    torch.save(objects[name].state_dict(), folder / f"{name}.pt")
        if isinstance(sched, _Schedule) and sched.state is not None:
            step = objects.get("step")
            done = (step.state_dict().get("step") if step is not None else None)
            if done is not None:
                sched.state.global_step = int(done)
            sched.state.save_to_json(str(folder / "trainer_state.json"))
            sched.hooks.event("on_save", sched, checkpoint_folder=str(folder))

    def restore_state(folder: Any, objects: dict) -> None:
        folder = Path(folder)
        if (folder / fine_tuning.ADAPTERS).exists():
            fine_tuning.load_adapters(objects["model"], folder / fine_tuning.ADAPTERS)
        else:
            load_model(objects["model"], str(folder / "model.safetensors"))
        if objects.get("optimizer") is None:  # a model-only restore (06 evaluates a trial)
            return
        missing = [n for n in ("optimizer", "scheduler", "scaler")
                   if objects.get(n) is not None and not (folder / f"{n}.pt").exists()]
        if missing:
            raise WorkbookError(
                f"from_hf: the checkpoint holds no {', '.join(n + '.pt' for n in missing)}"
                + (" (save_only_model=True: the Trainer saves only the model, and a resumed "
                   "run restarts Adam's moments and the schedule)" if save_only_model else ""),
                "set save_only_model=False in TrainingArguments: a rental that is preempted "
                "must resume from its last checkpoint")
        for name in ("optimizer", "scheduler", "scaler"):
            if objects.get(name) is not None:
                objects[name].load_state_dict(torch.load(folder / f"{name}.pt",
                                                         weights_only=True))
        sched = objects.get("scheduler")
        if isinstance(sched, _Schedule) and sched.state is not None and \
                (folder / "trainer_state.json").exists():
            from transformers import TrainerState

            kept = sched.state.global_step
            sched.state = TrainerState.load_from_json(str(folder / "trainer_state.json"))
            sched.state.global_step = kept

    return save_state, restore_state


def _parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The Trainer's `create_optimizer` groups: weight decay on every trainable parameter but
    biases and norm layers (`Trainer.get_decay_parameter_names`), none on those."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        from transformers import Trainer

        decay = set(Trainer.get_decay_parameter_names(None, model))
    except Exception:  # an older or newer transformers without it: decay everywhere
        decay = {n for n, _ in named}
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def argument_fields(args: Any, train_rows: Callable[[], int], callbacks: list | None,
                    tokenizer: Any, notes: list[str]) -> dict[str, Any]:
    """The Task fields a trainer's arguments decide: the learning rate, the clipping
    (`max_grad_norm`) and AdamW with its settings (`args` may be any object with them), and
    from a `TrainingArguments` (or a subclass: TRL's SFTConfig, DPOConfig) the schedule with
    its warm-up over `train_rows()` rows, the checkpoint code and the user's `callbacks`."""
    fields: dict[str, Any] = {"lr": getattr(args, "learning_rate", None)}
    if hasattr(args, "max_grad_norm"):  # the Trainer clips at it; 0 or None: never
        fields["grad_clip"] = args.max_grad_norm or None
    if args is not None:
        def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
            optimizer = torch.optim.AdamW(
                _parameter_groups(model, getattr(args, "weight_decay", 0.0)), lr=lr,
                betas=(getattr(args, "adam_beta1", 0.9), getattr(args, "adam_beta2", 0.999)),
                eps=getattr(args, "adam_epsilon", 1e-8))
            MODELS[optimizer] = model
            return optimizer
        fields["build_optimizer"] = build_optimizer
    else:
        fields["build_optimizer"] = adamw
    # a TrainingArguments or a subclass of it (TRL's SFTConfig, DPOConfig)
    trainer_args = args is not None and any(k.__name__ == "TrainingArguments"
                                            for k in type(args).__mro__)
    hooks = None
    if callbacks:
        if not trainer_args:
            raise WorkbookError("from_hf: callbacks need the TrainingArguments they are called "
                                "with", "pass args=TrainingArguments(...)")
        quiet = copy.copy(args)  # the pilot never writes into the campaign's output_dir
        object.__setattr__(quiet, "output_dir", scratch_folder("from_hf-"))
        hooks = _Callbacks(list(callbacks), quiet, tokenizer)
    if trainer_args:
        fields["build_scheduler"] = _scheduler_factory(args, train_rows(), hooks, notes)
        save_only = bool(getattr(args, "save_only_model", False))
        fields["save_state"], fields["restore_state"] = _checkpoint_code(args, hooks, save_only)
        strategy = str(getattr(getattr(args, "save_strategy", "steps"), "value",
                               getattr(args, "save_strategy", "steps")))
        if strategy == "no":
            notes.append("from_hf: save_strategy 'no': the campaign writes no checkpoint, so "
                         "a preempted rental restarts from nothing (07 still checks a resume)")
    return fields
