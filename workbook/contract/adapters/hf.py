"""`from_hf`: the pieces of a Hugging Face `Trainer` - model factory, tokenized train and eval
datasets, data collator, tokenizer and `TrainingArguments`, and the Trainer's own
`compute_metrics` and `callbacks` - as a Task. The collator is the user's own: it receives the
rows as the dataset holds them (the Trainer's column names, `label` included) and makes every
batch and, one row at a time, every example's labels, so the pilot checks the masking it really
does (a collator that leaves pad ids in the labels shows in 01). Rows whose label is -100 (an
eval set padded to a multiple of the eval batch) are padding: no examples, counted in
`task.padding_rows`. A dataset read by iterating (a streaming `datasets.IterableDataset`, a
torch `IterableDataset`, any re-iterable of dicts) is never indexed nor held: its rows are read
in turn with the other splits' as the notebooks ask for examples, and each example carries its
row."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import IterableDataset

from ...base.errors import WorkbookError, reason
from .. import class_maps, kinds
from ..outputs import accepted_inputs
from ..sources import numbered
from ..targets import IGNORE_INDEX
from ..task import Task
from .hf_metrics import ROW, ROW_OFFSET, _probe_padding, _SplitMetrics
from .hf_trainer import argument_fields
from .hf_truncation import truncation_cause
from .torch import loading_weights, probe_on_meta

SPLITS = ("train", "validation", "test")
INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
PROMPT = "prompt_mask"  # True on a row's prompt tokens (labels aligned with input_ids)
LABEL_COLUMNS = ("labels", "label", "label_ids")  # the Trainer keeps these for the collator
LABELS_KEPT = 65_536  # a stream's eval labels kept for the padding probe, at most


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
    if _streams(dataset):
        return _Stream(dataset, split)
    if len(dataset) and not isinstance(dataset[0], dict):
        raise WorkbookError(f"rows of the {split} dataset are {type(dataset[0]).__name__}, not "
                            "dicts of token ids", "tokenize it first (dataset.map(tokenize))")
    if len(dataset) and "input_ids" not in dataset[0]:
        raise WorkbookError(f"rows of the {split} dataset have no input_ids (columns "
                            f"{sorted(dataset[0])})", "tokenize it first (dataset.map(tokenize))")
    return dataset


def _streams(dataset: Any) -> bool:
    """Whether a dataset is read by iterating: a torch IterableDataset (its inherited
    __getitem__ raises), or anything without both __len__ and __getitem__ - a streaming
    `datasets.IterableDataset`, a generator."""
    return isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))


class _Stream:
    """A split read by iterating, never indexed nor held: its first row is read once here,
    to check it and to read the columns from; every other row when a pass reaches it."""

    def __init__(self, dataset: Any, split: str):
        name = "eval" if split == "validation" else split
        if not hasattr(dataset, "__iter__"):
            raise WorkbookError(f"the {name} dataset is a {type(dataset).__name__}, not a "
                                "dataset (a datasets.Dataset, an IterableDataset or a list "
                                "of dicts)", "pass the dataset your Trainer gets")
        if iter(dataset) is dataset:
            raise WorkbookError(
                f"the {name} dataset is a {type(dataset).__name__} that can be read once "
                "only, and the pilot reads it once per notebook (and the campaign once per "
                "epoch)", "pass something that starts again on every iter(): a "
                "datasets.IterableDataset (load_dataset(..., streaming=True)), a torch "
                "IterableDataset or a class whose __iter__ opens the data anew")
        self.dataset, self.split, self.name = dataset, split, name
        self.first = next(self.rows(), (0, None))[1]
        if self.first is not None and "input_ids" not in self.first:
            raise WorkbookError(f"rows of the {name} dataset have no input_ids (columns "
                                f"{sorted(self.first)})", "tokenize it first "
                                "(dataset.map(tokenize))")

    def rows(self) -> Iterator[tuple[int, dict]]:
        """(position, row) of every row in order, each checked to be a dict of columns; a
        failure while reading names the dataset and the row it had reached."""
        for i, row in numbered(self.dataset, lambda i, exc: WorkbookError(
                f"from_hf: reading the {self.name} dataset failed at row {i}: "
                f"{type(exc).__name__}: {reason(exc, 200)}", f"fix the {self.name} dataset's "
                "source at that row (the file or shard it reads there)")):
            if not isinstance(row, Mapping):
                raise WorkbookError(f"rows of the {self.name} dataset are "
                                    f"{type(row).__name__}, not dicts of token ids (row {i})",
                                    "tokenize it first (dataset.map(tokenize))")
            yield i, dict(row)

    def length(self) -> int | None:
        """The rows a stream says it has (a torch IterableDataset with __len__), else None."""
        try:
            return len(self.dataset) if hasattr(self.dataset, "__len__") else None
        except TypeError:
            return None


def _train_rows(dataset: Any, args: Any) -> int:
    """The train rows the Trainer's own count of updates reads: a stream without a length
    needs `max_steps`, as the Trainer itself refuses one without it."""
    rows = dataset.length() if isinstance(dataset, _Stream) else len(dataset)
    if rows is None and not (getattr(args, "max_steps", -1) or -1) > 0:
        raise WorkbookError("from_hf: the train dataset is a stream without a length and the "
                            "TrainingArguments set no max_steps, which the Trainer refuses "
                            "too (it cannot count the updates of an epoch)",
                            "set max_steps=N in TrainingArguments: the updates the campaign "
                            "makes")
    return rows or 0


def _first(dataset: Any) -> dict | None:
    """A split's first row (None: it has none)."""
    if isinstance(dataset, _Stream):
        return dataset.first
    return dataset[0] if len(dataset) else None


