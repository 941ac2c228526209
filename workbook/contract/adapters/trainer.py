"""`from_trainer`: the trainer a user's script builds - transformers' `Trainer` or TRL's
`SFTTrainer`, constructed and not yet trained - as a Task. What the campaign will run is read
from the trainer itself: its model (PEFT-wrapped where `peft_config` was given), its datasets as
the trainer prepared them (chat template, assistant masks, truncation), its collator, tokenizer,
arguments (optimizer, schedule, checkpointing), `compute_metrics` and the user's callbacks.
Everything past the reading is `from_hf`'s."""

from __future__ import annotations

import contextlib
import copy
import inspect
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from ..task import Task
from .base import Adapter
from .grpo import from_grpo
from .hf import from_hf
from .preference import from_preference
from .reward import from_reward
from .torch import real_on_cpu
from .trainer_step import TrainerStep, own_loss

# callbacks every Trainer adds by itself (progress, logging integrations): not the user's
OWN_CALLBACKS = ("DefaultFlowCallback", "PrinterCallback", "ProgressCallback",
                 "NotebookProgressCallback")
# the trainer classes (and their subclasses) read here: DPOTrainer as preference pairs and
# GRPOTrainer as prompts a policy completes (each by its reader), RewardTrainer as ranked pairs,
# the rest through `from_hf`; the most derived class the trainer is decides
READERS = {"DPOTrainer": from_preference, "GRPOTrainer": from_grpo}
MAPPED = (*READERS, "RewardTrainer", "SFTTrainer", "Trainer")


def _mapped(trainer: Any) -> str | None:
    """The mapped class `trainer` is (or derives from), or None - also for a TRL trainer the
    pilot does not map (KTOTrainer, RLOOTrainer, ...: Trainer subclasses whose batches and loss
    are their own), whatever class of the user's derives from it."""
    mro = type(trainer).__mro__
    own_trl = next((k.__name__ for k in mro if k.__module__.split(".")[0] == "trl"), None)
    if own_trl is not None and own_trl not in MAPPED:
        return None
    names = [k.__name__ for k in mro]
    return next((n for n in names if n in MAPPED), None)


def built(make_trainer: Callable[[], Any], log: list | None = None) -> Any:
    """The trainer `make_trainer()` returns, checked: a mapped trainer class, not yet trained;
    the factory's own failure (TRL or PEFT refusing the setup) in its own words. `log` gets
    the rows each dataset's preparation kept (`_counting`)."""
    if not callable(make_trainer):
        raise WorkbookError(f"from_trainer takes a function that builds the trainer, got "
                            f"{type(make_trainer).__name__}", "pass `make_trainer` (no call): "
                            "def make_trainer(): return SFTTrainer(...)")
    try:
        with _counting(log) if log is not None else contextlib.nullcontext():
            trainer = make_trainer()
    except WorkbookError:
        raise
    except Exception as exc:
        raise WorkbookError(f"building the trainer raised {type(exc).__name__}: "
                            f"{reason(exc, 400)}", "the campaign's script fails at the same "
                            "line: fix the setup it names (no notebook could run)") from exc
    if _mapped(trainer) is None:
        mapped = ("transformers Trainer, TRL SFTTrainer, DPOTrainer, RewardTrainer and "
                  "GRPOTrainer")
        if any(k.__name__ == "Trainer" for k in type(trainer).__mro__):
            raise WorkbookError(f"make_trainer returned a {type(trainer).__name__}: the pilot "
                                f"maps the {mapped}, not this one yet",
                                "write a workbook.Task for it (docs/own-task.md)")
        raise WorkbookError(f"make_trainer returned a {type(trainer).__name__}, not a "
                            f"transformers Trainer nor a TRL trainer ({mapped})",
                            "return the trainer your script builds, before trainer.train()")
    step = getattr(getattr(trainer, "state", None), "global_step", 0) or 0
    if step:
        raise WorkbookError(f"make_trainer returned a trainer that has trained ({step} "
                            "updates): the pilot judges an untrained start",
                            "return the trainer before trainer.train()")
    return trainer


