"""Notebook 01: what the loss really receives - coverage, padding, prompt, label ids, splits."""

from __future__ import annotations

import html
import math
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..base.errors import reason
from ..base.frontend import headless
from ..contract.data import SPLITS, Item, collate_items, prepare
from ..contract.targets import IGNORE_INDEX, contributes, token_cross_entropy
from ..contract.task import Task, task_from_params
from ..storage.records import Flag
from .forward_failure import model_failure, output_layer


@dataclass
class Note:
    """A check that could not be made on this task, said plainly; it fails nothing."""

    check: str
    message: str
    fix: str


@dataclass
class Inspection:
    """Everything notebook 01 shows: tables, figures and the flags that decide the verdict."""

    task: Task
    splits: dict[str, list[dict]]
    items: dict[str, list[Item]]
    split_table: pd.DataFrame
    coverage: pd.DataFrame
    figures: dict[str, float | int]
    flags: list[Flag] = field(default_factory=list)
    classes: pd.DataFrame | None = None
    notes: list[Note] = field(default_factory=list)  # checks that could not be made

    @property
    def verdict(self) -> str:
        return "fail" if self.flags else "pass"

    def figure_table(self) -> pd.DataFrame:
        return pd.Series(self.figures, dtype=object, name="value").to_frame()

    def flag_table(self) -> pd.DataFrame:
        """The flags, one row each; with none, one row that says so (never an empty table);
        then the checks that could not be made, as notes (count 0: they fail nothing)."""
        cols = ["check", "count", "message", "fix", "examples"]
        rows = [{c: getattr(f, c) for c in cols} for f in self.flags] or [
            {"check": "no flags", "count": 0, "message": "every notebook-01 check passed" +
             (" that could be made (see the notes)" if self.notes else ""), "fix": "-",
             "examples": []}]
        rows += [{"check": n.check, "count": 0, "message": n.message, "fix": n.fix,
                  "examples": []} for n in self.notes]
        return pd.DataFrame(rows, columns=cols)

    def flag_records(self) -> list[dict]:
        cols = ["check", "count", "message", "fix", "examples"]
        return [{c: getattr(f, c) for c in cols} for f in self.flags]


def batch_view(task: Task, items: list[Item]) -> pd.DataFrame:
    """One row per position (generation) or per example (classification) of a collated batch."""
    batch = collate_items(task, items).tensors
    labels, ids = batch["labels"], task.main_input(batch)
    mask = batch.get("attention_mask", torch.ones(ids.shape[:2], dtype=torch.long))
    if task.target_kind.float_targets:  # float targets per example
        return pd.DataFrame([{
            "example": items[b].id, "input": task.show_input(ids[b]),
            "target": task.decode(labels[b].reshape(-1).tolist()),
            "contributes": int(contributes(labels[b]).sum()),
        } for b in range(len(items))])
    if labels.dim() == 1:  # one label per example
        return pd.DataFrame([{
            "example": items[b].id, "input": task.show_input(ids[b][mask[b].bool()]),
            "length": int(mask[b].sum()), "label_id": int(labels[b]),
            "class": task.decode([int(labels[b])]) if int(labels[b]) != IGNORE_INDEX else "",
            "contributes": int(labels[b]) != IGNORE_INDEX,
        } for b in range(len(items))])
    prompt = target_prompt(task, batch, items)
    targets = task.targets(labels)  # what position t is trained to predict
    rows = []
    for b in range(len(items)):
        for t in range(ids.shape[1]):
            label = int(targets[b, t])
            rows.append({
                "example": items[b].id, "position": t, "input_id": int(ids[b, t]),
                "input": (task.decode_input or task.decode)([int(ids[b, t])]), "label_id": label,
                "target": task.decode([label]) if label != IGNORE_INDEX else "",
                "attention_mask": int(mask[b, t]), "padding": not bool(mask[b, t]),
                "prompt": bool(prompt[b, t]),
                "contributes": label != IGNORE_INDEX,
            })
    return pd.DataFrame(rows)


def target_prompt(task: Task, batch: dict, items: list[Item]) -> torch.Tensor:
    """Which positions of a collated batch are trained to predict a prompt token: the
    prompt_mask (label positions) moved as the labels are, or, without one, the prompt found
    by `prompt_span` on each example."""
    labels = batch["labels"]
    if "prompt_mask" in batch:
        return task.targets(batch["prompt_mask"].long()) > 0
    prompt = torch.zeros_like(labels, dtype=torch.bool)
    left = task.side(batch) == "left"
    for b, it in enumerate(items):
        span = prompt_span(task, it)
        if isinstance(span, int):
            start = labels.shape[1] - task.length(it.tensors) if left else 0
            prompt[b, start:start + max(span - 1, 0)] = True
    return prompt


