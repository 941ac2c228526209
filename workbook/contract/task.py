"""The task contract: what a user's training task supplies to the pilot, and how it is loaded.

A task is named by an import path `package.module:attribute`. The attribute is a `Task`, or a
callable returning one (called with the options given to `load_task`).
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..base.errors import WorkbookError, reason
from . import kinds
from .framework_facts import FrameworkFacts
from .kinds import KINDS, Kind
from .model_factory import ModelFactory
from .outputs import (
    ModelOutputs,
    accepted,
    batch_major,
    forward_owner,
    model_outputs,
    positional_parameters,
)
from .state import CarriedState, state_in, state_out

# the loss pieces a task module uses are public here too (`from workbook.contract.task import ...`)
from .targets import (  # noqa: F401
    IGNORE_INDEX,
    absolute_error,
    contributes,
    shift_labels,
    squared_error,
    target_accuracy,
    token_cross_entropy,
)


def logits_of(outputs: Any) -> Tensor:
    """The logits of a model's output: a tensor, or an object with `.logits` (Hugging Face)."""
    return outputs.logits if hasattr(outputs, "logits") else outputs


def adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The default optimizer: AdamW with PyTorch's defaults besides the learning rate, over the
    parameters that require gradients."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def split_by_group_hash(group: str, fractions: Sequence[float]) -> str:
    """A stable split name for a group key: the same group lands in the same split everywhere."""
    import hashlib

    digest = hashlib.sha256(str(group).encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    edge = 0.0
    for name, fraction in zip(("train", "validation", "test"), fractions, strict=True):
        edge += fraction
        if u < edge:
            return name
    return "test"


@dataclass(eq=False)  # a task is itself: compared and hashed as the one object it is
class Task:
    """A training task as the pilot sees it. Required fields first; the rest have defaults.

    Raw examples are dicts carrying `id_key` and `group_key` (the unit of leakage). `encode` turns
    one into tensors for one example (including `labels`, -100 where nothing is learned, and
    optionally `prompt_mask`); `collate` pads a list of them into a batch dict with an attention
    mask; `loss` returns (summed loss, number of contributing targets) so the loop normalises over
    the whole effective batch.
    """

    name: str
    kind: str  # "generation", "classification", "regression" or "token_classification"
    load_examples: Callable[[], list[dict]]
    encode: Callable[[dict], dict[str, Tensor]]
    collate: Callable[[list[dict[str, Tensor]]], dict[str, Tensor]]
    build_model: Callable[[], nn.Module]  # the model the pilot machine trains
    decode: Callable[[Sequence[int]], str]
    loss: Callable[[Tensor, dict[str, Tensor]], tuple[Tensor, Tensor]] = token_cross_entropy
    metrics: Callable[[Tensor, dict[str, Tensor]], dict[str, tuple[float, float]]] = (
        target_accuracy
    )
    build_optimizer: Callable[[nn.Module, float], torch.optim.Optimizer] = adamw  # (model, lr)
    lr: float | None = None  # the task's own learning rate: notebooks whose `lr` is 0 use it
    # the task's own learning-rate schedule: build_scheduler(optimizer) -> an object with
    # step(), state_dict() and load_state_dict() (an LRScheduler), stepped after every update
    # (or pass: `scheduler_interval`) in place of the workbook's warm-up; None: the warm-up
    build_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    # the gradient norm the campaign's updates clip at (None: they do not clip) - the
    # framework's own (max_grad_norm, gradient_clip_val) through the adapters; 02 and 03 make
    # the workbook's updates at it
    grad_clip: float | None = 1.0
    id_key: str = "id"
    group_key: str = "group"
    model_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    split_of: Callable[[dict], str] | None = None  # default: hash of the group key
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    label_names: list[str] | None = None  # classification: id -> class name
    label_field: str | None = None  # classification: raw field holding the class name
    # classification: per split ("train", "validation", "test"), class name -> id as that
    # split's own data numbers them (from_torch reads a dataset's class_to_idx / classes,
    # from_hf its ClassLabel names); 01 checks every split, label_names and the model's
    # id2label agree
    class_maps: dict[str, dict[str, int]] | None = None
    prompt_field: str | None = None  # generation: raw field of the instruction
    response_field: str | None = None  # generation: raw field of the response
    prompt_in_loss: bool = False  # generation: do prompt tokens contribute to the loss?
    # the model starts from trained weights (a fine-tune): 02 and 03 expect its own loss, not
    # ln(outputs); a model with PEFT adapters is taken as one without it (contract/fine_tuning)
    pretrained: bool = False
    end_token: int | None = None  # generation: the id that ends a response (EOS); 01: trained?
    # the longest sequence the campaign trains (a trainer's max_length, which truncates to it):
    # 03/05/08 plan at it rather than at the model's position limit
    max_length: int | None = None
    generate: Callable[[nn.Module, dict], str] | None = None  # greedy decoding, for display
    decode_input: Callable[[Sequence[int]], str] | None = None  # input ids -> text, for display
    checkpoint_blocks: Callable[[nn.Module], bool] | None = None  # default: ModuleList items
    # generation: how labels align with the logits - 0: position t predicts labels[t] (the
    # samples); 1: position t predicts labels[t + 1], labels aligned with input_ids (Hugging
    # Face causal LMs). The default loss and metrics follow it; every check reads it.
    label_shift: int = 0
    padding_side: str = "auto"  # "left", "right", or "auto": read from the collated mask
    # your own checkpoint code (both or neither): save_state(folder, objects) writes plain files
    # into a new folder; restore_state(folder, objects) loads them back into the same objects
    # {"model", "optimizer", "scheduler", "scaler"} (None where absent). The workbook adds the
    # loop's counters and random states, and checks every part came back as it was saved.
    # The objects also carry "sampler" (the loop's make_sampler object, None without one) and
    # "step" (updates done). A restore_state that changes the sampler's state or sets
    # objects["step"] is taken at its word: the workbook then repairs neither behind its back.
    # your own update: train_step(model, optimizer, micro_batches) runs one whole update over
    # the list of batch dicts (accumulation included), calls optimizer.step() once and returns
    # the update's loss (a tensor, a float or a dict with "loss"); notebook 04 checks its
    # gradient is the same for 1 x N, k x N/k and N x 1 micro-batches with dropout and batch
    # norm held fixed, and that its loss is the task's `loss` on the same batch
    train_step: Callable[[nn.Module, Any, list[dict[str, Tensor]]], Any] | None = None
    # your own evaluation: eval_step(model, batch) -> {name: (sum, count)} for one batch (the
    # workbook sums them over the split); notebook 04 checks it against the workbook's own:
    # padding copies of the last partial batch weigh zero (batch["example_weight"] is 0 for
    # them), counts do not depend on the evaluation batch size, and the model's mode is what it
    # was before the call
    eval_step: Callable[[nn.Module, dict[str, Tensor]], dict[str, tuple]] | None = None
    # your own data order: make_sampler(n, seed) -> an iterable of example indices for one pass
    # (set_epoch(epoch) is called before each pass when it has one; state_dict/load_state_dict
    # when it keeps state across passes - the state travels in the checkpoint)
    make_sampler: Callable[[int, int], Any] | None = None
    # your own training data pipeline: train_pipeline(seed, rank=0, world=1, workers=0,
    # micro_batch=1) (the arguments it names) returns what your training loop iterates - an
    # IterableDataset, a DataLoader with batch_size=None or collate_fn=list, a
    # StatefulDataLoader, a streaming datasets.IterableDataset - giving raw example dicts in
    # training order, pass after pass (set_epoch(epoch) before each when it has one). Notebook
    # 07 trains from it and resumes it: by its own state_dict/load_state_dict when it has both,
    # else by reading the examples already read again (count-and-skip); 09 checks its ranks
    train_pipeline: Callable[..., Any] | None = None
    save_state: Callable[[Any, dict[str, Any]], None] | None = None
    restore_state: Callable[[Any, dict[str, Any]], None] | None = None
    # the model the rental will train, when it is bigger than the pilot machine: build_model is
    # then its pilot twin (same code and module types, fewer layers, narrower). Notebooks 03, 05
    # and 08 size this model on fake tensors only - it is never allocated here - and check the
    # prediction against a real run of the twin; every other notebook trains the twin
    # (workbook.campaign.from_config derives both from a transformers config)
    campaign_model: Callable[[], nn.Module] | None = None
    # where the forward's output holds the logits and the model's own loss (`model_outputs`):
    # None finds them (a tensor; `.logits`/`.loss`; a dict's "logits"/"loss"; a tuple's first
    # float tensor with the batch's leading dims, and its one 0-d float tensor as the loss); an
    # int indexes a tuple (nanoGPT's (logits, loss): 0 and 1), a str names a key or attribute
    logits_at: int | str | None = None
    loss_at: int | str | None = None
    # batch key -> the forward's parameter that receives it, where the names differ (found
    # without it: the main input goes in first when the forward has no parameter of its name,
    # and "labels" reaches a forward's `targets`, as nanoGPT's forward(idx, targets) takes them)
    forward_names: dict[str, str] = field(default_factory=dict)
    # state carried from one batch to the next (an RNN's hidden state in truncated
    # backpropagation through time): CarriedState(init=lambda model, rows:
    # model.init_hidden(rows)) - the workbook passes it to the forward, keeps it per stream,
    # detaches it, resets it each pass, reads a pass in order and checkpoints it (state.py)
    state: CarriedState | None = None
    # the forward takes [time, batch] inputs and returns [time, batch, ...] (or flattened
    # [time * batch, ...]) outputs - nn.RNN / nn.LSTM's default batch_first=False; batches
    # stay [batch, time] everywhere else, the model call transposes
    time_major: bool = False
    # the collate of training batches only (batch-level augmentation: mixup, cutmix drawn per
    # batch); `collate` stays the evaluation one, and training's when this is None
    train_collate: Callable[[list[dict[str, Tensor]]], dict[str, Tensor]] | None = None
    # when the loop steps the task's build_scheduler: "update" (after every optimizer step) or
    # "pass" (once per pass over the training data, before the next pass's first update - a
    # per-epoch schedule: torchvision's reference scripts, Lightning's interval="epoch")
    scheduler_interval: str = "update"
    # an averaged copy of the model kept beside it (EMA, SWA): averaged_model(model) -> e.g.
    # AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)) (torch.optim.swa_utils),
    # built once per run; the loop calls its update_parameters(model) after every
    # `average_every`-th update, evaluates it beside the model and checkpoints it
    averaged_model: Callable[[nn.Module], nn.Module] | None = None
    average_every: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    # what a framework adapter learned about the user's code (contract/framework_facts.py)
    framework: FrameworkFacts = field(default_factory=FrameworkFacts)

    def __post_init__(self):
        if callable(self.build_model) and not isinstance(self.build_model, ModelFactory):
            self.build_model = ModelFactory(self.build_model)
        if callable(self.campaign_model) and not isinstance(self.campaign_model, ModelFactory):
            self.campaign_model = ModelFactory(self.campaign_model, "campaign_model")
        kind = KINDS.get(self.kind) if isinstance(self.kind, str) else None  # else: named by
        # validate_task
        if kind is not None and self.loss is token_cross_entropy:
            self.loss = kind.default_loss
        if kind is not None and self.metrics is target_accuracy:
            self.metrics = kind.default_metrics
        if self.label_shift and self.loss is token_cross_entropy:
            self.loss = functools.partial(token_cross_entropy, shift=self.label_shift)
        if self.label_shift and self.metrics is target_accuracy:
            self.metrics = functools.partial(target_accuracy, shift=self.label_shift)

    @property
    def target_kind(self) -> Kind:
        """What the task's kind decides (`workbook/contract/kinds/`)."""
        return kinds.of(self.kind)

    def targets(self, labels: Tensor) -> Tensor:
        """The labels each logit position is trained to predict (`label_shift` applied), for
        one example or a batch; -100 where none."""
        return self.target_kind.targets(labels, self.label_shift)

    def collator(self, training: bool = False) -> Callable[[list[dict[str, Tensor]]],
                                                           dict[str, Tensor]]:
        """The collate of training batches (`train_collate`, else `collate`) or of the rest."""
        return (self.train_collate or self.collate) if training else self.collate

    @property
    def schedule_per_update(self) -> bool:
        """Whether the loop steps the schedule after every update (else once per pass)."""
        return self.build_scheduler is None or self.scheduler_interval == "update"

    def clipping(self) -> str:
        """The clipping the workbook's updates of this task use, in words (02 and 03 say it)."""
        return (f"clip {self.grad_clip:g} (the task's grad_clip)" if self.grad_clip else
                "no clipping (the task's grad_clip is None)")

    def optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """The task's optimizer for `model`, built by `build_optimizer(model, lr)`."""
        try:
            return self.build_optimizer(model, lr)
        except TypeError as exc:  # most often a build_optimizer written for a parameter list
            raise WorkbookError(
                f"build_optimizer of {self.name!r} failed on the model it receives ({exc})",
                "build_optimizer(model, lr) receives the model: pass model.parameters(), or "
                "parameter groups by name (e.g. no weight decay on norms and biases)") from exc

    def learning_rate(self, given: float, fallback: float = 1e-3) -> float:
        """The learning rate a notebook uses: the one given, else (0) the task's, else
        `fallback`."""
        return given or self.lr or fallback

    def predicted(self, outputs: Tensor, labels: Tensor) -> Tensor:
        """What the model predicts, laid out as the labels: the argmax id at every position, or
        the output values for regression."""
        return self.target_kind.predicted(outputs, labels)

    def target_count(self, labels: Tensor) -> int:
        """How many targets these labels give the loss."""
        return int(contributes(self.targets(labels)).sum())

    def side(self, batch: dict[str, Tensor]) -> str:
        """Which side a collated batch is padded on: the declared `padding_side`, or read from
        its attention mask (a row starting with 0 is left-padded)."""
        if self.padding_side != "auto":
            return self.padding_side
        mask = batch.get("attention_mask")
        if mask is not None and mask.dim() > 1 and bool((mask[:, 0] == 0).any()):
            return "left"
        return "right"

    def real_part(self, output: Tensor, length: int, side: str) -> Tensor:
        """The first `length` positions of a right-padded row, the last of a left-padded one."""
        return output[-length:] if side == "left" else output[:length]

    def split(self, example: dict) -> str:
        """Which split ("train", "validation", "test") an example belongs to."""
        if self.split_of is not None:
            return self.split_of(example)
        return split_by_group_hash(example[self.group_key], self.split_fractions)

    def main_input(self, tensors: dict[str, Tensor]) -> Tensor:
        """The first model input present (token ids for the samples): it sets the length."""
        return next(tensors[k] for k in self.model_inputs if k in tensors)

    def length(self, tensors: dict[str, Tensor]) -> int:
        """Positions of one encoded example (elements of its main input)."""
        return self.main_input(tensors).numel()

    def forward(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """The logits of the model on the batch (`outputs`)."""
        return self.outputs(model, batch).logits

    def outputs(self, model: nn.Module, batch: dict[str, Tensor]) -> "ModelOutputs":
        """The one place the package calls the model: the batch's model inputs go in as
        `forward_arguments` lays them out, and the logits (and the model's own loss, when it
        computes one) are read from what comes back (`model_outputs`)."""
        args, kwargs = self.forward_arguments(model, batch)
        if self.time_major:
            args = [t.transpose(0, 1) for t in args]
            kwargs = {k: v.transpose(0, 1) for k, v in kwargs.items()}
        if self.state is not None:
            kwargs[self.state.argument] = state_in(self.state, model, batch)
        output = model(*args, **kwargs)
        if self.state is not None:
            output = state_out(self.state, batch, output)
        if self.time_major:
            output = batch_major(output, self.main_input(batch).shape[:2])
        return model_outputs(self, output, batch)

    def forward_arguments(self, model: nn.Module,
                          batch: dict[str, Tensor]) -> tuple[list[Tensor], dict[str, Tensor]]:
        """How the batch's model inputs are passed: one as a positional argument (plain
        modules, nn.Sequential), several as keyword arguments under their names (or
        `forward_names`) - the main input positionally when the forward has no parameter of its
        name, and "labels" as `targets` to a forward that takes targets, not labels."""
        inputs = {k: batch[k] for k in self.model_inputs if k in batch}
        if len(inputs) == 1 and not self.forward_names:
            return list(inputs.values()), {}
        owner = type(forward_owner(model))
        takes = accepted(owner.forward)
        names = {k: self.forward_names.get(k, k) for k in inputs}
        args: list[Tensor] = []
        if "**" not in takes and inputs:
            main = next(iter(inputs))
            first = positional_parameters(owner)[:1]
            if main not in self.forward_names and names[main] not in takes and first and \
                    first[0] not in names.values():
                args.append(inputs.pop(main))
                names.pop(main)
            if "labels" in names and "labels" not in self.forward_names and \
                    "labels" not in takes:
                names["labels"] = next((alt for alt in ("targets", "target") if alt in takes
                                        and alt not in names.values()), "labels")
        refused = [] if "**" in takes else [k for k in inputs if names[k] not in takes]
        if refused:
            shown = ", ".join(names[k] if names[k] == k else f"{names[k]} (from {k})"
                              for k in refused)
            raise WorkbookError(
                f"the model of {self.name!r} takes no argument {shown} "
                f"(its forward accepts {', '.join(takes)}), but the task's model_inputs "
                f"pass {', '.join(self.model_inputs)}",
                "set model_inputs to the batch keys the forward takes, e.g. "
                f"model_inputs={tuple(k for k in self.model_inputs if k not in refused)!r}, or "
                "map a batch key to the forward's parameter: forward_names="
                f"{{{refused[0]!r}: '<parameter>'}}")
        return args, {names[k]: v for k, v in inputs.items()}

    def loss_computed_by(self) -> str | None:
        """Whose code computes the loss the campaign trains on, when it is not the task's
        `loss` on the logits: its own train_step, or its model (given the labels)."""
        if self.train_step is not None:
            return "its own train_step"
        if "labels" in self.model_inputs or self.loss_at is not None:
            return "its model (the forward receives the labels and returns its own loss)"
        return None

    def show_input(self, tensor: Tensor) -> str:
        """One example's main input for people: decoded text when the task says how."""
        if self.decode_input is not None:
            return self.decode_input(tensor.tolist())
        values = tensor.reshape(-1).tolist()
        shown = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in values[:8])
        return f"[{shown}{', ...' if len(values) > 8 else ''}]"

    def expected_initial_loss(self, num_outputs: int, labels: Tensor | None = None) -> float:
        """Loss per target of an untrained model: ln(number of outputs) when it spreads
        probability evenly; for regression, mean(target^2) - its outputs are near 0."""
        return self.target_kind.expected_initial_loss(num_outputs, labels)

    def initial_loss_rule(self, num_outputs: int) -> str:
        """How `expected_initial_loss` is reasoned, for tables."""
        return self.target_kind.initial_loss_rule(num_outputs)


_CALLABLES = ("load_examples", "encode", "collate", "build_model", "decode", "loss", "metrics",
              "build_optimizer")


def validate_task(task: Any, path: str = "task") -> Task:
    """Check every capability at once and raise one error that lists all that are wrong."""
    if not isinstance(task, Task):
        raise WorkbookError(
            f"{path} is a {type(task).__name__}, not a workbook.Task",
            "make the attribute a workbook.Task(...) or a function returning one "
            "(see docs/own-task.md, 'Bring your own task')",
        )
    problems = []
    for name in _CALLABLES:
        if not callable(getattr(task, name)):
            problems.append(f"`{name}` must be callable, got {type(getattr(task, name)).__name__}")
    if task.kind not in KINDS:
        problems.append(f"`kind` must be one of {tuple(KINDS)}, got {task.kind!r}")
    else:
        problems.extend(task.target_kind.required(task))
    fr = task.split_fractions
    if len(fr) != 3 or any(f < 0 for f in fr) or not math.isclose(sum(fr), 1.0):
        problems.append(f"`split_fractions` must be three non-negative shares summing to 1, "
                        f"got {fr}")
    if not task.model_inputs:
        problems.append("`model_inputs` must name at least one batch key passed to the model")
    if not isinstance(task.label_shift, int) or task.label_shift not in (0, 1):
        problems.append(f"`label_shift` must be 0 or 1 (1 only for generation), got "
                        f"{task.label_shift!r}")
    if (task.save_state is None) != (task.restore_state is None):
        problems.append("`save_state` and `restore_state` come together (a checkpoint written "
                        "one way is read back the same way)")
    for name in ("save_state", "restore_state", "make_sampler", "train_pipeline", "train_step",
                 "eval_step", "campaign_model", "train_collate", "averaged_model"):
        if getattr(task, name) is not None and not callable(getattr(task, name)):
            problems.append(f"`{name}` must be callable or None")
    if task.scheduler_interval not in ("update", "pass"):
        problems.append(f"`scheduler_interval` must be 'update' or 'pass', got "
                        f"{task.scheduler_interval!r}")
    elif task.scheduler_interval == "pass" and task.build_scheduler is None:
        problems.append("`scheduler_interval='pass'` steps the task's own schedule: give "
                        "`build_scheduler` too (the workbook's warm-up counts updates)")
    every = task.average_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        problems.append(f"`average_every` must be a whole number of updates >= 1, got "
                        f"{every!r}")
    if task.lr is not None and not (isinstance(task.lr, (int, float)) and task.lr > 0):
        problems.append(f"`lr` must be a positive number or None, got {task.lr!r}")
    clip = task.grad_clip
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not clip >= 0):
        problems.append(f"`grad_clip` must be a number >= 0 or None, got {clip!r}")
    for name in ("logits_at", "loss_at"):
        where = getattr(task, name)
        if where is not None and (isinstance(where, bool) or not isinstance(where, (int, str))):
            problems.append(f"`{name}` must be None, a tuple index or a key/attribute name, got "
                            f"{where!r}")
    names = task.forward_names
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in names.items()):
        problems.append(f"`forward_names` must map batch keys to the forward's parameter "
                        f"names (str -> str), got {names!r}")
    if task.padding_side not in ("auto", "left", "right"):
        problems.append(f"`padding_side` must be 'auto', 'left' or 'right', got "
                        f"{task.padding_side!r}")
    if problems:
        raise WorkbookError(
            f"{path} ({task.name!r}) is not a complete task:\n    - " + "\n    - ".join(problems),
            "supply each capability named above (docs/own-task.md lists them)",
        )
    return task


