"""Notebook 01's one pass over the task's source - the whole of it, a declared prefix or a seeded
sample - gathering every statistic as the examples stream by. Memory grows with the data only
by the hash indexes (9 bytes per example id, per distinct input and per group); the first
`keep` examples of each split are kept whole for the views and the probes, and figures are
histograms and running sums, exact over everything scanned."""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..base.errors import WorkbookError
from ..base.frontend import progress_bar
from ..contract.data import Item, collate_items, encode_example
from ..contract.hash_index import HashIndex, key_of
from ..contract.sources import SPLITS, Checks, length, opened, split_of
from ..contract.targets import IGNORE_INDEX, contributes
from ..contract.task import Task
from .coverage import batch_coverage, prompt_spans

KEEP = 4096  # examples of each split kept whole: the samples' splits fit, so they see them all
CHUNK = 64  # examples collated at a time
FINDINGS = 5  # example ids kept per finding (its count covers every example)
WAITING = 65_536  # label ranges held for the probe at most (then it runs on what is kept)
BITS = {name: 1 << i for i, name in enumerate(SPLITS)}


@dataclass
class Finding:
    """How many examples showed something, how much of it, and the first few ids."""

    examples: int = 0
    amount: float = 0
    ids: list[Any] = field(default_factory=list)

    def add(self, example_id: Any, amount: float = 1) -> None:
        self.examples += 1
        self.amount += amount
        if len(self.ids) < FINDINGS:
            self.ids.append(example_id)


@dataclass
class Moments:
    """Count, mean, spread and range of float targets, merged a chunk at a time."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, values: torch.Tensor) -> None:
        v = values.double()
        if not v.numel():
            return
        n, mean = v.numel(), float(v.mean())
        delta, total = mean - self.mean, self.n + v.numel()
        self.m2 += float(((v - mean) ** 2).sum()) + delta**2 * self.n * n / total
        self.mean += delta * n / total
        self.n, self.low, self.high = total, min(self.low, float(v.min())), \
            max(self.high, float(v.max()))

    def row(self) -> dict:
        if self.n < 2:
            return {"targets": self.n}
        return {"targets": self.n, "mean": self.mean, "std": math.sqrt(self.m2 / (self.n - 1)),
                "min": self.low, "max": self.high}


@dataclass
class Scan:
    """What one pass found: the kept examples, and the statistics of every example scanned."""

    task: Task
    scanned: str  # "the whole source", "the first N examples", "a seeded sample of ..."
    kept_raw: dict[str, list[dict]] = field(default_factory=lambda: {n: [] for n in SPLITS})
    kept: dict[str, list[Item]] = field(default_factory=lambda: {n: [] for n in SPLITS})
    examples: Counter = field(default_factory=Counter)
    targets_hist: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    positions: int = 0
    targets: int = 0
    zero: Finding = field(default_factory=Finding)
    on_padding: Finding = field(default_factory=Finding)
    on_prompt: Finding = field(default_factory=Finding)
    unchecked_prompts: Counter = field(default_factory=Counter)
    prompt_examples: int = 0
    classes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    mismatched: Finding = field(default_factory=Finding)
    first_mismatch: tuple = ()
    out_of_range: Finding = field(default_factory=Finding)
    label_range: list[tuple[Any, int, int]] = field(default_factory=list)  # until outputs known
    outputs: int | None = None
    probed: bool = False  # the model's output size was asked for (None: it could not be told)
    moments: dict[str, Moments] = field(default_factory=lambda: defaultdict(Moments))
    train_square: Moments = field(default_factory=Moments)
    nonfinite: Finding = field(default_factory=Finding)
    crossing_groups: list[str] = field(default_factory=list)
    crossing_inputs: list[list[str]] = field(default_factory=list)
    groups: HashIndex | None = None
    inputs: HashIndex | None = None

    def note_outputs(self, outputs: int | None) -> None:
        """The model's output size, once known: the label ids held until then are checked."""
        self.outputs, self.probed = outputs, True
        for example_id, low, high in self.label_range:
            self._check_range(example_id, low, high)
        self.label_range = []

    def _check_range(self, example_id: Any, low: int, high: int) -> None:
        if self.outputs is not None and (low < 0 or high >= self.outputs):
            self.out_of_range.add(example_id)


