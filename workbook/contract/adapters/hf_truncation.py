"""Why identical inputs sit in two splits of a `from_hf` task when the tokenizer made them so:
rows cut at the tokenizer's `max_length` whose raw texts differ but whose encoded inputs do not.
Read only when 01 finds such duplicates (`Task.framework.duplicates_cause`), over map-style
splits."""

from __future__ import annotations

from typing import Any, Callable

ROWS_READ = 200_000  # rows read per split at most


def _rows(data: Any) -> list[dict]:
    try:
        n = min(len(data), ROWS_READ)
        return [data[i] for i in range(n)]
    except TypeError:
        return []


def _text_column(row: dict, tokenizer: Any, cap: int) -> str | None:
    """The string column the row's input_ids were tokenized from (cut at `cap`)."""
    for name, value in row.items():
        if not isinstance(value, str):
            continue
        try:
            ids = tokenizer(value, truncation=True, max_length=cap)["input_ids"]
        except Exception:  # a tokenizer that refuses the column: not the source
            continue
        if list(ids) == list(row["input_ids"]):
            return name
    return None


def truncation_cause(data: dict[str, Any], tokenizer: Any) -> Callable[[], tuple | None]:
    """A function that says (cause, fix) when inputs in two splits are identical only after
    the tokenizer cut them at max_length, else None."""

    def cause() -> tuple[str, str] | None:
        rows = {split: _rows(d) for split, d in data.items() if d is not None}
        every = [r for part in rows.values() for r in part if "input_ids" in r]
        if not every:
            return None
        cap = max(len(r["input_ids"]) for r in every)
        at_cap = [r for r in every if len(r["input_ids"]) == cap]
        column = _text_column(at_cap[0], tokenizer, cap)
        if column is None:
            return None
        cut = [r for r in at_cap if len(tokenizer(r[column])["input_ids"]) > cap]
        seen: dict[tuple, tuple[set, set]] = {}
        for split, part in rows.items():
            for r in part:
                if len(r.get("input_ids", ())) == cap:
                    splits, texts = seen.setdefault(tuple(r["input_ids"]), (set(), set()))
                    splits.add(split)
                    texts.add(r[column])
        made = sum(1 for splits, texts in seen.values() if len(splits) > 1 and len(texts) > 1)
        if not cut or not made:
            return None
        return (f"made so by the tokenizer's truncation: max_length {cap} cuts {len(cut)} of "
                f"{len(every)} examples ({column!r} tokenized in full is longer), and {made} "
                f"input{'s' if made > 1 else ''} in two splits {'are' if made > 1 else 'is'} "
                "identical only after the cut (the raw texts differ)",
                f"raise max_length (tokenizer(..., truncation=True, max_length=N)) so the "
                f"inputs keep what tells them apart; {cap} tokens is what the model sees of "
                f"{len(cut)} examples")

    return cause
