"""`from_hf`: the pieces of a Hugging Face `Trainer` - model factory, tokenized train and eval
datasets, data collator, tokenizer and `TrainingArguments`, and the Trainer's own
`compute_metrics` and `callbacks` - as a Task. The collator is the user's own: it receives the
rows as the dataset holds them (the Trainer's column names, `label` included) and makes every
batch and, one row at a time, every example's labels, so the pilot checks the masking it really
does (a collator that leaves pad ids in the labels shows in 01). Rows whose label is -100 (an
eval set padded to a multiple of the eval batch) are padding: no examples, counted in
`task.padding_rows`."""

from __future__ import annotations

import copy
import math
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from .. import kinds
from ..run import EXAMPLE_WEIGHT, current_run
from ..targets import IGNORE_INDEX
from ..task import Task, accepted_inputs, adamw
from .torch import probe_on_meta

SPLITS = ("train", "validation", "test")
INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
PROMPT = "prompt_mask"  # True on a row's prompt tokens (labels aligned with input_ids)
ROW = "hf_row"  # which dataset row an encoded example is (split offset + index), for eval_step
LABEL_COLUMNS = ("labels", "label", "label_ids")  # the Trainer keeps these for the collator
ROW_OFFSET = 1 << 40  # split s's row i is s * ROW_OFFSET + i


def _kind(model: nn.Module) -> tuple[str, int]:
    """(kind, label_shift) read from the model class: a causal LM (labels aligned with
    input_ids, shifted inside the model) or a sequence classifier."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "generation", 1
    if name.endswith("ForSequenceClassification"):
        return "classification", 0
    raise WorkbookError(f"from_hf maps causal LMs and sequence classifiers, not {name}",
                        "write a workbook.Task for it (docs/own-task.md); "
                        "seq2seq and token classification are not mapped yet")


def _rows(dataset: Any, split: str) -> Any:
    if dataset is None:
        return []
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise WorkbookError(f"the {split} dataset is a {type(dataset).__name__}, not a "
                            "map-style dataset (a datasets.Dataset or a list of dicts)",
                            "pass a datasets.Dataset (not an IterableDataset) or a list")
    if len(dataset) and not isinstance(dataset[0], dict):
        raise WorkbookError(f"rows of the {split} dataset are {type(dataset[0]).__name__}, not "
                            "dicts of token ids", "tokenize it first (dataset.map(tokenize))")
    if len(dataset) and "input_ids" not in dataset[0]:
        raise WorkbookError(f"rows of the {split} dataset have no input_ids (columns "
                            f"{sorted(dataset[0])})", "tokenize it first (dataset.map(tokenize))")
    return dataset


def _prompts(tokenizer: Any, response_template: str | None,
             first: dict) -> Callable[[dict], int] | None:
    """How many leading tokens of a row are its prompt: up to and including the first
    `response_template`, or the chat template's rendering of every message but the last with
    the generation prompt; 0 where it is not found (a completion-only collator then masks the
    whole row, which 01 names as an example without targets)."""
    if response_template is not None:
        marker = tokenizer(response_template, add_special_tokens=False)["input_ids"]
        if not marker:
            raise WorkbookError(f"the response template {response_template!r} tokenizes to "
                                "nothing", "give the text that starts every answer")

        def after_marker(row: dict) -> int:
            ids = list(row["input_ids"])
            for i in range(len(ids) - len(marker) + 1):
                if ids[i:i + len(marker)] == marker:
                    return i + len(marker)
            return 0
        return after_marker
    if "messages" in first and getattr(tokenizer, "chat_template", None):
        def chat_prompt(row: dict) -> int:
            rendered = tokenizer.apply_chat_template(
                row["messages"][:-1], add_generation_prompt=True, tokenize=True)
            prefix = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
            ids = list(row["input_ids"])
            return len(prefix) if ids[:len(prefix)] == prefix else 0
        return chat_prompt
    return None


def _padding_row(label: Any) -> bool:
    """A row whose label is -100 everywhere: padding (an eval set filled up to a multiple of
    the eval batch, as the Hugging Face convention pads), never an example."""
    if label is None:
        return False
    values = np.asarray(label)
    return values.size > 0 and values.dtype.kind in "iu" and bool((values == IGNORE_INDEX).all())


# --- compute_metrics: the Trainer's whole-split metrics through the per-batch sums --------------
def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """Batches joined along the rows; sequences of other widths padded with -100, as the
    Trainer's `nested_concat` pads them."""
    if not parts:
        return np.zeros((0,))
    if parts[0].ndim < 2 or len({p.shape[1] for p in parts}) == 1:
        return np.concatenate(parts)
    width = max(p.shape[1] for p in parts)
    return np.concatenate([np.pad(p, [(0, 0), (0, width - p.shape[1])] +
                                  [(0, 0)] * (p.ndim - 2), constant_values=IGNORE_INDEX)
                           for p in parts])