def render_tokens(view: pd.DataFrame) -> str:
    """HTML of a per-position view: green = contributes to the loss, grey = prompt, struck = pad.

    A red box marks a position that contributes although it is padding or an excluded prompt.
    """
    lines = []
    for example, rows in view.groupby("example", sort=False):
        spans = []
        for r in rows.itertuples():
            style = ["padding:1px 2px", "margin:1px", "font-family:monospace"]
            if r.contributes:
                style.append("background:#c8f0c8")
            elif r.prompt:
                style.append("background:#e6e6e6")
            if r.padding:
                style.append("text-decoration:line-through;color:#999")
            if r.contributes and (r.padding or r.prompt):
                style.append("outline:2px solid #d00")
            title = f"pos {r.position}: in {r.input_id} -> label {r.label_id}"
            spans.append(f'<span style="{";".join(style)}" title="{title}">'
                         f"{html.escape(r.target or r.input)}</span>")
        lines.append(f"<div><b>{html.escape(str(example))}</b> {''.join(spans)}</div>")
    legend = ("<div style='font-size:small'>Each cell is one position. Green: the target the "
              "loss trains on at that position (counted). Grey: a prompt position, not "
              "counted - the cell shows its input token. Struck through: padding, not "
              "counted. Red box: counted although it is padding or prompt (a bug). Hover "
              "for the ids.</div>")
    return legend + "".join(lines)


def loss_coverage(task: Task, items: list[Item], batch_size: int = 64,
                  spans: list[int | str] | None = None) -> pd.DataFrame:
    """Per example: real positions, contributing targets, and those on padding or the prompt
    (from the batch's prompt_mask, else from `spans`: see `prompt_spans`)."""
    rows = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        spanned = spans[start:start + batch_size] if spans else [None] * len(chunk)
        batch = collate_items(task, chunk).tensors
        labels = batch["labels"]
        counted = contributes(labels)
        if labels.dim() == 1 or task.target_kind.float_targets:  # per example, not position
            for it, c in zip(chunk, counted, strict=True):
                rows.append({"example": it.id, "positions": 1, "targets": int(c.sum()),
                             "on_padding": 0, "on_prompt": 0})
            continue
        mask = batch.get("attention_mask", torch.ones_like(labels)).bool()
        prompt = batch["prompt_mask"].bool() if "prompt_mask" in batch else None
        for b, (it, span) in enumerate(zip(chunk, spanned, strict=True)):
            rows.append({
                "example": it.id, "positions": int(mask[b].sum()),
                "targets": int(counted[b].sum()),
                "on_padding": int((counted[b] & ~mask[b]).sum()),
                "on_prompt": 0 if task.prompt_in_loss else int((counted[b] & prompt[b]).sum())
                if prompt is not None else targets_on_prompt(task, it, span),
            })
    return pd.DataFrame(rows)


def prompt_span(task: Task, item: Item) -> int | str:
    """How many leading input positions of an example hold its prompt, found by encoding it
    again with the response emptied (that encoding's inputs are a prefix of the full one's, an
    end token aside); or why that cannot be told."""
    if not task.response_field or item.raw is None:
        return "the task names no response_field to empty" if not task.response_field \
            else "the raw example is not kept"
    full = task.main_input(item.tensors).reshape(-1)
    if item.tensors["labels"].numel() != full.numel():
        return "its labels and inputs differ in length"
    try:
        short = task.main_input(task.encode({**item.raw, task.response_field: ""})).reshape(-1)
    except Exception as exc:
        return f"encoding an example with an empty response raised {type(exc).__name__}: " \
               f"{reason(exc, 120)}"
    same = (full[:short.numel()] == short[:full.numel()]).long().cumprod(0)
    common = int(same.sum())
    if torch.equal(full, short) and str(item.raw.get(task.response_field, "")):
        return (f"emptying {task.response_field!r} leaves the encoding unchanged (the "
                "example is cut inside its prompt, or encode does not read that field)")
    if common == 0 or common < min(short.numel() - 1, full.numel()):
        return "the encoding with an empty response is not a prefix of the full one"
    return common


def prompt_spans(task: Task, items: list[Item]) -> list[int | str] | None:
    """`prompt_span` of each example, when 01 must find the prompt itself: a generation task
    that excludes its prompt from the loss while encode gives no prompt_mask; None otherwise."""
    if not task.target_kind.prompts or task.prompt_in_loss or not items or \
            any("prompt_mask" in it.tensors for it in items):
        return None
    return [prompt_span(task, it) for it in items]