def scan(task: Task, limit: int = 0, sample: float = 0.0, seed: int = 0,
         keep: int | None = None, probe: Any = None, progress: bool = False) -> Scan:
    """One pass: every example checked, split, encoded and counted; `limit` stops after that
    many examples, `sample` keeps each with that probability (seeded). `probe(kept)` returns
    the model's output size once the train split's kept examples are in (or the
    stream ended), so label ids are checked against it without a second pass."""
    if sample and not 0 < sample <= 1 or limit < 0:
        raise WorkbookError(f"scan_limit={limit}, scan_sample={sample}: the limit is a count of "
                            "examples (0: all) and the sample a share in (0, 1] (0: every one)",
                            "give scan_limit >= 0 and 0 <= scan_sample <= 1")
    said = "the whole source" if not limit and not sample else \
        (f"a seeded sample of {sample:.0%}" if sample else "") + \
        (" of " if sample and limit else "") + (f"the first {limit:,} examples" if limit else "")
    keep = KEEP if keep is None else keep
    result = Scan(task, said)
    result.groups = HashIndex(lambda group, prior, bit: _crossing(result.crossing_groups, group,
                                                                  prior, bit))
    result.inputs = HashIndex(lambda where, prior, bit: _crossing(result.crossing_inputs, where,
                                                                  prior, bit))
    checks, pending = Checks(task), {n: [] for n in SPLITS}
    source, origin = opened(task)
    total = length(origin)
    draw = random.Random(seed)
    bar = progress_bar(total=min(limit, total) if limit and total else limit or total,
                       desc="scanned", unit="examples", disable=not progress)
    probed, seen = False, 0
    try:
        for position, example in enumerate(source):
            if limit and position >= limit:
                break
            seen += 1
            bar.update(1)
            if (sample and draw.random() >= sample) or not checks.ok(position, example):
                continue
            name = split_of(task, example)
            item = encode_example(task, example)
            result.examples[name] += 1
            result.groups.add(key_of(str(example[task.group_key])), BITS[name],
                              str(example[task.group_key]))
            if len(result.kept[name]) < keep:
                result.kept[name].append(item)
                result.kept_raw[name].append(example)
            pending[name].append(item)
            if len(pending[name]) == CHUNK:
                _count(result, name, pending[name])
                pending[name] = []
            # the probe, once the kept train examples are in - or earlier, with those there
            # are, before the label ids waiting for it pile up (train late in the stream)
            if not probed and probe is not None and result.kept["train"] and (
                    len(result.kept["train"]) >= keep or len(result.label_range) > WAITING):
                result.note_outputs(probe(result.kept))
                probed = True
    finally:
        bar.close()
    if sample and seen and not checks.read:
        raise WorkbookError(f"scan_sample={sample} drew none of the {seen} examples read",
                            "raise scan_sample, or give scan_limit instead")
    checks.raise_any()
    for name in SPLITS:
        _count(result, name, pending[name])
    if not probed and probe is not None:
        result.note_outputs(probe(result.kept))
    result.probed = True
    result.groups.flush()
    result.inputs.flush()
    for name in ("train", "validation"):
        if not result.examples[name]:
            raise WorkbookError(
                f"the {name} split of task {task.name!r} is empty in {result.scanned} "
                f"({sum(result.examples.values())} examples scanned)",
                "add examples or groups, or change split_fractions" +
                (", or scan more of the source (scan_limit, scan_sample)"
                 if limit or sample else ""))
    return result


def _crossing(found: list, what: Any, prior: int, bit: int) -> None:
    if prior & ~bit and len(found) < FINDINGS and what not in found:
        found.append(what)


