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

import numpy as np
import pandas as pd
import torch

from ..base.errors import WorkbookError
from ..base.frontend import progress_bar
from ..contract.data import Item, collate_items, encode_example
from ..contract.hash_index import HashIndex, keys_of
from ..contract.sources import SPLITS, Checks, length, opened, split_of
from ..contract.targets import IGNORE_INDEX, contributes
from ..contract.task import Task
from .coverage import batch_coverage, prompt_spans

KEEP = 4096  # examples of each split kept whole: the samples' splits fit, so they see them all
CHUNK = 64  # examples collated at a time
AUDITED = 1024  # examples audited at a time (`_audit`)
FINDINGS = 5  # example ids kept per finding (its count covers every example)
WAITING = 65_536  # label ranges held for the probe at most (then it runs on what is kept)
SPLITS_KEPT = 4096  # groups whose split is remembered (the default rule; cleared when full)
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
    queued: list[tuple[str, list[Item], bool]] = field(default_factory=list)  # for `_audit`
    queued_examples: int = 0

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
    # the default rule reads the group key alone: a group's split is remembered, not rehashed
    by_group = task.split_of is None and type(task).split is Task.split
    split_by: dict[str, str] = {}
    groups = _Groups(result.groups)
    ok, group_key, kept, counted = checks.ok, task.group_key, result.kept, result.examples
    probed, seen, shown = probe is None, 0, 0
    try:
        for position, example in enumerate(source):
            if limit and position >= limit:
                break
            seen += 1
            if not seen & 1023:
                bar.update(seen - shown)
                shown = seen
            if (sample and draw.random() >= sample) or not ok(position, example):
                continue
            group = str(example[group_key])
            name = split_by.get(group) if by_group else None
            if name is None:
                name = split_of(task, example)
                if by_group:
                    if len(split_by) >= SPLITS_KEPT:
                        split_by.clear()
                    split_by[group] = name
            item = encode_example(task, example)
            counted[name] += 1
            groups.add(group, name)
            if len(kept[name]) < keep:
                kept[name].append(item)
                result.kept_raw[name].append(example)
            chunk = pending[name]
            chunk.append(item)
            if len(chunk) == CHUNK:
                _count(result, name, chunk)
                pending[name] = []
            # the probe, once the kept train examples are in - or earlier, with those there
            # are, before the label ids waiting for it pile up (train late in the stream)
            if not probed and kept["train"] and (
                    len(kept["train"]) >= keep or len(result.label_range) > WAITING):
                result.note_outputs(probe(kept))
                probed = True
    finally:
        bar.update(seen - shown)
        bar.close()
    if sample and seen and not checks.read:
        raise WorkbookError(f"scan_sample={sample} drew none of the {seen} examples read",
                            "raise scan_sample, or give scan_limit instead")
    checks.raise_any()
    for name in SPLITS:
        _count(result, name, pending[name])
    if not probed:
        result.note_outputs(probe(result.kept))
    result.probed = True
    _audit(result)
    groups.flush()
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


