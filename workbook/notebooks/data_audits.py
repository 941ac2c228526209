"""Notebook 01's audits of the data itself: labels per split (histogram, name round trip, ids
the model cannot output), regression targets, groups and inputs across splits, NaN values."""

from __future__ import annotations

from collections import Counter, defaultdict

import pandas as pd
import torch

from ..contract.data import SPLITS, Item
from ..contract.targets import IGNORE_INDEX
from ..contract.task import Task
from ..storage.records import Flag


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