def _prompts(tokenizer: Any, response_template: str | None,
             first: dict) -> Callable[[dict], torch.Tensor] | None:
    """Which tokens of a row are prompt (True) - tokens no target may sit on: up to and
    including the first `response_template`; for rows with a `messages` column, every token
    outside an assistant turn when the chat template marks those turns with
    `{% generation %}` (system and user turns, role headers: every assistant turn of a
    multi-turn chat is a target, as TRL's `assistant_only_loss` trains them), else the chat
    template's rendering of every message but the last with the generation prompt. No prompt
    where it is not found (a completion-only collator then masks the whole row, which 01
    names as an example without targets)."""
    if response_template is not None:
        marker = tokenizer(response_template, add_special_tokens=False)["input_ids"]
        if not marker:
            raise WorkbookError(f"the response template {response_template!r} tokenizes to "
                                "nothing", "give the text that starts every answer")

        def after_marker(row: dict) -> torch.Tensor:
            ids = list(row["input_ids"])
            end = next((i + len(marker) for i in range(len(ids) - len(marker) + 1)
                        if ids[i:i + len(marker)] == marker), 0)
            return torch.arange(len(ids)) < end
        return after_marker
    template = getattr(tokenizer, "chat_template", None)
    if "messages" not in first or not template:
        return None
    if isinstance(template, str) and "generation" in template and "endgeneration" in template:
        def outside_assistant(row: dict) -> torch.Tensor:
            rendered = _rendered(tokenizer, row["messages"], return_dict=True,
                                 return_assistant_tokens_mask=True)
            ids, turns = list(rendered["input_ids"]), list(rendered["assistant_masks"])
            row_ids = list(row["input_ids"])
            if row_ids != ids[:len(row_ids)]:  # not the template's rendering: no prompt known
                return torch.zeros(len(row_ids), dtype=torch.bool)
            return ~torch.tensor(turns[:len(row_ids)], dtype=torch.bool)
        return outside_assistant

    def chat_prompt(row: dict) -> torch.Tensor:
        rendered = _rendered(tokenizer, row["messages"][:-1], add_generation_prompt=True)
        prefix = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        ids = list(row["input_ids"])
        return torch.arange(len(ids)) < (len(prefix) if ids[:len(prefix)] == prefix else 0)
    return chat_prompt