def targets_on_prompt(task: Task, item: Item, span: int | str | None) -> int:
    """Targets of one example that are prompt tokens: position t predicts input t + 1 (labels
    aligned by `label_shift`), so the first span - 1 targets are the prompt's."""
    if not isinstance(span, int):
        return 0
    targets = task.targets(item.tensors["labels"].reshape(-1))
    return int(contributes(targets[:max(span - 1, 0)]).sum())


def prompt_notes(spans: list[int | str] | None) -> list[Note]:
    """Say plainly when prompt masking could not be checked (on some or all examples)."""
    unchecked = Counter(s for s in spans or [] if isinstance(s, str))
    if not unchecked:
        return []
    why, _ = unchecked.most_common(1)[0]
    n = sum(unchecked.values())
    share = "any example" if n == len(spans) else f"{n} of {len(spans)} examples"
    return [Note("prompt masking not checked", f"01 could not check prompt masking on {share}: "
                 f"{why} (encode gives no prompt_mask, so 01 looks for the prompt itself)",
                 "return a prompt_mask from encode (True on the prompt's label positions), so "
                 "01 counts the targets on the prompt")]


def coverage_flags(coverage: pd.DataFrame) -> list[Flag]:
    """Flags for examples without targets and targets counted on padding or the prompt."""
    flags = []
    zero = coverage[coverage.targets == 0]
    if len(zero):
        flags.append(Flag("zero targets", f"{len(zero)} examples contribute nothing to the loss "
                          "(often truncation cut the whole response)", len(zero),
                          "raise max_length, or drop these examples deliberately and record it",
                          zero.example.head(5).tolist()))
    bad = coverage[coverage.on_padding > 0]
    if len(bad):
        flags.append(Flag("loss on padding", f"{int(bad.on_padding.sum())} targets on padding "
                          f"positions, in {len(bad)} examples", int(bad.on_padding.sum()),
                          "pad labels with -100 (the ignore index)",
                          bad.example.head(5).tolist()))
    bad = coverage[coverage.on_prompt > 0]
    if len(bad):
        flags.append(Flag("loss on prompt", f"{len(bad)} of {len(coverage)} examples have "
                          f"targets on prompt tokens ({int(bad.on_prompt.sum())} targets) "
                          "although the task excludes the prompt: the loss learns to predict "
                          "the instruction", int(bad.on_prompt.sum()),
                          "set labels to -100 on the prompt (or declare prompt_in_loss=True "
                          "if the instruction is meant to be learned)",
                          bad.example.head(5).tolist()))
    return flags


def loss_probe(task: Task, model: torch.nn.Module, items: list[Item]) -> list[Flag]:
    """Call the task's loss on real logits, then scramble the logits where nothing should count
    (label -100 or padding): the loss and its target count must not change."""
    batch = collate_items(task, items).tensors
    with torch.no_grad():
        outputs = task.outputs(model, batch)
        logits = outputs.logits.float()
        try:
            loss, count = task.loss(logits, batch)
        except Exception as exc:  # e.g. a label id beyond the output layer
            return [model_failure(task, model, batch, items, exc, outputs=logits.shape[-1],
                                  step="loss")]
        labels = batch["labels"]
        own = own_loss_flags(task, outputs.loss, loss, count, items)
        if task.target_kind.float_targets:
            return (_count_flags(task, labels, count) + own
                    + padding_probe(task, model, items, logits)
                    + _padding_copy_flags(task, logits, batch, loss, count, items))
        loss2, count2 = _scrambled_loss(task, logits, batch, task.label_shift)
    flags = _count_flags(task, labels, count) + own
    if not torch.isclose(loss, loss2, rtol=1e-5, atol=1e-5) or int(count2) != int(count):
        flags.append(_misread(task, logits, batch, loss, loss2, items))
    flags += padding_probe(task, model, items, logits)
    return flags