def own_code(piece: str, fn: Callable, *args: Any, receives: str | None = None,
             whose: str = "the task's", fix: Callable[[str], str] | None = None,
             **kwargs: Any) -> Any:
    """Run one piece of the user's own code (the task's train_step, a script's loop body, a
    LightningModule's hook); its failure becomes an error that names `whose` piece failed and
    the fix: `fix(the failure's text)`, else what the piece receives."""
    try:
        return fn(*args, **kwargs)
    except WorkbookError:
        raise
    except Exception as exc:
        text = reason(exc, 300)
        raise WorkbookError(f"{whose} {piece} failed: {text}", fix(text) if fix else
                            f"fix {piece}" + (f": it receives {receives}" if receives else
                                              "")) from exc


def load_task(path: str, **options: Any) -> Task:
    """Import `package.module:attribute` and return the validated Task it names."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise WorkbookError(
            f"task path {path!r} is not of the form 'package.module:attribute'",
            "name the module and the attribute, e.g. 'workbook.samples.generation:task'",
        )
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise WorkbookError(
            f"task module {module_name!r} cannot be imported ({exc})",
            "check the spelling, and that the module's folder is on PYTHONPATH or installed",
        ) from exc
    except SyntaxError as exc:
        raise WorkbookError(
            f"task module {module_name!r} has a syntax error: {exc.msg} "
            f"({exc.filename}, line {exc.lineno})", "fix that line and run again") from None
    except WorkbookError as exc:  # the task's own refusal (a from_* adapter): its fix stands
        raise WorkbookError(f"importing task module {module_name!r} failed: {exc.problem}",
                            exc.fix) from exc
    except Exception as exc:
        raise WorkbookError(f"importing task module {module_name!r} failed: {exc!r}",
                            "run `python -c 'import " + module_name + "'` to see the error "
                            "in full and fix the module") from exc
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise WorkbookError(
            f"module {module_name!r} has no attribute {attr!r}",
            f"use one of its attributes: {', '.join(public[:12])}",
        )
    obj = getattr(module, attr)
    if not isinstance(obj, Task) and callable(obj):
        takes = accepted(obj)  # a **options parameter takes any
        unknown = sorted(set(options) - set(takes))
        if unknown and "**" not in takes:
            raise WorkbookError(
                f"task options {unknown} are not accepted by {path}",
                f"use only {sorted(takes)}",
            )
        try:
            obj = obj(**options)
        except WorkbookError as exc:  # the task's own refusal: its problem and fix as said
            raise WorkbookError(f"calling {path}({', '.join(options)}) failed: {exc.problem}",
                                exc.fix) from exc
        except Exception as exc:
            raise WorkbookError(f"calling {path}({', '.join(options)}) failed: {exc!r}",
                                "point at a Task, or a function returning one, and check its "
                                "options") from exc
    elif options:
        raise WorkbookError(
            f"{path} is a ready Task and takes no options (got {sorted(options)})",
            "point the task path at a function returning a Task to pass options",
        )
    task = validate_task(obj, path)
    task.options = dict(options)
    return task


def load_recorded_task(recorded: Any, task: str | None, options: dict | None,
                       where: Any) -> Task:
    """Load the task the user names, after checking that it is the one a folder recorded.
    Nothing read from a folder is imported or called: the recorded path is only compared and
    shown, because anyone who can write the folder can change it."""
    import json

    recorded = recorded if isinstance(recorded, dict) else {}
    rec_task, rec_options = recorded.get("task"), recorded.get("task_options") or {}
    given = json.loads(json.dumps(options or {}, default=str))
    if task is None or task != rec_task or given != rec_options:
        from ..storage.processes import command_line, task_args

        shown = command_line(task_args(str(rec_task), rec_options))
        raise WorkbookError(
            f"{where} records the task {rec_task!r} with options {rec_options}; given "
            f"{task!r} with options {given}",
            f"name the task yourself if you trust it: {shown} (a task path read from a folder "
            "is never imported, since anyone who can write the folder can change it)")
    return load_task(task, **(options or {}))