def _own_forwards(model: Any) -> list[str]:
    """Give every module of `model` its class's own forward back where the trainer replaced it
    on the instance (TRL's SFTTrainer patches the base with a fused LM head: a closure over the
    original model, so any copy of the model would still run the original's modules - 09 and
    05 copy models). The pilot calls the model without the trainer's `fused_lm_head` flag, for
    which the patched forward is the original one anyway. Returns the replaced forwards."""
    replaced = []
    for name, module in model.named_modules():
        patched = module.__dict__.get("forward")
        if patched is not None and getattr(patched, "__func__", None) is not \
                type(module).forward:
            del module.forward
            code = getattr(getattr(patched, "__func__", patched), "__code__", None)
            where = f"{code.co_name} of {'/'.join(Path(code.co_filename).parts[-3:])}" \
                if code is not None else type(patched).__name__
            replaced.append(f"{name or type(module).__name__}: {where}")
    return replaced


def copied(model: nn.Module) -> nn.Module:
    """A copy of `model` that shares nothing with it; on the meta device (the pilot's probes,
    the prediction) a copy of its shapes only, no weight copied."""
    if torch.get_default_device().type != "meta":
        with real_on_cpu():
            return copy.deepcopy(model)
    memo: dict[int, Any] = {}  # deepcopy's own memo: each tensor (tied ones once) as meta
    for t in (*model.parameters(), *model.buffers()):
        shape = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(shape, t.requires_grad) if isinstance(t, nn.Parameter) \
            else shape
    with real_on_cpu():
        return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _counting(log: list[dict]) -> Iterator[None]:
    """Record each dataset TRL's SFTTrainer prepares: its name, the dataset given and the rows
    kept. TRL drops the rows truncation leaves without a target, silently; a packed or
    streamed dataset's kept rows are not counted (they are not the given ones)."""
    try:
        from trl import DPOTrainer, RewardTrainer, SFTTrainer
    except ImportError:
        yield
        return
    originals = {k: k.__dict__["_prepare_dataset"] for k in (SFTTrainer, DPOTrainer,
                                                             RewardTrainer)}

    def counting(original: Callable) -> Callable:
        signature = inspect.signature(original)

        def counted(self, *args: Any, **kwargs: Any) -> Any:
            given = signature.bind(self, *args, **kwargs).arguments
            out = original(self, *args, **kwargs)
            dataset = given.get("dataset")
            counts = not given.get("packing") and hasattr(dataset, "__len__") and \
                hasattr(out, "__len__")
            log.append({"name": str(given.get("dataset_name", "train")), "given": dataset,
                        "rows": len(dataset) if counts else None,
                        "kept": len(out) if counts else None})
            return out
        return counted

    for k, original in originals.items():
        k._prepare_dataset = counting(original)
    try:
        yield
    finally:
        for k, original in originals.items():
            k._prepare_dataset = original


def _split(name: str) -> str:
    return "validation" if name == "eval" else name


def _dropped(log: list[dict], args: Any) -> dict[str, tuple[int, int, str]]:
    """Per split, the rows TRL's preparation dropped: (dropped, given, why); refused when it
    dropped every row of one."""
    length = getattr(args, "max_length", None)
    how = getattr(args, "truncation_mode", None)
    why = (f"truncation at max_length={length} ({how}) left them no target, and TRL drops "
           "such rows silently") if how is not None else (
        f"their chosen or rejected sequence is longer than max_length={length}, and "
        "RewardTrainer drops such pairs silently (it never truncates)")
    out = {}
    for entry in log:
        given, kept = entry["rows"], entry["kept"]
        if given is None:
            continue
        if kept == 0 and given:
            raise WorkbookError(
                f"TRL's preparation dropped every one of the {given} {entry['name']} rows: "
                f"{why}", f"raise max_length ({type(args).__name__}(max_length=...))" + (
                    " or use truncation_mode='keep_end', so the assistant turns fit"
                    if how is not None else " past the longest pair"))
        if kept < given:
            out[_split(entry["name"])] = (given - kept, given, why)
    return out