def own_loss_flags(task: Task, own: torch.Tensor | None, loss: torch.Tensor, count,
                   items: list[Item]) -> list[Flag]:
    """A model that computes its own loss (given the labels, as nanoGPT's forward(idx,
    targets) and Hugging Face models do): on the same batch it must equal the task's loss per
    target - the campaign trains on the model's, every check of the pilot reads the task's."""
    if own is None:
        return []
    ids = [it.id for it in items[:5]]
    if own.numel() != 1:
        return [Flag("model's own loss", f"the model's own loss is a tensor of shape "
                     f"{list(own.shape)}, not one number", 1, "return the mean over the "
                     "targets (a 0-d tensor), or set loss_at to where that is", ids)]
    mean = float(loss) / float(count) if float(count) else float("nan")
    if math.isclose(float(own), mean, rel_tol=2e-5, abs_tol=1e-6):
        return []
    return [Flag("model's own loss", f"the model's own loss {float(own):.4f} is not the task's "
                 f"loss {mean:.4f} ({float(loss):.4g} summed over {float(count):g} targets) on "
                 "the same batch: the campaign trains on the model's loss, the pilot checks "
                 "the task's", 1,
                 "make them read the same targets: labels shifted in the data are not shifted "
                 "again inside the forward, and both ignore -100 (or set the task's loss to "
                 "what the model computes)", ids)]


def _count_flags(task: Task, labels: torch.Tensor, count) -> list[Flag]:
    """The loss's target count must be the number of targets (a mean with count 1 weighs
    micro-batches instead of targets when updates accumulate)."""
    expected = task.target_count(labels)
    if float(count) == expected:
        return []
    what = task.target_kind.target_words
    return [Flag("loss target count", f"loss reports {float(count):g} targets, the batch has "
                 f"{expected} {what}", abs(int(float(count)) - expected),
                 f"return (summed loss, number of {what}) from the task's loss - not a mean")]


def _padding_copy_flags(task: Task, logits: torch.Tensor, batch: dict, loss: torch.Tensor,
                        count, items: list[Item]) -> list[Flag]:
    """Regression: evaluation pads its last batch with copies whose targets are NaN; the loss
    must skip them (finite, and the count drops by the copy's targets)."""
    labels = batch["labels"].clone()
    labels[0] = float("nan")
    probe = {**batch, "labels": labels}
    loss2, count2 = task.loss(logits, probe)
    dropped = int(contributes(batch["labels"][0]).sum())
    if math.isfinite(float(loss2)) and float(count2) == float(count) - dropped:
        return []
    return [Flag("loss reads padding copies", f"with NaN targets on one example (as on the "
                 f"padding copies of an evaluation's last batch) the loss is {float(loss2):.4g} "
                 f"over {float(count2):g} targets", 1,
                 "skip NaN targets in the loss (labels.isnan()), as the default loss does",
                 [items[0].id])]


def _scrambled_loss(task: Task, logits: torch.Tensor, batch: dict, shift: int):
    """The loss with the logits scrambled where no target (aligned by `shift`) reads them."""
    labels = batch["labels"]
    ignored = task.target_kind.targets(labels, shift) == IGNORE_INDEX
    if labels.dim() > 1 and "attention_mask" in batch:
        ignored = ignored | (batch["attention_mask"] == 0)
    scrambled = logits + 50 * torch.randn_like(logits) * ignored.unsqueeze(-1)
    return task.loss(scrambled, batch)


def _misread(task: Task, logits: torch.Tensor, batch: dict, loss: torch.Tensor,
             loss2: torch.Tensor, items: list[Item]) -> Flag:
    """The loss read logits no declared target reads: is it the other label alignment?"""
    other = 1 - task.label_shift
    if task.target_kind.shifts_labels and batch["labels"].dim() > 1:
        loss3, _ = _scrambled_loss(task, logits, batch, other)
        if torch.isclose(loss, loss3, rtol=1e-5, atol=1e-5):
            said = {0: "labels aligned with the logits (position t predicts labels[t])",
                    1: "labels shifted by one (position t predicts labels[t + 1], the Hugging "
                       "Face causal-LM convention)"}
            own = task.loss_computed_by()
            return Flag("label alignment", f"the loss uses {said[other]}, but the task "
                        f"declares label_shift={task.label_shift}: every per-token check would "
                        "pair positions with the wrong targets", 1,
                        f"set label_shift={other} in the Task (or make the loss match the "
                        "declaration)" + (f"; {own} computes the loss the campaign trains "
                                          "on: check it aligns the labels as the declaration "
                                          "says" if own else ""), [it.id for it in items])
    return Flag("loss reads ignored positions", f"the loss changed from {float(loss):.4f} to "
                f"{float(loss2):.4f} when only ignored/padded positions changed", 1,
                "compute the loss only where labels != -100 (ignore_index=-100)",
                [it.id for it in items])