def _metric_values(compute_metrics: Callable, predictions: np.ndarray,
                   label_ids: np.ndarray) -> dict[str, float]:
    from transformers import EvalPrediction

    try:
        got = compute_metrics(EvalPrediction(predictions=predictions, label_ids=label_ids))
    except Exception as exc:
        raise WorkbookError(f"from_hf: compute_metrics raised {type(exc).__name__}: "
                            f"{reason(exc, 300)}", "fix compute_metrics: it receives a "
                            "transformers.EvalPrediction (predictions, label_ids) of the whole "
                            "eval split, as Trainer.evaluate calls it") from exc
    try:
        return {str(k): float(v) for k, v in dict(got).items()}
    except (TypeError, ValueError) as exc:
        raise WorkbookError(f"from_hf: compute_metrics returned {str(got)[:80]!r}, not a dict "
                            "of numbers", "return {name: float}, e.g. "
                            '{"accuracy": 0.91}') from exc


class _SplitMetrics:
    """`compute_metrics` as the Trainer calls it - once, on the predictions and labels of the
    whole eval split - mapped onto the workbook's per-batch sums without approximation: each
    batch adds the rows seen so far to one running split, calls compute_metrics on all of it
    and returns, per metric, (N_k x M_k - N_k-1 x M_k-1, rows of the batch). The sums over the
    split telescope to (N x M, N), so the ratio the workbook reports is M, the Trainer's value,
    for any metric (F1 too), any batching. A new evaluation starts when the model's weights
    changed, a row comes again or another split begins. Rows with label -100 (padding, the
    loop's zero-weight copies) never reach compute_metrics."""

    def __init__(self, compute_metrics: Callable, preprocess: Callable | None):
        self.compute_metrics, self.preprocess = compute_metrics, preprocess
        self.key: Any = None
        self.split: int | None = None
        self.seen: set[int] = set()
        self.predictions: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.rows, self.values = 0, {}

    def __call__(self, task: Task, model: nn.Module, batch: dict) -> dict[str, tuple]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = task.forward(model, batch)
        finally:
            model.train(was_training)
        labels = batch["labels"]
        real = ~(labels == IGNORE_INDEX).reshape(len(labels), -1).all(1)
        if EXAMPLE_WEIGHT in batch:
            real &= batch[EXAMPLE_WEIGHT].reshape(-1) > 0
        rows = batch[ROW].reshape(-1)[real].tolist() if ROW in batch else []
        split = rows[0] // ROW_OFFSET if rows else None
        key = (id(model), _version(model))
        if key != self.key or set(rows) & self.seen or (
                split is not None and self.split is not None and split != self.split):
            self.seen, self.predictions, self.labels = set(), [], []
            self.rows, self.values, self.split = 0, {}, None
        self.key, self.split = key, split if split is not None else self.split
        self.seen.update(rows)
        n = int(real.sum())
        if not n:
            return {name: (0.0, 0.0) for name in self.values}
        mine = logits[real]
        if self.preprocess is not None:
            mine = self.preprocess(mine, labels[real])
        self.predictions.append(mine.float().cpu().numpy())
        self.labels.append(labels[real].cpu().numpy())
        values = _metric_values(self.compute_metrics, _concat(self.predictions),
                                _concat(self.labels))
        total = self.rows + n
        out = {name: (total * v - self.rows * self.values.get(name, 0.0), float(n))
               for name, v in values.items()}
        self.rows, self.values = total, values
        return out


def _version(model: nn.Module) -> int:
    """A counter every in-place change of the weights advances (an update, a restore)."""
    try:
        return sum(p._version for p in model.parameters())
    except (AttributeError, RuntimeError):
        return 0