class _Groups:
    """The (group, split) of each example for the group index, a run of rows of one group in
    one split once (a repeat in its own split changes nothing), hashed a block at a time."""

    def __init__(self, index: HashIndex):
        self.index, self.names, self.bits = index, [], []
        self.last: tuple[str, str] | None = None

    def add(self, group: str, name: str) -> None:
        if self.last is None or group != self.last[0] or name != self.last[1]:
            self.last = (group, name)
            self.names.append(group)
            self.bits.append(BITS[name])
            if len(self.names) >= 4096:
                self.flush()

    def flush(self) -> None:
        self.index.add_many(keys_of(self.names), np.array(self.bits, np.uint8), self.names)
        self.names, self.bits = [], []


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
    positions, targets, padding, prompt = batch_coverage(
        task, items, collate_items(task, items).tensors, spans)
    result.targets_hist[name].update(targets)
    result.positions += sum(positions)
    result.targets += sum(targets)
    for finding, amounts in ((result.zero, None if 0 not in targets else
                              [int(t == 0) for t in targets]),
                             (result.on_padding, padding), (result.on_prompt, prompt)):
        if amounts is not None and any(amounts):
            for it, amount in zip(items, amounts, strict=True):
                if amount:
                    finding.add(it.id, 1 if finding is result.zero else amount)
    result.queued.append((name, items, result.probed))
    result.queued_examples += len(items)
    if result.queued_examples >= AUDITED:
        _audit(result)
    if not (kind.float_targets or kind.named_classes or not result.probed):
        return
    flat, sizes, _ = _flat([it.tensors["labels"] for it in items])
    if kind.float_targets:
        values = flat.float()
        values = values[contributes(values)]
        result.moments[name].add(values)
        if name == "train":
            result.train_square.add(values**2)
        return
    if not result.probed:  # held until the model's output size is known
        for it, (low, high) in zip(items, _label_ranges(flat, sizes), strict=True):
            if low is not None:
                result.label_range.append((it.id, low, high))
    if kind.named_classes:
        for it, ids in zip(items, flat.split(sizes), strict=True):
            names = kind.names_of(task, ids[ids != IGNORE_INDEX].tolist())
            raw = kind.raw_names(task, it.raw)
            result.classes[name].update(names)
            if not kind.round_trip(names, raw):
                result.mismatched.add(it.id)
                if not result.first_mismatch:
                    result.first_mismatch = next(
                        ((r, n) for r, n in zip(raw, names, strict=False) if r != n),
                        (" ".join(raw), " ".join(names)))


def _audit(result: Scan) -> None:
    """The checks of each example that do not need its batch - NaN values, identical inputs,
    label ids the model cannot output - over the chunks counted since the last time, in their
    order, at once."""
    if not result.queued:
        return
    task, queued = result.task, result.queued
    result.queued, result.queued_examples = [], 0
    items = [it for _, chunk, _ in queued for it in chunk]
    if any(d.is_floating_point for d in {t.dtype for it in items for t in it.tensors.values()}):
        for it in items:
            if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                   for t in it.tensors.values()):
                result.nonfinite.add(it.id)
    bits = np.concatenate([np.full(len(chunk), BITS[name], np.uint8)
                           for name, chunk, _ in queued])
    result.inputs.add_many(_input_keys(task, items), bits,
                           [(name, it.id) for name, chunk, _ in queued for it in chunk])
    if task.target_kind.float_targets or result.outputs is None:
        return
    late = [it for _, chunk, after_probe in queued if after_probe for it in chunk]
    if not late:  # the others' label ids were held for the probe
        return
    flat, sizes, _ = _flat([it.tensors["labels"] for it in late])
    ids = flat.long()
    bad = (ids != IGNORE_INDEX) & ((ids < 0) | (ids >= result.outputs))
    if bool(bad.any()):
        owner = torch.repeat_interleave(torch.arange(len(late)), torch.tensor(sizes))
        for i in torch.unique(owner[bad]).tolist():
            result.out_of_range.add(late[i].id)


def _flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int], set[int]]:
    """Tensors of a chunk as one flat tensor, how many values each gave, and their dims."""
    sizes = [t.numel() for t in tensors]
    dims = {t.dim() for t in tensors}
    if dims == {1}:
        return torch.cat(tensors), sizes, dims
    if dims == {0}:
        return torch.stack(tensors), sizes, dims
    return torch.cat([t.reshape(-1) for t in tensors]), sizes, dims


def _label_ranges(flat: torch.Tensor, sizes: list[int]) -> list[tuple[int | None, int | None]]:
    """The lowest and highest label id of each example other than -100 (None: it has none),
    for a chunk at once."""
    flat = flat.long()
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    real = flat != IGNORE_INDEX
    flat, owner = flat[real], owner[real]
    count = torch.zeros(len(sizes), dtype=torch.long).index_add_(0, owner, torch.ones_like(owner))
    big = torch.iinfo(torch.long).max
    low = torch.full((len(sizes),), big).scatter_reduce(0, owner, flat, "amin")
    high = torch.full((len(sizes),), -big).scatter_reduce(0, owner, flat, "amax")
    return [(lo, hi) if c else (None, None)
            for lo, hi, c in zip(low.tolist(), high.tolist(), count.tolist(), strict=True)]