def own_loss_shift(task: Task, model: torch.nn.Module, items: list[Item]) -> int | None:
    """Generation whose model computes its own loss: the label shift that loss applies (0: it
    reads labels[t] at position t, as nanoGPT's; 1: it shifts them, as Hugging Face causal LMs
    do), read by comparing it with the cross-entropy at each shift; None otherwise."""
    if not task.target_kind.shifts_labels or task.loss_computed_by() is None or not items:
        return None
    batch = collate_items(task, items).tensors
    try:
        with torch.no_grad():
            out = task.outputs(model, batch)
    except Exception:
        return None  # the forward's failure is flagged by the probes
    if out.loss is None or out.loss.numel() != 1 or out.logits.dim() != 3:
        return None
    for shift in (0, 1):
        summed, count = token_cross_entropy(out.logits.float(), batch, shift)
        if float(count) and math.isclose(float(out.loss), float(summed) / float(count),
                                         rel_tol=2e-5, abs_tol=1e-6):
            return shift
    return None


def copy_audit(task: Task, items: list[Item], share: float = 0.9,
               model_shift: int | None = None) -> list[Flag]:
    """Generation: when nearly every position is trained to output its own input token, the
    model learns to copy - labels aligned with input_ids (the Hugging Face convention) while
    neither the loss nor `label_shift` moves them by one."""
    if not task.target_kind.shifts_labels or not items:
        return []
    copying = total = 0
    for it in items[:64]:
        ids, targets = task.main_input(it.tensors).reshape(-1), task.targets(it.tensors["labels"])
        targets = targets.reshape(-1)
        if ids.shape != targets.shape:
            return []
        keep = targets != IGNORE_INDEX
        copying += int((targets[keep] == ids[keep]).sum())
        total += int(keep.sum())
    if not total or copying / total < share:
        return []
    own = task.loss_computed_by() if model_shift != 1 else None  # a model that shifts
    fix = ("shift the targets by one where the data are made (targets = the tokens one "
           f"position on: y = data[i + 1:i + 1 + T]): {own} computes the loss the campaign "
           "trains on, which label_shift does not move" if own else
           "labels aligned with input_ids need a shift by one: set label_shift=1 (the default "
           "loss then shifts), or shift them in encode")
    return [Flag("targets copy the input", f"{copying} of {total} targets equal the input token "
                 "at the same position: the model is trained to copy its input, not to predict "
                 "the next token", 1, fix, [it.id for it in items[:5]])]


def padding_probe(task: Task, model: torch.nn.Module, items: list[Item],
                  batched: torch.Tensor) -> list[Flag]:
    """An example's outputs must not depend on the padding its batch neighbours add (nor on
    chance: a model whose eval outputs vary between two identical calls is named as such)."""
    changed = []
    batch = collate_items(task, items).tensors
    side = task.side(batch)
    with torch.no_grad():
        if not torch.equal(task.forward(model, batch).float(), batched):
            return [Flag("random outputs in eval mode", "two forward passes on the same batch "
                         "in eval mode disagree: dropout (or another random layer) stays "
                         "active in evaluation", 1, "make random layers follow "
                         "model.eval() (nn.Dropout does; a functional dropout needs "
                         "training=self.training)", [it.id for it in items[:5]])]
        for b, it in enumerate(items):
            one = collate_items(task, [it]).tensors
            try:
                alone = task.forward(model, one).float()[0]
            except Exception as exc:  # batched it ran: this example alone does not
                return [model_failure(task, model, one, [it], exc)]
            mine = task.real_part(batched[b], alone.shape[0], side) if alone.dim() > 1 \
                else batched[b]
            if not torch.allclose(alone, mine, rtol=1e-4, atol=1e-4):
                changed.append(it.id)
    if not changed:
        return []
    return [Flag("padding changes outputs", f"{len(changed)} examples get other outputs when "
                 f"batched with longer ones ({side}-padded)", len(changed),
                 "pass the attention mask to the model and mask padding in attention/pooling"
                 + ("; with left padding, derive position ids from the mask"
                    if side == "left" else ""),
                 changed[:5])]


