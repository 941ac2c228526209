"""What a model that is fine-tuned rather than trained from scratch implies for the checks: a
parameter-efficient method's adapters (PEFT's LoRA: a frozen base, trainable A and B whose B
starts at zero) and a pretrained base, whose untrained loss is its own and not ln(outputs).
Read from the model itself (PEFT's attributes and names), so no task has to say it."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from .task import Task

# LoRA initialisations whose B starts at zero: the adapted model starts exactly as its base
IDENTITY_INITS = (True, "gaussian")
IDENTITY_TOLERANCE = 1e-4  # relative gap allowed between such a model's loss and its base's
NOT_IDENTITY = ("the adapters change the base's output before any update: LoRA's B must start "
                "at zero (PEFT's init_lora_weights=True, its default; False is for debugging)")
# PEFT's names of a LoRA pair: A (random at the start) and B (zero at the start), per adapter
LORA_PAIRS = ((".lora_A.", ".lora_B."), (".lora_embedding_A.", ".lora_embedding_B."))


def adapted(model: nn.Module) -> bool:
    """Whether `model` carries parameter-efficient adapters (a PEFT model, or LoRA layers)."""
    return hasattr(model, "peft_config") or any(
        any(a in f".{name}." for a, _ in LORA_PAIRS) for name, _ in model.named_parameters())


def waiting_for_partner(before: dict[str, torch.Tensor]) -> set[str]:
    """Trainable LoRA A tensors that an update cannot move: their B was zero before it (as PEFT
    starts it), so A's gradient, which flows through B, is exactly zero. They move from the
    update after B first changes; `before` holds every parameter's value before the update."""
    waiting = set()
    for name in before:
        for a, b in LORA_PAIRS:
            if a in name:
                partner = before.get(name.replace(a, b))
                if partner is not None and not bool(partner.any()):
                    waiting.add(name)
    return waiting


