"""`from_hf`: the pieces of a Hugging Face `Trainer` - model factory, tokenized train and eval
datasets, data collator, tokenizer and `TrainingArguments`, and the Trainer's own
`compute_metrics` and `callbacks` - as a Task. The collator is the user's own: it receives the
rows as the dataset holds them (the Trainer's column names, `label` included) and makes every
batch and, one row at a time, every example's labels, so the pilot checks the masking it really
does (a collator that leaves pad ids in the labels shows in 01). Rows whose label is -100 (an
eval set padded to a multiple of the eval batch) are padding: no examples, counted in
`task.framework.padding_rows`. A dataset read by iterating (a streaming
`datasets.IterableDataset`, a torch `IterableDataset`, any re-iterable of dicts) is never
indexed nor held: its rows are read in turn with the other splits' as the notebooks ask for
examples, and each example carries its row."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn

from ...base.errors import WorkbookError, reason
from .. import class_maps, kinds
from ..framework_facts import FrameworkFacts
from ..outputs import accepted
from ..sources import SPLITS, numbered
from ..targets import IGNORE_INDEX
from ..task import Task
from .base import Adapter
from .hf_metrics import ROW, ROW_OFFSET, SplitMetrics, probe_padding
from .hf_no_targets import no_targets, rendered
from .hf_rows import RowStream, first_row, padding_row, split_rows, train_rows, unflattened
from .hf_trainer import argument_fields
from .hf_truncation import truncation_cause
from .torch import loading_weights, probe_on_meta

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
            marked = rendered(tokenizer, row["messages"], return_assistant_tokens_mask=True)
            ids, turns = marked["input_ids"], marked["assistant_masks"]
            row_ids = list(row["input_ids"])
            if row_ids != ids[:len(row_ids)]:  # not the template's rendering: no prompt known
                return torch.zeros(len(row_ids), dtype=torch.bool)
            return ~torch.tensor(turns[:len(row_ids)], dtype=torch.bool)
        return outside_assistant

    def chat_prompt(row: dict) -> torch.Tensor:
        prefix = rendered(tokenizer, row["messages"][:-1], add_generation_prompt=True)[
            "input_ids"]
        ids = list(row["input_ids"])
        return torch.arange(len(ids)) < (len(prefix) if ids[:len(prefix)] == prefix else 0)
    return chat_prompt


class HFAdapter(Adapter):
    """A Hugging Face Trainer's pieces as a Task: `__init__` reads the user's objects once (the
    model's kind on the meta device, the splits, the label column, the prompt finder, the
    columns the Trainer keeps); the datasets are read by `load_examples` / `load_stream` and
    `encode`, batched by `collate` (the user's collator), evaluated by `eval_step` (with
    `compute_metrics`) and shown by `decode`; `task()` assembles them (`from_hf`)."""

    def __init__(self, model_factory: Callable[[], nn.Module], train_dataset: Any,
                 eval_dataset: Any, data_collator: Callable, tokenizer: Any, args: Any = None, *,
                 name: str, test_dataset: Any = None, group_column: str | None = None,
                 label_column: str | None = None, response_template: str | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 preprocess_logits_for_metrics: Callable | None = None, **task_fields: Any):
        self.model_factory = loading_weights(model_factory)  # from_pretrained: real, then meta
        self.probe = probe_on_meta(self.model_factory, "model", "pass a factory that builds "
                                   "the model from its config or a local folder (no download "
                                   "inside it)")
        self.kind, self.shift = _kind(self.probe)
        self.target = kinds.of(self.kind)
        self.datasets = (train_dataset, eval_dataset, test_dataset)
        self.data = {split: split_rows(d, split)
                     for split, d in zip(SPLITS, self.datasets, strict=True)}
        if first_row(self.data["train"]) is None or first_row(self.data["validation"]) is None:
            raise WorkbookError("from_hf needs a train and an eval dataset with rows",
                                "pass both (the pilot evaluates on the eval dataset)")
        id2label = getattr(self.probe.config, "id2label", None) or {}
        self.label_names = [str(id2label.get(i, i)) for i in range(
            self.probe.config.num_labels)] if self.target.named_classes else None
        self.first_row = first_row(self.data["train"])
        self.streamed = [s for s, d in self.data.items() if isinstance(d, RowStream)]
        if label_column is None:
            label_column = next((c for c in LABEL_COLUMNS if c in self.first_row), "labels")
        self.label_column = label_column
        self.own_labels = label_column in self.first_row  # else the collator makes them
        if self.target.named_classes and not self.own_labels:
            raise WorkbookError(f"rows of the train dataset have no label column (columns "
                                f"{sorted(self.first_row)})", "give the rows a 'label' (class "
                                "id) column, or name yours with label_column=")
        self.prompt_of = _prompts(tokenizer, response_template, self.first_row) \
            if self.target.prompts else None
        forward_takes = accepted(type(self.probe).forward)
        self.keep_all = "**" in forward_takes or \
            getattr(args, "remove_unused_columns", True) is False
        self.kept = set(forward_takes) | set(LABEL_COLUMNS) | set(
            getattr(args, "label_names", None) or ()) | {label_column}
        self.collator, self.tokenizer, self.args = data_collator, tokenizer, args
        self.name, self.group_column, self.callbacks = name, group_column, callbacks
        self.compute_metrics, self.task_fields = compute_metrics, task_fields
        self.split_metrics = SplitMetrics(compute_metrics, preprocess_logits_for_metrics) \
            if compute_metrics is not None else None
        self.notes: list[str] = []  # what the adapter mapped or left out, in words
        self.built: Task | None = None  # the task `task()` made (the passes write to it)

    # --- reading the datasets

    def tensors(self, row: dict) -> dict[str, torch.Tensor]:
        """The row's columns as the Trainer hands them to the collator, as tensors (the label
        column under "labels", the pilot's name); text and other unused columns left out."""
        out = {}
        for k, v in row.items():
            if not (self.keep_all or k in self.kept) or isinstance(v, str):
                continue
            try:
                t = torch.as_tensor(v)
            except (TypeError, ValueError, RuntimeError):
                continue
            if t.dtype.is_floating_point or t.dtype in (torch.int64, torch.int32, torch.bool,
                                                        torch.int16, torch.int8, torch.uint8):
                out["labels" if k == self.label_column else k] = t
        return out

    def encode(self, ex: dict) -> dict[str, torch.Tensor]:
        """An example's row as tensors, with the labels the collator makes of it alone (the
        ones the campaign trains on), its prompt mask and which row it is (`ROW`)."""
        row = ex["row"] if "row" in ex else self.data[ex["split"]][ex["index"]]
        one = self.tensors(row)
        one["labels"] = self.collate([one])["labels"][0]
        if self.prompt_of is not None:
            one[PROMPT] = self.prompt_of(row)
        one[ROW] = torch.tensor(SPLITS.index(ex["split"]) * ROW_OFFSET + ex["index"])
        return one

    def label_name(self, value: Any) -> str:
        i = int(value)
        return self.label_names[i] if 0 <= i < len(self.label_names) else f"<{i}?>"

    def failed(self, split: str, i: int, step: str, exc: Exception) -> WorkbookError:
        """A row's reading (`step` "rows") or label (`step` "labels") failing, named."""
        return WorkbookError(
            f"from_hf: reading the {'eval' if split == 'validation' else split} "
            f"dataset's {step} failed at row {i}: {type(exc).__name__}: {reason(exc, 200)}",
            f"give every row of the {split} dataset a {self.label_column!r} class id "
            "(-100 for a padding row)" if step == "labels" else
            f"check the {split} dataset's row {i}")

    def indexed(self, split: str, dataset: Any) -> Iterator[tuple[int, Any]]:
        """(index, row) of an indexed split, a failing row named."""
        return numbered((dataset[i] for i in range(len(dataset))),
                        lambda i, exc: self.failed(split, i, "rows", exc))

    def read(self, split: str, dataset: Any, seen: dict) -> Iterator[dict]:
        """The examples of one split in order, read lazily; padding rows (label -100) are
        counted in `seen`, with the eval labels the padding probe needs (a stream's: the
        first LABELS_KEPT of each sort)."""
        stream, named = isinstance(dataset, RowStream), self.target.named_classes
        for i, row in dataset.items() if stream else self.indexed(split, dataset):
            seen["rows"][split] = seen["rows"].get(split, 0) + 1
            try:
                label = row.get(self.label_column)
                if split == "validation" and named:
                    value = int(label)
                    sort = "padding" if value == IGNORE_INDEX else "real"
                    seen["kept"][sort] = seen["kept"].get(sort, 0) + 1
                    if not stream or seen["kept"][sort] <= LABELS_KEPT:
                        seen["labels"].append(value)
                if padding_row(label):
                    seen["padding"][split] = seen["padding"].get(split, 0) + 1
                    continue
                ex = {"id": f"{split}-{i}", "split": split, "index": i,
                      "group": str(row[self.group_column]) if self.group_column
                      else f"{split}-{i}"}
                if named:
                    ex["label"] = self.label_name(label)
            except WorkbookError:
                raise
            except Exception as exc:
                raise self.failed(split, i, "labels", exc) from exc
            if stream:
                ex["row"] = row  # encode reads it here: a stream is never indexed
            yield ex

    @staticmethod
    def fresh_pass() -> dict:
        """What one pass counts."""
        return {"padding": {}, "rows": {}, "labels": [], "kept": {}}

    def finish(self, seen: dict) -> None:
        """After a whole pass: the padding rows counted and said, the eval set checked."""
        padding_rows = seen["padding"]
        self.notes[:] = [n for n in self.notes if "label -100" not in n] + [
            f"from_hf: {n} rows of the {'eval' if split == 'validation' else split} dataset "
            "have label -100 (padding): left out, they are no examples"
            for split, n in padding_rows.items()]
        if self.built is not None:
            self.built.framework.padding_rows = dict(padding_rows)
        empty = {s: (padding_rows[s], n) for s, n in seen["rows"].items()
                 if n and padding_rows.get(s) == n}
        if empty:  # the rows were read, and not one has a target: why, by experiment
            raise no_targets(empty, self.data, self.tokenizer)
        if self.compute_metrics is not None and self.target.named_classes and \
                padding_rows.get("validation"):
            probe_padding(self.compute_metrics, seen["labels"], len(self.label_names))

    def load_examples(self) -> list[dict]:
        """Every split's examples, read whole (indexed datasets)."""
        seen = self.fresh_pass()
        examples = [ex for split, dataset in self.data.items()
                    for ex in self.read(split, dataset, seen)]
        self.finish(seen)
        return examples

    def load_stream(self) -> Iterator[dict]:
        """A pass over every split in turn, one row of each at a time, so the first examples
        of the eval split come without reading the whole train stream; the pass's checks run
        when it reaches the end (a pass stopped early checks nothing)."""
        seen = self.fresh_pass()
        readers = {split: self.read(split, dataset, seen) for split, dataset in self.data.items()}
        while readers:
            for split in list(readers):
                ex = next(readers[split], None)
                if ex is None:
                    del readers[split]
                else:
                    yield ex
        self.finish(seen)

    @staticmethod
    def split_of(ex: dict) -> str:
        return ex["split"]

    # --- the batch structure

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """The user's collator on the rows as the dataset holds them (the label column under
        its own name, labels the collator made in `encode` left out; the pilot's renaming is
        done on the batch after); evaluation's padding copies (labels -100) weigh nothing,
        whatever the collator made; the prompt mask padded as the collator padded input_ids."""
        given = [{(self.label_column if k == "labels" else k):
                  (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()
                  if (k != "labels" or self.own_labels) and k not in (PROMPT, ROW)} for r in rows]
        try:
            out = dict(self.collator(given))
            if len(given) > 1 and getattr(out.get("input_ids"), "shape", (0,))[0] == 1:
                out = unflattened(self.collator, given, self.tokenizer.pad_token_id or 0)
        except Exception as exc:
            raise WorkbookError(f"the data collator raised {type(exc).__name__}: {reason(exc)}",
                                "fix the collator, or pass the one your Trainer uses") from exc
        if "labels" not in out:
            for alias in (self.label_column, "label", "label_ids"):
                if alias in out:
                    out["labels"] = out.pop(alias)
                    break
        copies = [i for i, r in enumerate(rows) if "labels" in r and
                  bool((torch.as_tensor(r["labels"]) == IGNORE_INDEX).all())]
        if copies and "labels" in out:
            out["labels"] = torch.as_tensor(out["labels"]).clone()
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
        if rows and all(PROMPT in r for r in rows):
            width = out["input_ids"].shape[1]
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for b, r in enumerate(rows):
                n = min(len(r[PROMPT]), width)
                if self.tokenizer.padding_side == "left":
                    mask[b, width - n:] = r[PROMPT][-n:] if n else False
                else:
                    mask[b, :n] = r[PROMPT][:n]
            out[PROMPT] = mask
        if rows and all(ROW in r for r in rows):
            out[ROW] = torch.stack([torch.as_tensor(r[ROW]).reshape(()) for r in rows])
        return out

    # --- evaluation and what people read

    def eval_step(self, model: nn.Module, batch: dict) -> dict[str, tuple]:
        """compute_metrics on the eval split seen so far, as per-batch sums (`SplitMetrics`)."""
        return self.split_metrics(self.built, model, batch)

    def decode(self, ids: Any) -> str:
        """Token ids, or a classifier's class ids, for people."""
        if self.target.causal:
            return self.tokenizer.decode([int(i) for i in ids if int(i) >= 0])
        return ", ".join(self.label_name(i) for i in ids)

    def decode_input(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    # --- the Task

    def task(self) -> Task:
        """The Task of these steps, with the Trainer's arguments (`argument_fields`) and the
        adapter's notes: `from_hf`'s; built once per adapter (the passes write to it)."""
        args, tokenizer, notes = self.args, self.tokenizer, self.notes
        fields = argument_fields(args, lambda: train_rows(self.data["train"], args),
                                 self.callbacks, tokenizer, notes)
        own_eval = self.split_metrics is not None and "eval_step" not in self.task_fields
        if own_eval:
            fields["eval_step"] = self.eval_step
        fields.update(self.task_fields)
        first = self.collate([self.encode({"split": "train", "index": 0, "row": self.first_row})])
        generation = {"label_shift": self.shift, "padding_side": tokenizer.padding_side,
                      "end_token": getattr(tokenizer, "eos_token_id", None),
                      "max_length": getattr(args, "max_length", None),  # TRL's configs cut
                      "prompt_in_loss": self.prompt_of is None and
                      self.task_fields.get("prompt_field") is None} \
            if self.target.causal else {"label_names": self.label_names, "label_field": "label"}
        if self.streamed:
            which = " and ".join("eval" if n == "validation" else n for n in self.streamed)
            notes.append(f"from_hf: the {which} dataset"
                         f"{'s are' if len(self.streamed) > 1 else ' is'} read as a stream, "
                         "one row of each split in turn as the notebooks ask for examples: "
                         "never indexed nor held whole, each example carries its row; padding "
                         "rows are counted when a pass reaches the end")
        # a model whose weights were loaded (from_pretrained names its folder) starts from its
        # own loss, not ln(outputs); a task field given wins
        fields.setdefault("pretrained", bool(getattr(self.probe, "name_or_path", "")))
        if not self.target.causal:  # each split's ClassLabel names, which 01 checks
            fields.setdefault("class_maps", class_maps.of_datasets(
                dict(zip(SPLITS, self.datasets, strict=True)), self.label_column))
        own = getattr(tokenizer, "vocab_size", None)  # tokens added past it: `added_tokens`
        facts = FrameworkFacts(
            notes=notes, added_tokens={i: str(t) for i, t in (getattr(
                tokenizer, "added_tokens_decoder", None) or {}).items()
                if isinstance(own, int) and i >= own},
            duplicates_cause=truncation_cause(
                {s: d for s, d in self.data.items() if not isinstance(d, RowStream)}, tokenizer),
            # compute_metrics runs on every rank's outputs gathered: filled as it evaluates
            metric_reductions=self.split_metrics.reductions if own_eval else {})
        task = Task(name=self.name, kind=self.kind, framework=facts,
                    load_examples=self.load_stream if self.streamed else self.load_examples,
                    encode=self.encode, collate=self.collate, build_model=self.model_factory,
                    model_inputs=tuple(k for k in INPUTS if k in first),
                    split_of=self.split_of, **{"decode": self.decode,
                                               "decode_input": self.decode_input,
                                               **generation, **fields})
        self.built = task
        return task


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
    padding, left out (`task.framework.padding_rows` counts them per split). The collator
    receives the rows as the Trainer hands them (the columns the model's forward takes and the label
    columns, every column with `remove_unused_columns=False`). `compute_metrics` (an
    `EvalPrediction` of the whole split -> {name: float}) becomes the evaluation, exactly;
    `callbacks` get on_train_begin, on_step_end and on_save in the pilot's runs.
    `group_column` names the unit of leakage (default: each row its own group). The prompt of a
    causal LM's row is found by `response_template` (the text that starts the answer, as a
    completion-only collator finds it) or, for rows with a `messages` column, by the
    tokenizer's chat template (every message but the last, with the generation prompt): 01
    then checks the collator keeps it out of the loss (`prompt_in_loss=True` says it should be
    in). Other Task fields pass through."""
    return HFAdapter(model_factory, train_dataset, eval_dataset, data_collator, tokenizer, args,
                     name=name, test_dataset=test_dataset, group_column=group_column,
                     label_column=label_column, response_template=response_template,
                     compute_metrics=compute_metrics, callbacks=callbacks,
                     preprocess_logits_for_metrics=preprocess_logits_for_metrics,
                     **task_fields).task()
