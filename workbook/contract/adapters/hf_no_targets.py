"""Why no row of a `from_hf` split has a target (labels -100 everywhere): the finding starts
from the rows counted, then tests the causes on the user's own tokenizer and rows - the chat
template rendered once and searched for its `{% generation %}` block (without it
`return_assistant_tokens_mask` marks nothing), each conversation tokenized again without
truncation and its first answer's position compared with the rows' length - and names those
an experiment confirmed, with their figures; otherwise what is known and the experiment left."""

from __future__ import annotations

import re
from typing import Any

from ...base.errors import WorkbookError, reason
from .torch import Stream

GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")  # the block that marks assistant tokens
ROWS_TRIED = 2_000  # conversations tokenized again per split, at most
PROBE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"}]


def rendered(tokenizer: Any, messages: list, **how: Any) -> dict:
    """The tokenizer's chat template applied to `messages`, tokenized (a dict with input_ids);
    its failure named."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **how)
    except Exception as exc:
        raise WorkbookError(f"the tokenizer's chat template raised {type(exc).__name__}: "
                            f"{reason(exc, 200)}", "fix the chat template (the campaign's "
                            "preparation renders every conversation with it)") from exc
    return {k: list(v) for k, v in out.items()}


def _rows(dataset: Any) -> list[dict]:
    """The first ROWS_TRIED rows of a split, indexed or read as a stream."""
    if isinstance(dataset, Stream):
        out = []
        for _, row in dataset.items():
            if len(out) == ROWS_TRIED:
                break
            out.append(row)
        return out
    return [dataset[i] for i in range(min(len(dataset), ROWS_TRIED))]


def _template_cause(tokenizer: Any, rows: list[dict]) -> tuple[str, str] | None:
    """(cause, fix) when the chat template has no generation block and, rendered again with
    `return_assistant_tokens_mask`, marks no token of the rows' conversations (of a probe
    conversation when the rows keep none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or GENERATION.search(template):
        return None
    chats = [r["messages"] for r in rows if isinstance(r.get("messages"), list)] or [PROBE]
    marked = [sum(rendered(tokenizer, m, return_assistant_tokens_mask=True)
                  ["assistant_masks"]) for m in chats]
    if any(marked):
        return None
    what = f"{len(marked)} rows" if chats[0] is not PROBE else "a probe conversation"
    return (f"the chat template has no {{% generation %}} block, so "
            f"return_assistant_tokens_mask marks nothing: 0 of {what} have an assistant token "
            "(rendered again here)",
            "add {% generation %}...{% endgeneration %} around the assistant content in "
            "tokenizer.chat_template, so return_assistant_tokens_mask marks the answers")


def _truncation_cause(tokenizer: Any, rows: list[dict]) -> tuple[str, str] | str:
    """(cause, fix) when the rows are their conversations cut at one length and the cut leaves
    no answer a token: each conversation tokenized again without truncation, its first answer's
    position (the prompt rendered with the generation prompt) against the row's length. Else
    what the test found, or why it could not run, in words."""
    left = ("so truncation was not tested: tokenize one conversation again without truncation "
            "and compare where its first answer starts with max_length")
    chats = [r for r in rows if isinstance(r.get("messages"), list) and "input_ids" in r]
    if not chats:
        return _cut_rows(tokenizer, rows) or f"the rows keep no 'messages' column, {left}"
    kept, prompts, cut, lengths = 0, [], 0, []
    for row in chats:
        ids, messages = list(row["input_ids"]), row["messages"]
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
        if first is None:
            continue
        full = rendered(tokenizer, messages)["input_ids"]
        if full[:len(ids)] != ids:  # not the template's rendering: nothing to compare
            continue
        prompt = len(rendered(tokenizer, messages[:first], add_generation_prompt=True)
                     ["input_ids"])
        prompts.append(prompt)
        lengths.append(len(ids))
        cut += len(full) > len(ids)
        kept += prompt < len(ids)
    if not prompts:
        return f"the rows are not the chat template's rendering of their messages, {left}"
    if not cut or kept:
        return (f"not truncation: tokenized again without it, {len(prompts) - cut} of "
                f"{len(prompts)} rows are whole and {kept} answers start inside their rows")
    return (f"truncation at max_length={max(lengths)} leaves 0 of {len(prompts)} answers a "
            f"token: the shortest prompt is {min(prompts)} tokens (each conversation tokenized "
            "again without truncation)",
            f"raise max_length above {max(prompts)} (the longest prompt) or shorten the system "
            "prompt, so every answer keeps its tokens")


def _cut_rows(tokenizer: Any, rows: list[dict]) -> tuple[str, str] | None:
    """(cause, fix) when rows whose conversations are not kept were all cut at one length:
    every row exactly that long, none ending with the end token (or padding)."""
    ids = [list(r["input_ids"]) for r in rows if len(r.get("input_ids") or ()) > 0]
    ends = {getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)}
    if not ids or len({len(i) for i in ids}) != 1 or any(i[-1] in ends for i in ids):
        return None
    length = len(ids[0])
    return (f"truncation at max_length={length} cut every row: all {len(ids)} rows are exactly "
            f"{length} tokens and none ends with the end token {tokenizer.eos_token!r}, so no "
            "answer token survived the cut (the rows keep no 'messages', so the prompts were "
            "not measured)",
            f"raise max_length above {length} or shorten the system prompt; tokenize one "
            "conversation without truncation to see where its first answer starts")


def no_targets(empty: dict[str, tuple[int, int]], data: dict[str, Any],
               tokenizer: Any) -> WorkbookError:
    """The refusal for splits whose every row has labels -100 (`empty`: per split, (rows
    without a target, rows read)), naming the causes the experiments confirmed; otherwise
    what they found and the experiment left."""
    names = {"train": "train", "validation": "eval", "test": "test"}
    said = " and ".join(f"{n} of {total} {names[s]} rows" for s, (n, total) in empty.items())
    where = {1: f"the {names[next(iter(empty))]} dataset", 2: "both splits"}.get(
        len(empty), "every split")
    found = f"from_hf: every row of {where} has no target (labels all -100): {said}"
    template = getattr(tokenizer, "chat_template", None)
    if not template:  # no conversations to render: nothing to test
        tried = []
    else:
        rows = [r for s in empty for r in _rows(data[s])]
        tried = [_template_cause(tokenizer, rows) or "not the chat template: it marks the "
                 "answers ({% generation %})", _truncation_cause(tokenizer, rows)]
    causes = [c for c in tried if isinstance(c, tuple)]
    if causes:
        return WorkbookError(f"{found}; " + "; and ".join(c for c, _ in causes),
                             "; and ".join(f for _, f in causes))
    return WorkbookError(
        "; ".join([found, *tried]),
        ("pass the eval dataset with its labelled rows, or " if set(empty) == {"validation"}
         else "") + "print one row's labels beside its tokens and find the step that set them "
        "all to -100 (the mask your labels are built from)")