@contextlib.contextmanager
def base_only(model: nn.Module) -> Iterator[bool]:
    """The model with its adapters switched off (PEFT's `disable_adapter()`): the pretrained
    base the fine-tune starts from. Yields whether the adapters could be switched off."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        yield False
        return
    with disable():
        yield True


@dataclass(frozen=True)
class InitialLoss:
    """The loss an untrained run should start near, and how it was reasoned (None: not judged)."""

    expected: float | None
    rule: str
    tolerance: float | None = None  # relative; None: the notebook's init_tolerance


def initial_loss(task: Task, model: nn.Module, outputs: int, labels: torch.Tensor | None,
                 measure: Callable[[], float]) -> InitialLoss:
    """What the first loss of `model` should be: a freshly initialised model spreads its
    probability evenly (the kind's rule, ln(outputs) for ids); a LoRA fine-tune starts exactly
    from its base, whose own loss `measure()` gives with the adapters off (B is zero at the
    start, so the two agree to rounding); a pretrained base without adapters
    (`task.pretrained`) is not judged - its own loss is what it starts from."""
    if adapted(model):
        inits = {getattr(c, "init_lora_weights", None)
                 for c in getattr(model, "peft_config", {}).values()}
        # False (B random, "for debugging" in PEFT's words) is judged too: it should not be
        # the campaign's start, and the gap to the base names it
        if inits and inits <= {*IDENTITY_INITS, False}:
            with base_only(model) as off:
                if off:
                    return InitialLoss(measure(), "the base's own loss (adapters off)",
                                       IDENTITY_TOLERANCE)
        return InitialLoss(None, "not judged: a fine-tune whose adapters do not start as "
                           "the identity (" + ", ".join(sorted(map(str, inits))) + ")")
    if task.pretrained:
        return InitialLoss(None, "not judged: a pretrained base starts from its own loss")
    return InitialLoss(task.expected_initial_loss(outputs, labels),
                       task.initial_loss_rule(outputs))


def unmatched_targets(model: nn.Module) -> dict[str, list[str]]:
    """Per adapter, the `target_modules` entries of its PEFT config that match no module of the
    model - a config copied from another architecture ("query", "value" on a Llama): PEFT
    refuses a config only when none match, and the layers meant are silently left without
    adapters. A regex or "all-linear" (a string) is not judged."""
    targeted = list(getattr(getattr(model, "base_model", None), "targeted_module_names",
                            None) or [])
    out = {}
    for adapter, config in (getattr(model, "peft_config", None) or {}).items():
        wanted = getattr(config, "target_modules", None)
        if not targeted or isinstance(wanted, str) or not wanted:
            continue
        missing = sorted(t for t in wanted
                         if not any(n == t or n.endswith("." + t) for n in targeted))
        if missing:
            out[adapter] = missing
    return out


def new_token_ids(model: nn.Module) -> range:
    """Token ids past the vocabulary of the config saved with the base (the rows
    `resize_token_embeddings` added after loading); empty for a base without a local folder."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = Path(str(getattr(base, "name_or_path", "") or "")) / "config.json"
    now = getattr(getattr(base, "config", None), "vocab_size", None)
    if not saved.is_file() or not isinstance(now, int):
        return range(0)
    try:
        before = json.loads(saved.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return range(0)
    return range(before, now) if isinstance(before, int) and now > before else range(0)


MEAN_GAP = 1e-2  # a row this near the rows' mean (per typical distance) holds the resize's start
ROWS_AT_ONCE = 8_192  # rows measured at once (a 128k x 4096 table is not copied whole)


def _trained_rows(module: nn.Module) -> set[int] | None:
    """The token rows an embedding (or output head) trains: None for every row (a parameter
    of it requires grad: its weight, a wrapper's copy, LoRA's A and B, which give each row its
    own delta); else the rows of PEFT's trainable tokens (`trainable_token_indices`)."""
    rows: set[int] = set()
    for name, param in module.named_parameters():
        if param.requires_grad and "trainable_tokens_delta" not in name:
            return None
    for sub in module.modules():
        indices = getattr(sub, "token_indices", None)
        delta = getattr(sub, "trainable_tokens_delta", None)
        if isinstance(indices, dict) and delta is not None and any(
                p.requires_grad for p in delta.parameters()):
            rows.update(i for ids in indices.values() for i in ids)
    return rows


def _table(module: nn.Module) -> torch.Tensor | None:
    """The layer's own rows (a PEFT wrapper's original weight), None on the meta device."""
    for name, param in module.named_parameters():
        if name.rsplit(".", 1)[-1] == "weight" and "trainable_tokens" not in name and \
                ".lora_" not in f".{name}" and param.dim() == 2:
            return None if param.is_meta else param
    return None


def _at_mean(table: torch.Tensor, ids: list[int]) -> set[int]:
    """The ids whose row is the mean of the table's rows (to MEAN_GAP of the rows' median
    distance from it): what `resize_token_embeddings` starts a new row at (mean_resizing,
    transformers' default), a value no training leaves."""
    parts = table.detach().split(ROWS_AT_ONCE)
    mean = sum(c.float().sum(0) for c in parts) / table.shape[0]
    gaps = torch.cat([(c.float() - mean).norm(dim=1) for c in parts])
    typical = float(gaps.median())
    return {i for i in ids if i < len(gaps) and float(gaps[i]) <= MEAN_GAP * typical}


@dataclass(frozen=True)
class FrozenRows:
    """Rows of one token layer that no parameter trains and that the base never trained."""

    layer: str  # "input embedding", "output head"
    module: str  # its name in the model, as PEFT's configs name it ("embed_tokens")
    ids: dict[int, str]  # token id -> how the base is known not to have trained it
    rows: int  # the layer's rows (the vocabulary it scores)
    unknown: tuple[int, ...] = ()  # frozen ids the tokenizer added that nothing here dates


def _module_name(model: nn.Module, module: nn.Module) -> str:
    name = next((n for n, m in model.named_modules() if m is module), "")
    return name.rsplit(".", 1)[-1] or type(module).__name__


def untrained_rows(model: nn.Module, inputs: set[int], targets: set[int],
                   added: set[int] = frozenset()) -> list[FrozenRows]:
    """The token rows that stay as the base left them though the base never trained them:
    ids of `inputs` (the input embedding's rows) and of `targets` (the embedding's and the
    output head's) whose rows no parameter trains (`_trained_rows`) and that are new to the
    base - past its saved config's vocabulary, or holding the mean of the layer's rows as
    `resize_token_embeddings` starts them - measured on the model, whatever it was built from.
    Frozen ids of `added` (tokens the tokenizer added) that neither shows are `unknown`."""
    try:  # a model without token layers (a CNN), or one that declares none
        embedding = model.get_input_embeddings()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") \
            else None
    except (AttributeError, NotImplementedError):
        return []
    if not isinstance(embedding, nn.Module):
        return []
    if head is not None and _table(head) is _table(embedding):  # tied: the same rows
        head = None
    saved = set(new_token_ids(model))
    out = []
    for layer, module, ids in (("input embedding", embedding, inputs | targets),
                               ("output head", head, targets)):
        trained = _trained_rows(module) if module is not None else None
        table = _table(module) if module is not None else None
        if trained is None or table is None:
            continue
        frozen = sorted(i for i in ids if i not in trained and 0 <= i < table.shape[0])
        at_mean = _at_mean(table, frozen) if frozen else set()
        found = {i: "each row is the mean of its layer's rows (measured), where "
                 "resize_token_embeddings starts a new token" if i in at_mean else
                 "past the vocabulary of the base's saved config" for i in frozen
                 if i in saved or i in at_mean}
        unknown = tuple(i for i in frozen if i in added and i not in found)
        if found or unknown:
            out.append(FrozenRows(layer, _module_name(model, module), found, table.shape[0],
                                  unknown))
    return out


def linear_names(model: nn.Module) -> list[str]:
    """The last names of the model's linear layers (what `target_modules` may name)."""
    wrapping = {"base_layer", "original_module", "modules_to_save", "default"}  # PEFT's own
    names = set()
    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, nn.Linear) and not any(p.startswith("lora_") for p in parts):
            kept = [p for p in parts if p not in wrapping]
            if kept:
                names.add(kept[-1])
    return sorted(names)


ADAPTERS = "adapter_model.safetensors"  # PEFT's file of a fine-tune's adapters


def saves_adapters(model: nn.Module) -> bool:
    """A PEFT model: its checkpoints and archive hold the adapters only (and the layers
    trained whole), as PEFT and the Trainer save it; the base is rebuilt from its own weights."""
    return hasattr(model, "peft_config") and callable(getattr(model, "save_pretrained", None))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors as PEFT saves them (`get_peft_model_state_dict`)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapters(model: nn.Module, path) -> None:
    """The adapters of a saved file into `model` (PEFT's own loader); adapters of another
    configuration are refused with the names that do not fit."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from ..base.errors import WorkbookError

    result = set_peft_model_state_dict(model, load_file(str(path)))
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    if unexpected:
        raise WorkbookError(f"the adapters in {path} do not fit the model: {unexpected[:3]}",
                            "load them into a model made with the LoraConfig they were "
                            "written with")