def _count(result: Scan, name: str, items: list[Item]) -> None:
    """Fold one chunk of a split into the statistics (then the chunk can go)."""
    if not items:
        return
    task, kind = result.task, result.task.target_kind
    spans = prompt_spans(task, items)
    if spans is not None:
        result.prompt_examples += len(spans)
        result.unchecked_prompts.update(s for s in spans if isinstance(s, str))
    for row in batch_coverage(task, items, collate_items(task, items).tensors, spans):
        result.targets_hist[name][row["targets"]] += 1
        result.positions += row["positions"]
        result.targets += row["targets"]
        if row["targets"] == 0:
            result.zero.add(row["example"])
        if row["on_padding"]:
            result.on_padding.add(row["example"], row["on_padding"])
        if row["on_prompt"]:
            result.on_prompt.add(row["example"], row["on_prompt"])
    labels = [it.tensors["labels"].reshape(-1) for it in items]
    for it in items:
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
               for t in it.tensors.values()):
            result.nonfinite.add(it.id)
        key = b"".join(_key_bytes(k, it.tensors[k]) for k in task.model_inputs
                       if k in it.tensors)
        result.inputs.add(key_of(key), BITS[name], (name, it.id))
    if kind.float_targets:
        values = torch.cat(labels).float()
        values = values[contributes(values)]
        result.moments[name].add(values)
        if name == "train":
            result.train_square.add(values**2)
        return
    for it, (low, high) in zip(items, _label_ranges(labels), strict=True):
        if low is None:
            continue
        if result.outputs is None and not result.probed:
            result.label_range.append((it.id, low, high))
        else:
            result._check_range(it.id, low, high)
    if kind.named_classes:
        for it, ids in zip(items, labels, strict=True):
            names = kind.names_of(task, ids[ids != IGNORE_INDEX].tolist())
            raw = kind.raw_names(task, it.raw)
            result.classes[name].update(names)
            if not kind.round_trip(names, raw):
                result.mismatched.add(it.id)
                if not result.first_mismatch:
                    result.first_mismatch = next(
                        ((r, n) for r, n in zip(raw, names, strict=False) if r != n),
                        (" ".join(raw), " ".join(names)))


def _label_ranges(labels: list[torch.Tensor]) -> list[tuple[int | None, int | None]]:
    """The lowest and highest label id of each example other than -100 (None: it has none),
    for a chunk at once."""
    flat = torch.cat(labels).long()
    owner = torch.repeat_interleave(torch.arange(len(labels)),
                                    torch.tensor([len(x) for x in labels]))
    real = flat != IGNORE_INDEX
    flat, owner = flat[real], owner[real]
    count = torch.zeros(len(labels), dtype=torch.long).index_add_(0, owner, torch.ones_like(owner))
    big = torch.iinfo(torch.long).max
    low = torch.full((len(labels),), big).scatter_reduce(0, owner, flat, "amin")
    high = torch.full((len(labels),), -big).scatter_reduce(0, owner, flat, "amax")
    return [(lo, hi) if c else (None, None)
            for lo, hi, c in zip(low.tolist(), high.tolist(), count.tolist(), strict=True)]


def _key_bytes(name: str, tensor: torch.Tensor) -> bytes:
    """One model input as bytes that differ whenever its values, dtype or shape do."""
    t = tensor.detach().contiguous().cpu()
    head = f"{name}|{t.dtype}|{tuple(t.shape)}|".encode()
    return head + t.reshape(-1).view(torch.uint8).numpy().tobytes()


def coverage_table(result: Scan) -> pd.DataFrame:
    """How many examples of each split contribute how many targets (the histogram's data)."""
    rows = [{"split": name, "targets": t, "examples": n}
            for name in SPLITS for t, n in sorted(result.targets_hist[name].items())]
    return pd.DataFrame(rows, columns=["split", "targets", "examples"])