def _rendered(tokenizer: Any, messages: list, **how: Any) -> Any:
    """The tokenizer's chat template applied to `messages`, tokenized; its failure named."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, **how)
    except Exception as exc:
        raise WorkbookError(f"the tokenizer's chat template raised {type(exc).__name__}: "
                            f"{reason(exc, 200)}", "fix the chat template (the campaign's "
                            "preparation renders every conversation with it)") from exc


# what a padding-free collator adds for its one flattened row (FlashAttention's varlen
# arguments): it describes that layout only, and the model finds documents by position_ids
FLAT_LAYOUT = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _unflattened(collate: Callable, rows: list[dict], pad_id: int) -> dict:
    """The batch a padding-free collator (TRL's `padding_free`, packing "bfd") makes of
    `rows`, one row per example: it flattens every row into one sequence whose position_ids
    restart at each document, and the pilot counts and pads per example. Each row is collated
    alone and padded on the right (labels -100, positions 0: a padded position is a one-token
    document nobody attends to) - the same attention as the flattened batch."""
    parts = [dict(collate([r])) for r in rows]
    width = max(int(torch.as_tensor(p["input_ids"]).shape[-1]) for p in parts)
    fill = {"labels": IGNORE_INDEX, "input_ids": pad_id}
    out = {}
    for key in parts[0]:
        if key in FLAT_LAYOUT:
            continue
        pieces = [torch.as_tensor(p[key]) for p in parts]
        out[key] = torch.cat([nn.functional.pad(t, (0, width - t.shape[-1]),
                                                value=fill.get(key, 0)) for t in pieces])
    return out


def _padding_row(label: Any) -> bool:
    """A row whose label is -100 everywhere: padding (an eval set filled up to a multiple of
    the eval batch, as the Hugging Face convention pads), never an example."""
    if label is None:
        return False
    values = np.asarray(label)
    return values.size > 0 and values.dtype.kind in "iu" and bool((values == IGNORE_INDEX).all())


def from_hf(model_factory: Callable[[], nn.Module], train_dataset: Any, eval_dataset: Any,
            data_collator: Callable, tokenizer: Any, args: Any = None, *, name: str,
            test_dataset: Any = None, group_column: str | None = None,
            label_column: str | None = None, response_template: str | None = None,
            compute_metrics: Callable | None = None, callbacks: list | None = None,
            preprocess_logits_for_metrics: Callable | None = None,
            **task_fields: Any) -> Task:
    """A Task over tokenized rows (dicts with input_ids; a `datasets.Dataset` or a list, or a
    stream read row by row: a `datasets.IterableDataset`, a torch IterableDataset), the
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
    model_factory = loading_weights(model_factory)  # from_pretrained: real, then on meta
    probe = probe_on_meta(model_factory, "model", "pass a factory that builds the model from "
                          "its config or a local folder (no download inside it)")
    kind, shift = _kind(probe)
    target = kinds.of(kind)
    data = {split: _rows(d, split) for split, d in zip(SPLITS, (train_dataset, eval_dataset,
                                                               test_dataset), strict=True)}
    if _first(data["train"]) is None or _first(data["validation"]) is None:
        raise WorkbookError("from_hf needs a train and an eval dataset with rows",
                            "pass both (the pilot evaluates on the eval dataset)")
    id2label = getattr(probe.config, "id2label", None) or {}
    label_names = [str(id2label.get(i, i)) for i in range(probe.config.num_labels)] \
        if target.named_classes else None
    first_row = _first(data["train"])
    streamed = [s for s, d in data.items() if isinstance(d, _Stream)]
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
            if len(given) > 1 and getattr(out.get("input_ids"), "shape", (0,))[0] == 1:
                out = _unflattened(data_collator, given, tokenizer.pad_token_id or 0)
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
        row = ex["row"] if "row" in ex else data[ex["split"]][ex["index"]]
        one = tensors(row)
        # the labels the collator makes of this row alone: the ones the campaign trains on
        one["labels"] = collated([one])["labels"][0]
        if prompt_of is not None:
            one[PROMPT] = prompt_of(row)
        one[ROW] = torch.tensor(SPLITS.index(ex["split"]) * ROW_OFFSET + ex["index"])
        return one

    def label_name(value: Any) -> str:
        i = int(value)
        return label_names[i] if 0 <= i < len(label_names) else f"<{i}?>"

    def failed(split: str, i: int, step: str, exc: Exception) -> WorkbookError:
        return WorkbookError(
            f"from_hf: reading the {'eval' if split == 'validation' else split} "
            f"dataset's {step} failed at row {i}: {type(exc).__name__}: {reason(exc, 200)}",
            f"give every row of the {split} dataset a {label_column!r} class id "
            "(-100 for a padding row)" if step == "labels" else
            f"check the {split} dataset's row {i}")

    def indexed(split: str, dataset: Any) -> Iterator[tuple[int, Any]]:
        for i in range(len(dataset)):
            try:
                row = dataset[i]
            except WorkbookError:
                raise
            except Exception as exc:
                raise failed(split, i, "rows", exc) from exc
            yield i, row

    def read(split: str, dataset: Any, seen: dict) -> Iterator[dict]:
        """The examples of one split in order, read lazily; padding rows (label -100) are
        counted in `seen`, with the eval labels the padding probe needs (a stream's: the
        first LABELS_KEPT of each sort)."""
        stream = isinstance(dataset, _Stream)
        for i, row in dataset.rows() if stream else indexed(split, dataset):
            try:
                label = row.get(label_column)
                if split == "validation" and target.named_classes:
                    value = int(label)
                    sort = "padding" if value == IGNORE_INDEX else "real"
                    seen["kept"][sort] = seen["kept"].get(sort, 0) + 1
                    if not stream or seen["kept"][sort] <= LABELS_KEPT:
                        seen["labels"].append(value)
                if _padding_row(label):
                    seen["padding"][split] = seen["padding"].get(split, 0) + 1
                    continue
                ex = {"id": f"{split}-{i}", "split": split, "index": i,
                      "group": str(row[group_column]) if group_column else f"{split}-{i}"}
                if target.named_classes:
                    ex["label"] = label_name(label)
            except WorkbookError:
                raise
            except Exception as exc:
                raise failed(split, i, "labels", exc) from exc
            if stream:
                ex["row"] = row  # encode reads it here: a stream is never indexed
            seen["validation"] = seen["validation"] or split == "validation"
            yield ex

    def finish(seen: dict) -> None:
        """After a whole pass: the padding rows counted and said, the eval set checked."""
        padding_rows = seen["padding"]
        notes[:] = [n for n in notes if "label -100" not in n] + [
            f"from_hf: {n} rows of the {'eval' if split == 'validation' else split} dataset "
            "have label -100 (padding): left out, they are no examples"
            for split, n in padding_rows.items()]
        task.padding_rows = dict(padding_rows)
        if not seen["validation"]:
            raise WorkbookError("from_hf: every row of the eval dataset has label -100",
                                "pass the eval dataset with its labelled rows")
        if compute_metrics is not None and target.named_classes and padding_rows.get(
                "validation"):
            _probe_padding(compute_metrics, seen["labels"], len(label_names))

    def fresh() -> dict:  # what one pass counts
        return {"padding": {}, "labels": [], "kept": {}, "validation": False}

    def load() -> list[dict]:
        seen = fresh()
        examples = [ex for split, dataset in data.items() for ex in read(split, dataset, seen)]
        finish(seen)
        return examples

    def load_stream() -> Iterator[dict]:
        """A pass over every split in turn, one row of each at a time, so the first examples
        of the eval split come without reading the whole train stream; the pass's checks run
        when it reaches the end (a pass stopped early checks nothing)."""
        seen = fresh()
        readers = {split: read(split, dataset, seen) for split, dataset in data.items()}
        while readers:
            for split in list(readers):
                ex = next(readers[split], None)
                if ex is None:
                    del readers[split]
                else:
                    yield ex
        finish(seen)

    fields = argument_fields(args, (lambda: _train_rows(data["train"], args)), callbacks,
                             tokenizer, notes)
    if compute_metrics is not None:
        split_metrics = _SplitMetrics(compute_metrics, preprocess_logits_for_metrics)

        def eval_step(model: nn.Module, batch: dict) -> dict[str, tuple]:
            return split_metrics(task, model, batch)
        eval_step.metric_reductions = split_metrics.metric_reductions  # type: ignore[attr-defined]
        fields["eval_step"] = eval_step
    fields.update(task_fields)
    first = collated([encode({"split": "train", "index": 0, "row": first_row})])

    def decode(ids) -> str:  # token ids, or a classifier's class ids, for people
        if target.causal:
            return tokenizer.decode([int(i) for i in ids if int(i) >= 0])
        return ", ".join(label_name(i) for i in ids)

    shown = {"decode": decode, "decode_input": lambda ids: tokenizer.decode([int(i) for i in ids])}
    generation = {"label_shift": shift, "padding_side": tokenizer.padding_side,
                  "end_token": getattr(tokenizer, "eos_token_id", None),
                  "max_length": getattr(args, "max_length", None),  # TRL's configs truncate
                  "prompt_in_loss": prompt_of is None and task_fields.get("prompt_field")
                  is None} \
        if target.causal else {"label_names": label_names, "label_field": "label"}
    if streamed:
        which = " and ".join("eval" if n == "validation" else n for n in streamed)
        notes.append(f"from_hf: the {which} dataset{'s are' if len(streamed) > 1 else ' is'} "
                     "read as a stream, one row of each split in turn as the notebooks ask "
                     "for examples: never indexed nor held whole, each example carries its "
                     "row; padding rows are counted when a pass reaches the end")
    # a model whose weights were loaded (from_pretrained names its folder) starts from its own
    # loss, not ln(outputs); a task field given wins
    fields.setdefault("pretrained", bool(getattr(probe, "name_or_path", "")))
    if not target.causal:  # each split's ClassLabel names, which 01 checks against id2label
        fields.setdefault("class_maps", class_maps.of_datasets(dict(zip(SPLITS, (
            train_dataset, eval_dataset, test_dataset), strict=True)), label_column))
    task = Task(name=name, kind=kind, load_examples=load_stream if streamed else load,
                encode=encode, collate=collated, build_model=model_factory,
                model_inputs=tuple(k for k in INPUTS if k in first),
                split_of=lambda ex: ex["split"], **{**shown, **generation, **fields})
    task.padding_rows = {}  # per split: rows with label -100, left out (set by load_examples)
    task.adapter_notes = notes  # what the adapter mapped or left out, in words
    # why inputs sit in two splits when the tokenizer's cut made them identical (01 asks)
    task.duplicates_cause = truncation_cause(
        {s: d for s, d in data.items() if not isinstance(d, _Stream)}, tokenizer)
    return task