def label_audit(task: Task, splits: dict[str, list[dict]], items: dict[str, list[Item]],
                num_outputs: int | None,
                source: str = "") -> tuple[pd.DataFrame | None, list[Flag]]:
    """Class histogram per split, the id <-> name round trip, and ids the model cannot output
    (`num_outputs` None: unknown, not checked; `source`: where it was read, when not from a
    forward)."""
    kind = task.target_kind
    if kind.float_targets:
        return target_statistics(items), []
    flags, bad_ids, mismatched = [], [], []
    counts: dict[str, Counter] = defaultdict(Counter)
    for name in SPLITS:
        for ex, it in zip(splits[name], items[name], strict=True):
            labels = it.tensors["labels"].reshape(-1)
            real = labels[labels != IGNORE_INDEX]
            if num_outputs is not None and ((real < 0) | (real >= num_outputs)).any():
                bad_ids.append(it.id)
            if kind.named_classes:
                names, raw = kind.names_of(task, real.tolist()), kind.raw_names(task, ex)
                counts[name].update(names)
                if names != raw:
                    mismatched.append((it.id, *next(
                        ((r, n) for r, n in zip(raw, names, strict=False) if r != n),
                        (" ".join(raw), " ".join(names)))))
    if bad_ids:
        flags.append(Flag("label ids out of range", f"{len(bad_ids)} examples have label ids "
                          f"outside 0..{num_outputs - 1}, which the model cannot output"
                          + (f" ({source})" if source else ""),
                          len(bad_ids), "fix the label map or the model's output size",
                          bad_ids[:5]))
    if mismatched:
        flags.append(Flag("label map round trip", f"{len(mismatched)} examples decode to another "
                          f"class than their raw label (e.g. {mismatched[0][1]!r} -> "
                          f"{mismatched[0][2]!r}): the map is shifted or wrong", len(mismatched),
                          "make encode and decode use the same class name <-> id map",
                          [m[0] for m in mismatched[:5]]))
    if not kind.named_classes:
        return None, flags
    table = pd.DataFrame(counts).reindex(columns=list(SPLITS)).fillna(0).astype(int)
    table.index.name = "class"
    order = [n for n in (task.label_names or []) if n in table.index]
    table = table.reindex(order + [n for n in table.index if n not in order])
    return table, flags


def target_statistics(items: dict[str, list[Item]]) -> pd.DataFrame:
    """Regression: the targets per split (count, mean, spread, range), where classification
    shows its class histogram - a split whose targets differ is a leak or a drift."""
    rows = {}
    for name in SPLITS:
        values = [it.tensors["labels"].reshape(-1).float() for it in items[name]]
        v = torch.cat(values) if values else torch.zeros(0)
        v = v[~v.isnan()]
        rows[name] = {"targets": v.numel(), **({"mean": float(v.mean()), "std": float(v.std()),
                                                "min": float(v.min()), "max": float(v.max())}
                                               if v.numel() > 1 else {})}
    table = pd.DataFrame(rows).round(4)
    table.index.name = "statistic"
    return table


def split_audit(task: Task, splits: dict[str, list[dict]],
                items: dict[str, list[Item]]) -> tuple[pd.DataFrame, list[Flag]]:
    """Per split: examples and groups; flags for a group or an identical input in two splits."""
    group_splits: dict[str, set] = defaultdict(set)
    input_splits: dict[tuple, set] = defaultdict(set)
    rows = []
    for name in SPLITS:
        groups = {str(ex[task.group_key]) for ex in splits[name]}
        for g in groups:
            group_splits[g].add(name)
        for ex, it in zip(splits[name], items[name], strict=True):
            key = tuple(tuple(it.tensors[k].reshape(-1).tolist()) for k in task.model_inputs
                        if k in it.tensors)
            input_splits[key].add((name, ex[task.id_key]))
        rows.append({"split": name, "examples": len(splits[name]), "groups": len(groups)})
    table = pd.DataFrame(rows)
    table["share"] = (table.examples / table.examples.sum()).round(3)
    flags = []
    crossing = sorted(g for g, s in group_splits.items() if len(s) > 1)
    if crossing:
        flags.append(Flag("group crosses splits", f"{len(crossing)} groups of "
                          f"{task.group_key!r} appear in more than one split: validation "
                          "leaks training data", len(crossing),
                          "split by the group key (the default rule), not by example",
                          crossing[:5]))
    dupes = [sorted(map(str, s)) for s in input_splits.values() if len({n for n, _ in s}) > 1]
    if dupes:
        flags.append(Flag("duplicate input crosses splits", f"{len(dupes)} identical inputs "
                          "sit in two splits", len(dupes),
                          "remove duplicates before splitting or give them one group", dupes[:5]))
    return table, flags


def nonfinite_audit(items: dict[str, list[Item]]) -> list[Flag]:
    """NaN or infinity in any floating-point tensor of an example (inputs or targets): every
    later number - the loss, the gradients, the probes below - would be meaningless."""
    bad = [it.id for name in SPLITS for it in items[name]
           if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                  for t in it.tensors.values())]
    if not bad:
        return []
    return [Flag("non-finite inputs", f"{len(bad)} examples hold NaN or infinite values", len(bad),
                 "clean or impute them in load_examples/encode (the loss and padding probes "
                 "were skipped: they cannot judge non-finite inputs)", bad[:5])]