def _groups_before_packing(log: list[dict], column: str) -> dict[str, Any]:
    """The leakage check on the conversations as given, before packing joins them (a packed
    row keeps no group): per split the groups, and the groups in more than one split."""
    groups = {}
    for entry in log:
        dataset = entry["given"]
        names = getattr(dataset, "column_names", None) or []
        if column not in names:
            raise WorkbookError(f"the {entry['name']} dataset given to the trainer has no "
                                f"{column!r} column (columns {sorted(names)})",
                                f"keep {column!r} in the dataset you give the trainer, or "
                                "pass group_column=None")
        groups[_split(entry["name"])] = {str(g) for g in dataset[column]}
    seen = list(groups.values())
    crossing = sorted({g for i, a in enumerate(seen) for b in seen[i + 1:] for g in a & b})
    return {"column": column, "groups": {s: len(g) for s, g in groups.items()},
            "crossing": crossing}


class TrainerAdapter(Adapter):
    """A built trainer as a Task: `__init__` builds it once and reads what its construction
    did (the rows its preparation dropped, the forwards it replaced); `build_model` is a copy
    of the model it built (the trainer's own is never trained: it stays as built),
    `evaluation` its one eval dataset, `groups` the unit of
    leakage its prepared rows keep, `callbacks` the user's own, `train_step` the user's own
    loss code; `task()` hands the rest to `from_hf` (a DPOTrainer to `from_preference`)."""

    def __init__(self, make_trainer: Callable[[], Any], *, name: str,
                 group_column: str | None = None, **task_fields: Any):
        self.make_trainer, self.name, self.group_column = make_trainer, name, group_column
        self.task_fields = task_fields
        self.log: list[dict] = []  # what each dataset's preparation kept
        self.trainer = built(make_trainer, self.log)
        self.dropped = _dropped(self.log, self.trainer.args)
        self.model_class = type(self.trainer.model).__name__
        self.replaced = _own_forwards(self.trainer.model)

    def fresh(self, pick: Callable[[Any], nn.Module]) -> nn.Module:
        """A copy of `pick(trainer)` (`copied`): the model a trainer built anew would hold -
        the Trainer seeds itself from args.seed, so every build makes the same - without
        building one, its datasets prepared again. The forwards the trainer put on the
        instances are given back their class's first (`_own_forwards`), so the copy runs its
        own modules."""
        model = pick(self.trainer)
        _own_forwards(model)
        return copied(model)

    def build_model(self) -> nn.Module:
        """The trainer's model as it was built, as the campaign's script builds it."""
        return self.fresh(lambda t: t.model)

    def evaluation(self) -> Any:
        """The trainer's one eval dataset."""
        evaluation = self.trainer.eval_dataset
        if evaluation is None:
            raise WorkbookError("the trainer has no eval_dataset", "give the trainer an "
                                "eval_dataset (the pilot evaluates on it, as the campaign "
                                "should)")
        if isinstance(evaluation, dict):
            raise WorkbookError(f"the trainer has {len(evaluation)} eval datasets "
                                f"({sorted(evaluation)})", "build the pilot's trainer with the "
                                "one the campaign's decisions rest on")
        return evaluation

    def groups(self) -> tuple[str | None, dict | None]:
        """(the group column of the prepared rows, the groups before packing): packed rows
        keep no group column, so the leakage check reads the rows given to the trainer."""
        train, group_column = self.trainer.train_dataset, self.group_column
        first = next(iter(train), None) if train is not None else None
        if group_column is not None and first is not None and group_column not in first:
            if getattr(self.trainer.args, "packing", False) and self.log:
                return None, _groups_before_packing(self.log, group_column)
            raise WorkbookError(f"the trainer's prepared train rows have no {group_column!r} "
                                f"column (columns {sorted(first)})",
                                f"keep {group_column!r} in the dataset you give the trainer")
        return group_column, None

    def callbacks(self) -> list | None:
        """The callbacks the user gave, not the ones every Trainer adds by itself."""
        return [c for c in self.trainer.callback_handler.callbacks
                if type(c).__name__ not in OWN_CALLBACKS
                and not type(c).__module__.startswith("transformers.integrations")] or None

    def train_step(self, task: Task) -> TrainerStep | None:
        """The update through the user's own loss code, as the Trainer makes it; None when
        the loss is the library's (the pilot computes it from the logits)."""
        if own_loss(self.trainer) is None:
            return None
        return TrainerStep(self.trainer, task.model_inputs, task.label_shift)

    def task(self) -> Task:
        trainer, mapped = self.trainer, _mapped(self.trainer)
        if mapped in READERS or mapped == "RewardTrainer":  # its one eval set, checked
            given = () if mapped in READERS else (self.evaluation(),)
            task = READERS.get(mapped, from_reward)(trainer, self.fresh, *given, name=self.name,
                                                    group_column=self.group_column,
                                                    **self.task_fields)
            task.framework.rows_dropped = self.dropped
            return task
        evaluation = self.evaluation()
        group_column, packed_groups = self.groups()
        task = from_hf(self.build_model, trainer.train_dataset, evaluation,
                       trainer.data_collator, trainer.processing_class, trainer.args,
                       name=self.name, group_column=group_column,
                       compute_metrics=trainer.compute_metrics, callbacks=self.callbacks(),
                       preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
                       **self.task_fields)
        replaced = self.replaced
        facts = task.framework
        facts.notes.insert(0, f"from_trainer: a {type(trainer).__name__}'s model "
                                  f"({self.model_class}), prepared datasets, collator and "
                                  "arguments" + (
                                      f"; the forward the trainer put on the model ("
                                      f"{'; '.join(replaced)}) is left out: the pilot computes "
                                      "the loss from the model's logits, so the campaign's "
                                      "fused loss kernel and its memory saving are not "
                                      "measured here" if replaced else ""))
        facts.rows_dropped, facts.groups_before_packing = self.dropped, packed_groups
        if packed_groups is not None:
            facts.notes.append(
                f"from_trainer: packing joins the conversations into rows that keep no "
                f"{packed_groups['column']!r}, so 01's leakage check ran on the rows given to "
                "the trainer (" + ", ".join(f"{n} {s} groups" for s, n in
                                            packed_groups["groups"].items()) + ")")
        args = trainer.args  # packing: 01 checks that each document attends to itself only
        facts.packed = (f"packing_strategy={getattr(args, 'packing_strategy', None)!r}"
                       if getattr(args, "packing", False) else None)
        step = self.train_step(task)
        if step is not None:  # the user's loss code: every update runs it as the Trainer does
            task.train_step = step
            facts.notes.append(
                f"from_trainer: the loss is {step.where}: each update calls it as "
                "Trainer.training_step does (num_items_in_batch, the division by the "
                "accumulation steps, max_grad_norm), so 04 judges the campaign's own loss code")
        return task


def from_trainer(make_trainer: Callable[[], Any], *, name: str,
                 group_column: str | None = None, **task_fields: Any) -> Task:
    """A Task from the trainer `make_trainer()` builds, exactly as the campaign's script
    builds it (`SFTTrainer(model, args=SFTConfig(...), train_dataset=..., eval_dataset=...,
    processing_class=tokenizer, peft_config=LoraConfig(...))`), called once. Every run starts
    from a copy of the model that trainer built (its base with fresh adapters: the Trainer seeds
    itself from `args.seed`, so a copy is what another call would build).
    `group_column` names the unit of leakage, a column the prepared rows keep (TRL keeps the
    dataset's columns unless it packs). Other Task fields pass through (`pretrained=True` for
    a pretrained base without adapters)."""
    return TrainerAdapter(make_trainer, name=name, group_column=group_column,
                          **task_fields).task()
