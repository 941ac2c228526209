"""Notebook 01's audits of the data itself, over one streaming pass (`scan.Scan`): labels per
split (histogram, name round trip, ids the model cannot output), the class maps the task's own
objects carry (per split, the model's), regression targets, groups and inputs across splits,
NaN values."""

from __future__ import annotations

import pandas as pd

from ...contract import class_maps
from ...contract.sources import SPLITS
from ...storage.records import Flag
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


SPLIT_WORDS = {"train": "training", "validation": "validation", "test": "test"}


def class_map_audit(task, model) -> list[Flag]:
    """Every class map the task's own objects carry numbers the same class the same: each
    split's dataset (`task.class_maps`: ImageFolder's class_to_idx per split), `label_names`
    and the model's own (`id2label`, `label_names`), against the training split's (else
    `label_names`). Maps without a class name in common are not compared (a config's own
    names for the same ids); a class missing from one map is no finding by itself - a shift of
    the classes after it is."""
    if not task.target_kind.named_classes:
        return []
    given = dict(task.class_maps or {})
    names = class_maps.ClassMap({n: i for i, n in enumerate(task.label_names or [])},
                                "label_names")
    reference = ("training", given.pop("train")) if "train" in given else ("label_names",
                                                                           names)
    others = [(SPLIT_WORDS.get(split, split), m if isinstance(m, class_maps.ClassMap) else
               class_maps.ClassMap(m, f"the {split} split")) for split, m in given.items()]
    models = class_maps.of_model(model)
    # label_names an adapter took from the model's id2label (from_hf) is said once, as id2label
    if reference[0] != "label_names" and names and all(dict(m) != names for _, m in models):
        others.append(("label_names", names))
    return [flag for what, other in others + models
            if (flag := _map_differs(what, other, *reference))]


def _map_differs(what: str, other: dict, ref_what: str, ref: dict) -> Flag | None:
    """A flag when `other` numbers a class of `ref` with another id, naming the first such
    class and the classes `other` lacks (the gap every later class shifted into)."""
    shifted = sorted((ref[n], n, i) for n, i in other.items() if n in ref and ref[n] != i)
    if not shifted:
        return None
    _, name, oid = shifted[0]
    where, folders = getattr(other, "where", what), getattr(other, "folders", False)
    lacks = sorted((n for n in ref if n not in other), key=ref.get)
    more = f"; {len(shifted) - 1} more classes numbered differently" if len(shifted) > 1 \
        else ""
    if lacks:
        cause = (f"{where} has no {', '.join(map(repr, lacks[:3]))} "
                 f"{'folder' if folders else 'class'}{'s' if len(lacks) > 1 else ''}, so every "
                 "class after it shifted")
    else:
        cause = f"{where} numbers its classes in another order"
    split_words = what in SPLIT_WORDS.values() and ref_what in SPLIT_WORDS.values()
    fix = ("build every split's dataset with one class_to_idx: give each split the same class "
           "folders (torchvision's ImageFolder(..., allow_empty=True) takes an empty one) or "
           "number the other splits by the training split's class_to_idx (override "
           "find_classes)") if folders else \
        ("number every split by one class map: build the label ids of every split from the "
         "training split's class names") if split_words else \
        ("pass label_names in the training split's id order (label_names="
         "train_dataset.classes)") if what == "label_names" else \
        (f"make {what} name the classes as {ref_what} numbers them (e.g. id2label = "
         "dict(enumerate(train_dataset.classes)), label2id its inverse)")
    return Flag("class map differs between splits" if split_words else "class map differs",
                f"{what} numbers {name!r} {oid} where {ref_what} numbers it {ref[name]} "
                f"({cause}{more}): labels name the wrong classes - the loss computes and "
                "the wrong task is learned", len(shifted), fix, [n for _, n, _ in shifted])


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
        why = task.framework.duplicates_cause
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
