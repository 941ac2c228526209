"""Notebook 01's coverage: per example, the positions the loss counts and those it counts on
padding or the prompt - the prompt found by encoding again when encode gives no prompt_mask."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ...base.errors import reason
from ...contract import fine_tuning
from ...contract.data import Item, collate_items
from ...contract.targets import IGNORE_INDEX, contributes
from ...contract.task import Task
from ...storage.records import Flag


@dataclass
class Note:
    """A check that could not be made on this task, said plainly; it fails nothing."""

    check: str
    message: str
    fix: str


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


def batch_coverage(task: Task, items: list[Item], batch: dict,
                   spans: list[int | str] | None = None) -> tuple[list[int], ...]:
    """Per example of a collated batch, four lists: real positions, contributing targets, and
    the targets on padding and on the prompt (from the batch's prompt_mask, else from `spans`:
    see `prompt_spans`), counted for the whole batch at once."""
    labels, n = batch["labels"], len(items)
    counted = contributes(labels).reshape(n, -1)
    targets = counted.sum(1).tolist()
    if labels.dim() == 1 or task.target_kind.float_targets:  # per example, not position
        return [1] * n, targets, [0] * n, [0] * n
    mask = batch.get("attention_mask")  # none: every position is real
    mask = torch.ones_like(counted) if mask is None else mask.bool().reshape(n, -1)
    positions, padding = mask.sum(1).tolist(), (counted & ~mask).sum(1).tolist()
    if task.prompt_in_loss:
        prompt = [0] * n
    elif "prompt_mask" in batch:
        prompt = (counted & batch["prompt_mask"].bool().reshape(n, -1)).sum(1).tolist()
    else:
        prompt = [targets_on_prompt(task, it, span)
                  for it, span in zip(items, spans or [None] * n, strict=True)]
    return positions, targets, padding, prompt


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


def prompt_notes(unchecked: Counter, total: int) -> list[Note]:
    """Say plainly when prompt masking could not be checked (on some or all of the `total`
    examples; `unchecked`: why, counted)."""
    if not unchecked:
        return []
    why, _ = unchecked.most_common(1)[0]
    n = sum(unchecked.values())
    share = "any example" if n == total else f"{n} of {total} examples"
    return [Note("prompt masking not checked", f"01 could not check prompt masking on {share}: "
                 f"{why} (encode gives no prompt_mask, so 01 looks for the prompt itself)",
                 "return a prompt_mask from encode (True on the prompt's label positions), so "
                 "01 counts the targets on the prompt")]


def coverage_flags(zero, on_padding, on_prompt, examples: int) -> list[Flag]:
    """Flags for examples without targets and targets counted on padding or the prompt (each a
    `scan.Finding`: examples, targets, the first ids; `examples`: how many were scanned)."""
    flags = []
    if zero.examples:
        flags.append(Flag("zero targets", f"{zero.examples} examples contribute nothing to the "
                          "loss (often truncation cut the whole response)", zero.examples,
                          "raise max_length, or drop these examples deliberately and record it",
                          list(zero.ids)))
    if on_padding.examples:
        flags.append(Flag("loss on padding", f"{int(on_padding.amount)} targets on padding "
                          f"positions, in {on_padding.examples} examples", int(on_padding.amount),
                          "pad labels with -100 (the ignore index)", list(on_padding.ids)))
    if on_prompt.examples:
        flags.append(Flag("loss on prompt", f"{on_prompt.examples} of {examples} examples have "
                          f"targets on prompt tokens ({int(on_prompt.amount)} targets) "
                          "although the task excludes the prompt: the loss learns to predict "
                          "the instruction", int(on_prompt.amount),
                          "set labels to -100 on the prompt - with TRL, "
                          "SFTConfig(assistant_only_loss=True) for chats (every assistant "
                          "turn trained) or completion_only_loss for prompt-completion rows - "
                          "or declare prompt_in_loss=True if the instruction is meant to be "
                          "learned", list(on_prompt.ids)))
    return flags


def end_token_audit(task: Task, items: list[Item]) -> list[Flag]:
    """Responses whose end token (`task.end_token`: EOS or end of turn) is no target although
    the token before it is: the model never learns to stop. Checked on the examples 01 keeps
    whole; the usual cause is pad_token == eos_token with a collator that masks every pad id
    (huggingface/trl#976)."""
    end = task.end_token
    if end is None or not task.target_kind.causal:
        return []
    masked, ids, seen = 0, [], 0
    for it in items:
        inputs = task.main_input(it.tensors).reshape(-1)
        targets = task.targets(it.tensors["labels"].reshape(-1))
        if targets.numel() != inputs.numel() or inputs.numel() < 2:
            continue
        trained = contributes(targets[:-1])
        ending = (inputs[1:] == end) & torch.cat([torch.zeros(1, dtype=torch.bool),
                                                  trained[:-1]])  # right after a target
        seen += int(ending.any())
        lost = int((ending & ~trained).sum())
        if lost:
            masked += lost
            ids.append(it.id)
    if not ids:
        return []
    return [Flag("end token not a target",
                 f"{len(ids)} of {len(items)} examples end a response with the end token (id "
                 f"{end}) whose label is -100 ({masked} ends): the model never learns to stop "
                 "and generates past the answer - usually pad_token == eos_token, so a "
                 "collator that masks every pad id masks the end token with them", masked,
                 "give the tokenizer a pad token of its own (tokenizer.pad_token = '<pad>', or "
                 "the model's own pad/unk token), or mask padding by the attention mask", ids)]


def dropped_rows_audit(task: Task) -> list[Flag]:
    """Rows a framework's own preparation dropped before the pilot saw them (`rows_dropped`,
    per split: dropped, given, why - from_trainer counts TRL's): the campaign loses them too,
    silently."""
    dropped = task.framework.rows_dropped
    if not dropped:
        return []
    said = " and ".join(f"{d} of {g} {split} rows" for split, (d, g, _) in dropped.items())
    why = next(iter(dropped.values()))[2]
    return [Flag("rows dropped before training", f"the trainer's preparation dropped {said}: "
                 f"{why} - the campaign never trains or evaluates on them",
                 sum(d for d, _, _ in dropped.values()),
                 "raise max_length until the rows fit (SFT: or truncation_mode='keep_end'), "
                 "or drop the rows yourself before the trainer and record it", [])]


def new_token_audit(task: Task, model: torch.nn.Module,
                    items: list[Item]) -> tuple[list[Flag], list[Note]]:
    """Tokens the data uses (inputs; targets too when the outputs are tokens) whose rows the
    base never trained and no parameter trains (`fine_tuning.untrained_rows`, measured on the
    model): under LoRA on the linear layers the embedding and head stay frozen, so such a
    token keeps the values the resize gave it. Tokens the tokenizer added (`added_tokens`)
    whose frozen rows nothing dates are a note, with the experiment that would."""
    inputs = _distinct([task.main_input(it.tensors) for it in items])
    labels = [t for it in items if (t := it.tensors.get("labels")) is not None] \
        if task.target_kind.causal else []
    targets = _distinct(labels) - {IGNORE_INDEX}
    rows = fine_tuning.untrained_rows(model, inputs, targets,
                                      set(task.framework.added_tokens))
    frozen = [f for f in rows if f.ids]
    return (_frozen_flag(task, items, targets, frozen) if frozen else [],
            _undated_note(task, [f for f in rows if f.unknown]))


def _distinct(tensors: list[torch.Tensor]) -> set:
    """The distinct values of tensors as Python numbers, each dtype's found at once (token
    ids, non-negative and below 2^20: by counting, else by sorting)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t if t.dim() == 1 else t.reshape(-1))
    found: set = set()
    for dtype, flat in by_dtype.items():
        values = torch.cat(flat)
        if not values.numel():
            continue
        if not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
            low, high = (int(v) for v in torch.aminmax(values))
            if low >= 0 and high < 1 << 20:
                found.update(torch.bincount(values.long()).nonzero().reshape(-1).tolist())
                continue
        try:
            values = values.unique()
        except (RuntimeError, NotImplementedError):  # a dtype unique lacks (complex)
            pass
        found.update(values.tolist())
    return found


def _undated_note(task: Task, rows: list) -> list[Note]:
    """The note for frozen rows of added tokens whose start nothing here dates."""
    ids = sorted({i for f in rows for i in f.unknown})
    if not ids:
        return []
    names = ", ".join(f"{task.decode_input([i]) if task.decode_input else i!r} (id {i})"
                      for i in ids[:5])
    where = " and the ".join(f"{f.layer} (`{f.module}`)" for f in rows)
    indices = ", ".join(f"{f.module!r}: {list(f.unknown[:5])}" for f in rows)
    return [Note("added tokens: trained by the base?",
                 f"the data uses tokens the tokenizer added past its own vocabulary ({names}) "
                 f"whose rows of the {where} no parameter trains; their rows are not at the "
                 "mean of the layer (where resize_token_embeddings starts a new token), so "
                 "whether the base trained them is not known here",
                 "compare those rows with the base's checkpoint (a row the base never trained "
                 "is its initial value); if it never trained them, train them: "
                 f"LoraConfig(trainable_token_indices={{{indices}}})")]


def _frozen_flag(task: Task, items: list[Item], targets: set[int], frozen: list) -> list[Flag]:
    """The flag for tokens whose frozen rows the base never trained."""
    ids = sorted({i for f in frozen for i in f.ids})
    wanted = torch.tensor(ids)
    using = [it.id for it in items if bool(torch.isin(task.main_input(it.tensors).reshape(-1),
                                                      wanted).any())]
    aimed = sum(1 for it in items if "labels" in it.tensors and task.target_kind.causal and
                bool(torch.isin(it.tensors["labels"].reshape(-1), wanted).any()))
    one = len(ids) == 1
    names = ", ".join(f"{task.decode_input([i]) if task.decode_input else i!r} (id {i})"
                      for i in ids[:5])
    where = " and the ".join(f"{f.layer} (`{f.module}`)" for f in frozen)
    why = "; ".join(sorted({w for f in frozen for w in f.ids.values()}))
    head = next((f for f in frozen if f.layer == "output head"), None)
    cannot = (f"; a head row at the mean gives the token the mean of the other logits, so its "
              f"probability can never pass 1/{head.rows}: the model cannot learn to predict it"
              if head and any("mean" in w for w in head.ids.values()) else
              ", so the model cannot learn what they mean")
    indices = ", ".join(f"{f.module!r}: {sorted(f.ids)[:5]}" for f in frozen)
    return [Flag("added tokens not trained",
                 f"{len(ids)} token{'' if one else 's'} new to the base, {names}, "
                 f"appear{'s' if one else ''} in {len(using)} of {len(items)} examples"
                 f"{f' (a target in {aimed})' if aimed else ''}, and no parameter trains "
                 f"{'its' if one else 'their'} rows of the {where}: {why}, and the fine-tune "
                 f"leaves them there{cannot}", len(using),
                 f"train those rows: LoraConfig(trainable_token_indices={{{indices}}}), or "
                 f"modules_to_save={[f.module for f in frozen]}", using)]


def packed_groups_audit(task: Task) -> list[Flag]:
    """Groups in more than one split, checked on the rows as given before packing joined them
    (`groups_before_packing`, set by from_trainer): a packed row keeps no group."""
    checked = task.framework.groups_before_packing
    if not checked or not checked["crossing"]:
        return []
    crossing = checked["crossing"]
    return [Flag("group crosses splits", f"{len(crossing)} groups of {checked['column']!r} "
                 "appear in more than one split (checked on the rows given to the trainer, "
                 "before packing): validation leaks training data", len(crossing),
                 "split by the group key, not by example, before building the trainer",
                 crossing[:5])]


def packing_audit(task: Task, model: torch.nn.Module, items: list[Item]) -> list[Flag]:
    """Packed rows (several documents per example): each document must attend to itself only.
    Rows whose position_ids restart at each document are probed - the last document's outputs
    in its row against the document alone; packing without such positions (TRL's "wrapped")
    is named by the rows where a document ends before the row does (`task.framework.packed`: the
    strategy a framework adapter read)."""
    def restarting(it: Item) -> dict | None:  # the row as the model gets it (the collator's
        batch = collate_items(task, [it]).tensors  # positions), if its positions restart
        pos = batch.get("position_ids")
        return batch if pos is not None and bool((pos.reshape(-1)[1:] == 0).any()) else None

    row = next((it for it in items[:64] if restarting(it) is not None), None)
    if row is not None:
        whole = restarting(row)
        width = whole["input_ids"].shape[-1]
        start = int((whole["position_ids"].reshape(-1)[1:] == 0).nonzero()[-1]) + 1
        alone = {k: v[..., start:] if v.dim() and v.shape[-1] == width else v
                 for k, v in whole.items()}
        with torch.no_grad():
            packed = task.forward(model, whole).float()[0, start:]
            single = task.forward(model, alone).float()[0]
        if torch.allclose(packed, single, rtol=1e-4, atol=1e-4):
            return []
        how = getattr(getattr(model, "config", None), "_attn_implementation", None)
        return [Flag("cross-document attention", f"in a packed row the last document's "
                     "outputs differ from the document's alone (max "
                     f"{float((packed - single).abs().max()):.3g}): the model's attention"
                     f"{f' ({how})' if how else ''} ignores the position_ids that restart at "
                     "each document, so every document attends to the ones before it", 1,
                     "use an attention that keeps packed documents apart by their "
                     "position_ids (transformers' sdpa and flash_attention_2 do), or train "
                     "unpacked", [row.id])]
    strategy = task.framework.packed
    end = task.end_token
    if not strategy or end is None:
        return []
    crossing = [it.id for it in items
                if bool((task.main_input(it.tensors).reshape(-1)[:-1] == end).any())]
    if not crossing:
        return []
    return [Flag("cross-document attention", f"packing ({strategy}) joins the documents into "
                 "rows with no boundary the model sees (no per-document position_ids, one "
                 f"causal mask per row): in {len(crossing)} of {len(items)} packed rows a "
                 "document ends before the row does and the next one attends to it",
                 len(crossing), "pack with packing_strategy='bfd' (each document gets its own "
                 "position_ids, which transformers' attention honours), or packing=False",
                 crossing[:5])]


def adapter_target_audit(model: torch.nn.Module) -> list[Flag]:
    """LoRA `target_modules` entries that match no module of the model (PEFT refuses a config
    only when none match)."""
    missing = fine_tuning.unmatched_targets(model)
    if not missing:
        return []
    said = "; ".join(f"adapter {a!r}: {names}" for a, names in missing.items())
    count = sum(len(n) for n in missing.values())
    return [Flag("adapter targets match no module",
                 f"target_modules entries that match no module of the model ({said}): the "
                 "layers they were meant for train no adapter, and PEFT refuses a config only "
                 "when no entry matches", count,
                 "name the model's own layers (its linear layers: "
                 f"{', '.join(fine_tuning.linear_names(model)[:12])}), or "
                 "target_modules='all-linear'", [])]