def probe_outputs(task: Task, model: torch.nn.Module, probe: list[Item],
                  data: list[Item]) -> tuple[int | None, list[Flag]]:
    """The size of the model's output layer from a forward on the probe batch; when that
    forward raises, None and a flag naming the cause."""
    try:
        return num_outputs_of(task, model, probe), []
    except Exception as exc:
        return None, [model_failure(task, model, collate_items(task, probe).tensors, probe, exc,
                                    data)]


def num_outputs_of(task: Task, model: torch.nn.Module, items: list[Item]) -> int:
    """Size of the model's output layer, read from one forward pass."""
    with torch.no_grad():
        return int(task.forward(model, collate_items(task, items).tensors).shape[-1])


def inspect_task(task: Task, probe_size: int = 8) -> Inspection:
    """Run every notebook-01 check on the task; the verdict fails on any flag."""
    data = prepare(task, SPLITS)
    splits, items = data.raw, data.items
    torch.manual_seed(0)
    model = task.build_model().eval()
    train = items["train"]
    by_length = sorted(train, key=lambda it: task.length(it.tensors))
    probe = by_length[: probe_size // 2] + by_length[-(probe_size - probe_size // 2):]
    every = [it for n in SPLITS for it in items[n]]
    outputs, forward = probe_outputs(task, model, probe, every)
    spans = {n: prompt_spans(task, items[n]) for n in SPLITS}
    coverage = pd.concat([loss_coverage(task, items[n], spans=spans[n]).assign(split=n)
                          for n in SPLITS], ignore_index=True)
    split_table, split_flags = split_audit(task, splits, items)
    layer = output_layer(model) if outputs is None else None
    classes, label_flags = label_audit(
        task, splits, items, outputs if layer is None else layer[1],
        "" if layer is None else f"the outputs of its last linear layer `{layer[0]}`, read "
        "from the model since its forward failed")
    nonfinite = nonfinite_audit(items)
    probed = loss_probe(task, model, probe) if not nonfinite and outputs is not None else []
    flags = (forward + coverage_flags(coverage) + nonfinite + probed
             + copy_audit(task, items["train"], model_shift=own_loss_shift(task, model, probe))
             + label_flags + split_flags)
    positions = int(coverage.positions.sum())
    figures = {
        "examples": len(coverage), "num_outputs": outputs,
        "expected_initial_loss": None if outputs is None and not task.target_kind.float_targets
        else round(task.expected_initial_loss(
            outputs, torch.cat([it.tensors["labels"].reshape(-1) for it in train])), 4),
        "contributing_share": round(int(coverage.targets.sum()) / max(positions, 1), 4),
        "targets_per_example_mean": round(float(coverage.targets.mean()), 3),
        "zero_target_examples": int((coverage.targets == 0).sum()),
        "targets_on_padding": int(coverage.on_padding.sum()),
        "targets_on_prompt": int(coverage.on_prompt.sum()),
        "groups_crossing_splits": next((f.count for f in flags if f.check ==
                                        "group crosses splits"), 0),
        "flags": len(flags),
    }
    notes = prompt_notes([x for n in SPLITS for x in spans[n] or []]) + adapter_notes(task)
    return Inspection(task, splits, items, split_table, coverage, figures, flags, classes,
                      notes)


def adapter_notes(task: Task) -> list[Note]:
    """What a framework adapter mapped or left out (`adapter_notes`: from_hf's padding rows of
    label -100) and what its stand-ins gave the task's own code that the campaign will give
    otherwise (`campaign_differs_in`: a Trainer's estimated_stepping_batches)."""
    notes = [Note("what the adapter mapped", str(n), "-")
             for n in getattr(task, "adapter_notes", None) or []]
    differs = getattr(task, "campaign_differs_in", None) or {}
    if differs:
        said = "; ".join(f"{name} ({str(why).split(' here: ', 1)[-1]})"  # each run has its own
                         for name, why in sorted(differs.items()))
        notes.append(Note("the campaign will differ in", f"the task's code reads {said}",
                          "nothing to change: a schedule sized by these values follows the "
                          "pilot's run here and the campaign's own length there"))
    return notes


def example_display(task: Task, items: list[Item]):
    """What the loss receives for these examples: coloured tokens (generation) or a table."""
    from IPython.display import HTML

    view = batch_view(task, items)
    return HTML(render_tokens(view)) if "position" in view else view


def browser(task: Task, items: dict[str, list[Item]] | list[Item],
            raw: dict[str, list[dict]] | None = None) -> None:
    """`browser_view` displayed (the cell shows it whether or not it ends in `;`); a headless
    run shows the static view of the first example instead and creates no widget."""
    from IPython.display import display

    view = browser_view(task, items, raw)
    if view is not None:
        display(view)


def browser_view(task: Task, items: dict[str, list[Item]] | list[Item],
                 raw: dict[str, list[dict]] | None = None):
    """Browse examples one at a time, as `example_display` shows them: a split selector, a slider
    across the split (counting from 1, as the status line does) and a search by example id or
    group (exact first, else the first that contains the text, case-insensitive; the button
    searches again), as a widget. A headless run (no frontend) displays the static view of the
    first example instead, creates no widget and returns None."""
    from IPython.display import display

    by_split = {k: v for k, v in (items if isinstance(items, dict) else
                                   {"train": items}).items() if v}
    if headless():
        display(example_display(task, next(iter(by_split.values()))[:1]))
        return None
    import ipywidgets as widgets

    groups = {name: [str(ex[task.group_key]) for ex in raw[name]] for name in by_split} \
        if raw else {}
    split = widgets.Dropdown(options=list(by_split), description="split")
    index = widgets.IntSlider(1, 1, len(by_split[split.value]), description="example",
                              continuous_update=False, layout=widgets.Layout(width="95%"))
    query = widgets.Text(placeholder="example id or group", description="find",
                         continuous_update=False)
    again = widgets.Button(description="find", tooltip="search (again) for the text")
    status, out = widgets.HTML(), widgets.Output()

    def show(*_, note: str = ""):
        it = by_split[split.value][index.value - 1]
        group = groups[split.value][index.value - 1] if groups else "?"
        status.value = (f"{split.value} {index.value} of {len(by_split[split.value])}: "
                        f"id {html.escape(str(it.id))}, group {html.escape(group)}"
                        + (f" ({html.escape(note)})" if note else ""))
        out.clear_output(wait=True)
        with out:
            display(example_display(task, [it]))

    def change_split(_):
        index.max, index.value = len(by_split[split.value]), 1
        show()

    def matches(wanted: str) -> list[tuple[str, int]]:
        order = [split.value] + [n for n in by_split if n != split.value]
        keys = [(name, i, (str(it.id), groups[name][i] if groups else ""))
                for name in order for i, it in enumerate(by_split[name])]
        exact = [(n, i) for n, i, k in keys if wanted in k]
        low = wanted.lower()
        return exact or [(n, i) for n, i, k in keys if any(low in v.lower() for v in k)]

    def find(*_):
        wanted = query.value.strip()
        if not wanted:
            return
        found = matches(wanted)
        if not found:
            status.value = f"no example whose id or group contains {html.escape(wanted)!r}"
            return
        name, i = found[0]
        with index.hold_trait_notifications():
            if split.value != name:
                split.unobserve(change_split, "value")
                split.value, index.max = name, len(by_split[name])
                split.observe(change_split, "value")
            index.unobserve(show, "value")
            index.value = i + 1
            index.observe(show, "value")
        show(note=f"first of {len(found)} matching {wanted!r}" if len(found) > 1 else "")

    split.observe(change_split, "value")
    index.observe(show, "value")
    query.observe(find, "value")
    with warnings.catch_warnings():  # Enter again on the same text changes no value: only the
        warnings.simplefilter("ignore", DeprecationWarning)  # submit event says it (ipywidgets 8
        query.on_submit(find)  # keeps sending it, though it marks on_submit deprecated)
    again.on_click(find)
    show()
    return widgets.VBox([widgets.HBox([split, query, again]), index, status, out])


def run(params: dict[str, Any], out_dir: Path | None = None) -> Inspection:
    """Notebook 01 from its parameters (it writes nothing until `save`)."""
    return inspect_task(task_from_params(params), probe_size=params["probe_size"])


def save(ins: Inspection, out_dir: Path) -> str:
    """Write the tables and `summary.json` of notebook 01 into its run folder; the verdict."""
    from ..storage.files import write_json
    from ..storage.runs import save_table, write_summary

    save_table(ins.split_table, out_dir, "splits")
    save_table(ins.coverage, out_dir, "coverage")
    if ins.classes is not None:
        save_table(ins.classes.reset_index(), out_dir, "classes")
    write_json(out_dir / "flags.json", ins.flag_records())
    write_summary(out_dir, ins.verdict, ins.figures, task=ins.task.name,
                  flags=[f.check for f in ins.flags],
                  notes=[f"{n.check}: {n.message}" for n in ins.notes])
    return ins.verdict