def _probe_padding(compute_metrics: Callable, labels: list, num_labels: int) -> None:
    """The Trainer hands compute_metrics every row of the eval set, its padding rows (label
    -100) too: with perfect predictions on the real rows, the metrics must not change when the
    padding rows are left out - else compute_metrics counts them."""
    ids = np.asarray(labels)
    real = ids != IGNORE_INDEX
    predictions = np.eye(num_labels)[np.where(real, ids, 0).clip(0, num_labels - 1)]
    every = _metric_values(compute_metrics, predictions, ids)
    only = _metric_values(compute_metrics, predictions[real], ids[real])
    changed = {k: (every[k], only.get(k)) for k in every
               if only.get(k) is None or not math.isclose(every[k], only[k], rel_tol=1e-9,
                                                          abs_tol=1e-12)}
    if changed:
        name, (a, b) = next(iter(changed.items()))
        raise WorkbookError(
            f"from_hf: compute_metrics counts the eval dataset's {int((~real).sum())} padding "
            f"rows (label -100), which Trainer.evaluate passes it: with perfect predictions "
            f"{name} is {a:.4g} with them and {b:.4g} without, so the campaign's reported "
            f"{', '.join(changed)} would be off",
            "keep only the rows that count in compute_metrics: mask = labels != -100; "
            "predictions, labels = predictions[mask], labels[mask]")


# --- the Trainer's schedule and callbacks ---------------------------------------------------
MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> model