def _input_keys(task: Task, items: list[Item]) -> np.ndarray:
    """One 64-bit key per example of a chunk, from the name, dtype, shape and values of each of
    its model inputs: equal for identical inputs, different otherwise but for a collision
    (about n^2 / 2^65) - each value mixed with its position and summed, a chunk at once."""
    keys = np.zeros(len(items), np.uint64)
    for slot, name in enumerate(task.model_inputs, start=1):
        tensors = [it.tensors.get(name) for it in items]
        where = [i for i, t in enumerate(tensors) if t is not None]
        if not where:
            continue
        present = [tensors[i] for i in where] if len(where) < len(items) else tensors
        section = _section_keys(present) ^ _mix(np.array([slot], np.uint64) * _ODD)
        keys[where] = _mix(keys[where] * _ODD + section)
    return keys


def _section_keys(tensors: list[torch.Tensor]) -> np.ndarray:
    """Per tensor, a key of its dtype, shape and values (their bytes: -0.0 is not 0.0) that
    does not depend on the other tensors of the chunk."""
    dtypes = [t.dtype for t in tensors]
    kinds = set(dtypes)
    if len(kinds) == 1:
        return _dtype_keys(tensors, dtypes[0])
    keys = np.empty(len(tensors), np.uint64)
    for kind in kinds:
        where = [i for i, d in enumerate(dtypes) if d == kind]
        keys[where] = _dtype_keys([tensors[i] for i in where], kind)
    return keys


def _dtype_keys(tensors: list[torch.Tensor], dtype: torch.dtype) -> np.ndarray:
    """`_section_keys` of tensors of one dtype: its values as integers of its width."""
    flat, sizes, dims = _flat(tensors)
    flat = flat.detach().cpu()
    width = dtype.itemsize
    words = flat.view(_AS_INT[width]).long() if width in _AS_INT else \
        flat.contiguous().view(torch.int64)  # 16-byte complex: two words a value
    values = words.numpy().view(np.uint64)
    shapes = np.asarray(sizes, np.uint64) if dims == {1} else np.fromiter(
        (t.numel() if t.dim() == 1 else hash(t.shape) for t in tensors), np.int64,
        len(tensors)).view(np.uint64)  # a 1-d shape is its length
    heads = _mix(shapes ^ np.uint64(hash(dtype) & 0xFFFF_FFFF_FFFF_FFFF))
    counts = [n * max(width // 8, 1) for n in sizes]
    ends = np.cumsum(counts)
    starts = ends - np.asarray(counts, np.int64)
    at = np.arange(len(values)) - np.repeat(starts, counts)
    mixed = np.cumsum(_mix(values ^ _positions(len(values))[at]))
    mixed = np.concatenate([np.zeros(1, np.uint64), mixed])
    return _mix(heads + mixed[ends] - mixed[starts])


_ODD = np.uint64(0x9E3779B97F4A7C15)
_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_POSITIONS = np.empty(0, np.uint64)


def _positions(n: int) -> np.ndarray:
    """A fixed random-looking word per position (at least n of them)."""
    global _POSITIONS
    if len(_POSITIONS) < n:
        _POSITIONS = _mix(np.arange(max(n, 2 * len(_POSITIONS)), dtype=np.uint64) * _ODD + _ODD)
    return _POSITIONS


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit changes about half the output bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def coverage_table(result: Scan) -> pd.DataFrame:
    """How many examples of each split contribute how many targets (the histogram's data)."""
    rows = [{"split": name, "targets": t, "examples": n}
            for name in SPLITS for t, n in sorted(result.targets_hist[name].items())]
    return pd.DataFrame(rows, columns=["split", "targets", "examples"])

