"""Notebook 01's audits of the data itself, over one streaming pass (`scan.Scan`): labels per
split (histogram, name round trip, ids the model cannot output), regression targets, groups and
inputs across splits, NaN values."""

from __future__ import annotations

import pandas as pd

from ..contract.sources import SPLITS
from ..storage.records import Flag
from .scan_tally import BITS, Scan


def label_audit(result: Scan, source: str = "") -> tuple[pd.DataFrame | None, list[Flag]]:
    """The class histogram per split, the id <-> name round trip and ids the model cannot
    output, over every example scanned; regression: the targets' count, mean, spread and range
    per split (a split whose targets differ is a leak or a drift)."""
    task, kind = result.task, result.task.target_kind
    if kind.float_targets:
        table = pd.DataFrame({name: result.moments[name].row() for name in SPLITS}).round(4)
        table.index.name = "statistic"
        return table, []
    flags = []
    bad, wrong = result.out_of_range, result.mismatched
    if bad.examples:
        flags.append(Flag("label ids out of range", f"{bad.examples} examples have label ids "
                          f"outside 0..{result.outputs - 1}, which the model cannot output"
                          + (f" ({source})" if source else ""),
                          bad.examples, "fix the label map or the model's output size",
                          list(bad.ids)))
    if wrong.examples:
        first = result.first_mismatch
        flags.append(Flag("label map round trip", f"{wrong.examples} examples decode to another "
                          f"class than their raw label (e.g. {first[0]!r} -> {first[1]!r}): the "
                          "map is shifted or wrong", wrong.examples,
                          "make encode and decode use the same class name <-> id map",
                          list(wrong.ids)))
    if not kind.named_classes:
        return None, flags
    table = pd.DataFrame(result.classes).reindex(columns=list(SPLITS)).fillna(0).astype(int)
    table.index.name = "class"
    order = [n for n in (task.label_names or []) if n in table.index]
    table = table.reindex(order + [n for n in table.index if n not in order])
    return table, flags


def split_audit(result: Scan) -> tuple[pd.DataFrame, list[Flag]]:
    """Per split: examples and groups; flags for a group or an identical input in two splits
    (counted over every example by their hashes, the first few named)."""
    task = result.task
    table = pd.DataFrame([{"split": name, "examples": result.examples[name],
                           "groups": result.groups.count(BITS[name])} for name in SPLITS])
    table["share"] = (table.examples / max(table.examples.sum(), 1)).round(3)
    flags = []
    crossing = result.groups.count(crossing=True)
    if crossing:
        flags.append(Flag("group crosses splits", f"{crossing} groups of {task.group_key!r} "
                          "appear in more than one split: validation leaks training data",
                          crossing, "split by the group key (the default rule), not by example",
                          sorted(result.crossing_groups)))
    dupes = result.inputs.count(crossing=True)
    if dupes:
        # an adapter that knows why (from_hf: the tokenizer's truncation made them identical)
        why = getattr(task, "duplicates_cause", None)
        cause = why() if callable(why) else None
        flags.append(Flag("duplicate input crosses splits", f"{dupes} identical inputs sit in "
                          "two splits" + (f": {cause[0]}" if cause else ""), dupes,
                          cause[1] if cause else
                          "remove duplicates before splitting or give them one group",
                          [str(w) for w in result.crossing_inputs]))
    return table, flags


def nonfinite_audit(result: Scan) -> list[Flag]:
    """NaN or infinity in any floating-point tensor of an example (inputs or targets): every
    later number - the loss, the gradients, the probes - would be meaningless."""
    bad = result.nonfinite
    if not bad.examples:
        return []
    return [Flag("non-finite inputs", f"{bad.examples} examples hold NaN or infinite values",
                 bad.examples, "clean or impute them in load_examples/encode (the loss and "
                 "padding probes were skipped: they cannot judge non-finite inputs)",
                 list(bad.ids))]