def _run_updates() -> int | None:
    """The number of updates of the run whose stepper `loop.build_stepper` is building
    (`loop.current_run()`); None outside one."""
    run = current_run()
    return int(run.updates) if run is not None else None


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
        # the Trainer's own count, stretched to a pilot run that makes more updates (a
        # schedule that ends before the run would train its last updates at lr 0)
        total = max(_trainer_updates(args, train_rows), _run_updates() or 0, 2)
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
    files: config.json and model.safetensors, optimizer.pt, scheduler.pt, scaler.pt,
    trainer_state.json; then the callbacks' `on_save`. `save_only_model=True` leaves the
    optimizer and schedule out, as the Trainer does (a checkpoint it cannot resume from)."""
    from safetensors.torch import load_model, save_model

    def save_state(folder: Any, objects: dict) -> None:
        folder = Path(folder)
        model, sched = objects["model"], objects.get("scheduler")
        if hasattr(model, "config") and callable(getattr(model.config, "to_json_file", None)):
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


def from_hf(model_factory: Callable[[], nn.Module], train_dataset: Any, eval_dataset: Any,
            data_collator: Callable, tokenizer: Any, args: Any = None, *, name: str,
            test_dataset: Any = None, group_column: str | None = None,
            label_column: str | None = None, response_template: str | None = None,
            compute_metrics: Callable | None = None, callbacks: list | None = None,
            preprocess_logits_for_metrics: Callable | None = None,
            **task_fields: Any) -> Task:
    """A Task over tokenized rows (dicts with input_ids; a `datasets.Dataset` or a list), the
    user's `data_collator` and `tokenizer` (decoding, padding side), `args` (a
    `TrainingArguments` or any object with `learning_rate`, `weight_decay`, `adam_beta1/2`,
    `adam_epsilon`) for the learning rate and AdamW, and - from a `TrainingArguments` - the
    schedule (`lr_scheduler_type`, warm-up) and the checkpoint (`save_only_model`). A causal LM
    keeps the Hugging Face convention (labels aligned with input_ids, `label_shift=1`; its loss
    is the model's own, summed over the targets of the whole update as `num_items_in_batch`
    does); a sequence classifier reads `label_column` (default: the first of labels, label,
    label_ids the rows have) and the model config's `id2label`. Rows whose label is -100 are
    padding, left out (`task.padding_rows` counts them per split). The collator receives the
    rows as the Trainer hands them (the columns the model's forward takes and the label
    columns, every column with `remove_unused_columns=False`). `compute_metrics` (an
    `EvalPrediction` of the whole split -> {name: float}) becomes the evaluation, exactly;
    `callbacks` get on_train_begin, on_step_end and on_save in the pilot's runs.
    `group_column` names the unit of leakage (default: each row its own group). The prompt of a
    causal LM's row is found by `response_template` (the text that starts the answer, as a
    completion-only collator finds it) or, for rows with a `messages` column, by the
    tokenizer's chat template (every message but the last, with the generation prompt): 01
    then checks the collator keeps it out of the loss (`prompt_in_loss=True` says it should be
    in). Other Task fields pass through."""
    probe = probe_on_meta(model_factory, "model", "pass a factory that builds the model from "
                          "its config (no download inside it)")
    kind, shift = _kind(probe)
    target = kinds.of(kind)
    data = {split: _rows(d, split) for split, d in zip(SPLITS, (train_dataset, eval_dataset,
                                                               test_dataset), strict=True)}
    if not len(data["train"]) or not len(data["validation"]):
        raise WorkbookError("from_hf needs a train and an eval dataset with rows",
                            "pass both (the pilot evaluates on the eval dataset)")
    id2label = getattr(probe.config, "id2label", None) or {}
    label_names = [str(id2label.get(i, i)) for i in range(probe.config.num_labels)] \
        if target.named_classes else None
    first_row = data["train"][0]
    if label_column is None:
        label_column = next((c for c in LABEL_COLUMNS if c in first_row), "labels")
    own_labels = label_column in first_row  # else the collator makes them
    if target.named_classes and not own_labels:
        raise WorkbookError(f"rows of the train dataset have no label column (columns "
                            f"{sorted(first_row)})", "give the rows a 'label' (class id) "
                            "column, or name yours with label_column=")
    prompt_of = _prompts(tokenizer, response_template, first_row) \
        if target.prompts else None
    forward_takes = accepted_inputs(type(probe))
    keep_all = "**" in forward_takes or getattr(args, "remove_unused_columns", True) is False
    kept = set(forward_takes) | set(LABEL_COLUMNS) | set(getattr(args, "label_names", None)
                                                         or ()) | {label_column}
    notes: list[str] = []

    def tensors(row: dict) -> dict[str, torch.Tensor]:
        """The row's columns as the Trainer hands them to the collator, as tensors (the label
        column under "labels", the pilot's name); text and other unused columns left out."""
        out = {}
        for k, v in row.items():
            if not (keep_all or k in kept) or isinstance(v, str):
                continue
            try:
                t = torch.as_tensor(v)
            except (TypeError, ValueError, RuntimeError):
                continue
            if t.dtype.is_floating_point or t.dtype in (torch.int64, torch.int32, torch.bool,
                                                        torch.int16, torch.int8, torch.uint8):
                out["labels" if k == label_column else k] = t
        return out

    def collated(rows: list[dict]) -> dict[str, torch.Tensor]:
        # the rows as the dataset holds them: the label column under its own name, labels the
        # collator made (encode) left out; the pilot's renaming is done on the batch after
        given = [{(label_column if k == "labels" else k):
                  (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()
                  if (k != "labels" or own_labels) and k not in (PROMPT, ROW)} for r in rows]
        try:
            out = dict(data_collator(given))
        except Exception as exc:
            raise WorkbookError(f"the data collator raised {type(exc).__name__}: {reason(exc)}",
                                "fix the collator, or pass the one your Trainer uses") from exc
        if "labels" not in out:
            for alias in (label_column, "label", "label_ids"):
                if alias in out:
                    out["labels"] = out.pop(alias)
                    break
        copies = [i for i, r in enumerate(rows) if "labels" in r and
                  bool((torch.as_tensor(r["labels"]) == IGNORE_INDEX).all())]
        if copies and "labels" in out:  # evaluation's padding copies weigh nothing, whatever
            out["labels"] = torch.as_tensor(out["labels"]).clone()  # the collator made
            out["labels"][copies] = IGNORE_INDEX
        if "labels" not in out:
            raise WorkbookError("the data collator returns no labels (keys "
                                f"{sorted(out)})", "use a collator that makes labels "
                                "(DataCollatorForLanguageModeling(tokenizer, mlm=False) for a "
                                "causal LM) or give the rows a labels column")
        try:
            out = {k: torch.as_tensor(v) for k, v in out.items()}
        except (TypeError, ValueError, RuntimeError) as exc:
            raise WorkbookError(f"the data collator returns values that are not tensors "
                                f"({reason(exc)}; keys {sorted(out)})", "return a dict of "
                                "tensors (return_tensors='pt')") from exc
        if rows and all(PROMPT in r for r in rows):  # padded as the collator padded input_ids
            width = out["input_ids"].shape[1]
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for b, r in enumerate(rows):
                n = min(len(r[PROMPT]), width)
                if tokenizer.padding_side == "left":
                    mask[b, width - n:] = r[PROMPT][-n:] if n else False
                else:
                    mask[b, :n] = r[PROMPT][:n]
            out[PROMPT] = mask
        if rows and all(ROW in r for r in rows):
            out[ROW] = torch.stack([torch.as_tensor(r[ROW]).reshape(()) for r in rows])
        return out

    def encode(ex: dict) -> dict[str, torch.Tensor]:
        row = data[ex["split"]][ex["index"]]
        one = tensors(row)
        # the labels the collator makes of this row alone: the ones the campaign trains on
        one["labels"] = collated([one])["labels"][0]
        if prompt_of is not None:
            one[PROMPT] = torch.arange(len(one["input_ids"])) < prompt_of(row)
        one[ROW] = torch.tensor(SPLITS.index(ex["split"]) * ROW_OFFSET + ex["index"])
        return one

    def label_name(value: Any) -> str:
        i = int(value)
        return label_names[i] if 0 <= i < len(label_names) else f"<{i}?>"

    padding_rows: dict[str, int] = {}
    eval_labels: list = []

    def read_rows() -> list[dict]:
        out = []
        for split, dataset in data.items():
            for i in range(len(dataset)):
                step = "rows"
                try:
                    row = dataset[i]
                    step = "labels"
                    label = row.get(label_column)
                    if split == "validation" and target.named_classes:
                        eval_labels.append(int(label))
                    if _padding_row(label):
                        padding_rows[split] = padding_rows.get(split, 0) + 1
                        continue
                    ex = {"id": f"{split}-{i}", "split": split, "index": i,
                          "group": str(row[group_column]) if group_column else f"{split}-{i}"}
                    if target.named_classes:
                        ex["label"] = label_name(label)
                except WorkbookError:
                    raise
                except Exception as exc:
                    raise WorkbookError(
                        f"from_hf: reading the {'eval' if split == 'validation' else split} "
                        f"dataset's {step} failed at row {i}: {type(exc).__name__}: "
                        f"{reason(exc, 200)}",
                        f"give every row of the {split} dataset a {label_column!r} class id "
                        "(-100 for a padding row)" if step == "labels" else
                        f"check the {split} dataset's row {i}") from exc
                out.append(ex)
        return out

    def load() -> list[dict]:
        padding_rows.clear()
        eval_labels.clear()
        examples = read_rows()
        notes[:] = [n for n in notes if "label -100" not in n] + [
            f"from_hf: {n} rows of the {'eval' if split == 'validation' else split} dataset "
            "have label -100 (padding): left out, they are no examples"
            for split, n in padding_rows.items()]
        task.padding_rows = dict(padding_rows)
        if not any(ex["split"] == "validation" for ex in examples):
            raise WorkbookError("from_hf: every row of the eval dataset has label -100",
                                "pass the eval dataset with its labelled rows")
        if compute_metrics is not None and target.named_classes and padding_rows.get(
                "validation"):
            _probe_padding(compute_metrics, eval_labels, len(label_names))
        return examples

    fields: dict[str, Any] = {"lr": getattr(args, "learning_rate", None)}
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
    trainer_args = args is not None and type(args).__name__.endswith("TrainingArguments")
    hooks = None
    if callbacks:
        if not trainer_args:
            raise WorkbookError("from_hf: callbacks need the TrainingArguments they are called "
                                "with", "pass args=TrainingArguments(...)")
        quiet = copy.copy(args)  # the pilot never writes into the campaign's output_dir
        object.__setattr__(quiet, "output_dir", tempfile.mkdtemp(prefix="from_hf-"))
        hooks = _Callbacks(list(callbacks), quiet, tokenizer)
    if trainer_args:
        fields["build_scheduler"] = _scheduler_factory(args, len(data["train"]), hooks, notes)
        save_only = bool(getattr(args, "save_only_model", False))
        fields["save_state"], fields["restore_state"] = _checkpoint_code(args, hooks, save_only)
        strategy = str(getattr(getattr(args, "save_strategy", "steps"), "value",
                               getattr(args, "save_strategy", "steps")))
        if strategy == "no":
            notes.append("from_hf: save_strategy 'no': the campaign writes no checkpoint, so "
                         "a preempted rental restarts from nothing (07 still checks a resume)")
    if compute_metrics is not None:
        split_metrics = _SplitMetrics(compute_metrics, preprocess_logits_for_metrics)
        fields["eval_step"] = lambda model, batch: split_metrics(task, model, batch)
    fields.update(task_fields)
    first = collated([encode({"split": "train", "index": 0})])

    def decode(ids) -> str:  # token ids, or a classifier's class ids, for people
        if target.causal:
            return tokenizer.decode([int(i) for i in ids if int(i) >= 0])
        return ", ".join(label_name(i) for i in ids)

    shown = {"decode": decode, "decode_input": lambda ids: tokenizer.decode([int(i) for i in ids])}
    generation = {"label_shift": shift, "padding_side": tokenizer.padding_side,
                  "prompt_in_loss": prompt_of is None and task_fields.get("prompt_field")
                  is None} \
        if target.causal else {"label_names": label_names, "label_field": "label"}
    task = Task(name=name, kind=kind, load_examples=load, encode=encode, collate=collated,
                build_model=model_factory, model_inputs=tuple(k for k in INPUTS if k in first),
                split_of=lambda ex: ex["split"], **{**shown, **generation, **fields})
    task.padding_rows = {}  # per split: rows with label -100, left out (set by load_examples)
    task.adapter_notes = notes  # what the adapter mapped or left out, in words
    return task
