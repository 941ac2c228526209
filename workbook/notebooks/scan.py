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
# a source without a length is scanned this far at most when no scan_limit is given: an endless
# stream stops here, and the page says so
UNSIZED_MOST = 10_000_000
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
    queued: list[tuple[int, list, list]] = field(default_factory=list)  # for `_audit`
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
    # a run of one group's rows in one split is indexed once (a repeat in its own split
    # changes nothing), a block of groups hashed at once
    groups: list[str] = []
    bits: list[int] = []
    last = ("", "")
    ok, group_key, kept, counted = checks.ok, task.group_key, result.kept, result.examples
    probed, seen, shown = probe is None, 0, 0
    cap = limit or (UNSIZED_MOST if total is None else 0)
    try:
        for position, example in enumerate(source):
            if cap and position >= cap:
                if not limit:
                    result.scanned = (f"the first {cap:,} examples (the source has no length "
                                      "and had not ended there: scan_limit scans more or "
                                      "fewer)")
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
            if group != last[0] or name != last[1]:
                last = (group, name)
                groups.append(group)
                bits.append(BITS[name])
                if len(groups) >= 4096:
                    _index(result.groups, groups, bits)
                    groups, bits = [], []
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
    _index(result.groups, groups, bits)
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


def _index(index: HashIndex, names: list[str], bits: list[int]) -> None:
    index.add_many(keys_of(names), np.array(bits, np.uint8), names)


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
    if any(d.is_floating_point for d in {t.dtype for it in items for t in it.tensors.values()}):
        for it in items:
            if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                   for t in it.tensors.values()):
                result.nonfinite.add(it.id)
    result.queued.append((BITS[name], [it.id for it in items], _digest(task, items)))
    result.queued_examples += len(items)
    if result.queued_examples >= AUDITED:
        _audit(result)
    labels = [it.tensors["labels"] for it in items]
    flat = _flat(labels)[0]
    if kind.float_targets:
        values = flat.float()
        values = values[contributes(values)]
        result.moments[name].add(values)
        if name == "train":
            result.train_square.add(values**2)
        return
    sizes = [] if result.probed and not kind.named_classes else [t.numel() for t in labels]
    if not result.probed:  # held until the model's output size is known
        for it, (low, high) in zip(items, _label_ranges(flat, sizes), strict=True):
            if low is not None:
                result.label_range.append((it.id, low, high))
    elif result.outputs is not None:
        ids = flat.long()
        bad = (ids != IGNORE_INDEX) & ((ids < 0) | (ids >= result.outputs))
        if bool(bad.any()):
            sizes = [t.numel() for t in labels]
            owner = torch.repeat_interleave(torch.arange(len(items)), torch.tensor(sizes))
            for i in torch.unique(owner[bad]).tolist():
                result.out_of_range.add(items[i].id)
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
    """Index the inputs of the chunks counted since the last time, in their order, at once."""
    if not result.queued:
        return
    queued, result.queued, result.queued_examples = result.queued, [], 0
    bits = np.concatenate([np.full(len(ids), bit, np.uint8) for bit, ids, _ in queued])
    ids = [i for _, chunk, _ in queued for i in chunk]
    result.inputs.add_many(_input_keys([d for _, _, d in queued], [len(c) for _, c, _ in queued]),
                           bits, _Where(bits, ids))


class _Where:
    """(split, id) of the i-th input indexed, made only when a repeat names it."""

    def __init__(self, bits: np.ndarray, ids: list):
        self.bits, self.ids = bits, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[str, Any]:
        return SPLITS[int(self.bits[i]).bit_length() - 1], self.ids[i]


def _flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """Tensors of a chunk as one flat tensor, and whether each was 1-d."""
    try:
        flat = torch.cat(tensors)
        if flat.dim() == 1:
            return flat, True
    except RuntimeError:  # 0-d tensors, or dims that differ
        if all(t.dim() == 0 for t in tensors):
            return torch.stack(tensors), False
    return torch.cat([t.reshape(-1) for t in tensors]), False


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


def _digest(task: Task, items: list[Item]) -> list[tuple]:
    """The model inputs of a chunk, for `_input_keys`: per input and dtype its number, the
    dtype, the tensors' values as one flat tensor, their sizes, their examples (None: all) and
    a word of their shapes (None: all 1-d, the shape is the size)."""
    parts = []
    for slot, name in enumerate(task.model_inputs, start=1):
        tensors = [it.tensors.get(name) for it in items]
        dtypes = [None if t is None else t.dtype for t in tensors]
        kinds = set(dtypes)
        for dtype in kinds if len(kinds) == 1 else dict.fromkeys(dtypes):
            if dtype is None:
                continue
            where = None if len(kinds) == 1 else [i for i, d in enumerate(dtypes) if d == dtype]
            group = tensors if where is None else [tensors[i] for i in where]
            flat, one_dim = _flat(group)
            shapes = None if one_dim else [t.numel() if t.dim() == 1 else hash(t.shape)
                                           for t in group]
            parts.append((slot, dtype, flat.detach().cpu(), [t.numel() for t in group], where,
                          shapes))
    return parts


def _input_keys(digests: list[list[tuple]], sizes: list[int]) -> np.ndarray:
    """One 64-bit key per example of the chunks digested (`sizes`: their examples), from the
    name, dtype, shape and values of each of its model inputs: equal for identical inputs,
    different otherwise but for a collision (about n^2 / 2^65)."""
    groups: dict[tuple, tuple[list, list, list, list]] = {}
    for digest, offset in zip(digests, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True):
        for slot, dtype, flat, counts, where, shapes in digest:
            flats, all_counts, owners, heads = groups.setdefault((slot, dtype), ([], [], [], []))
            flats.append(flat)
            all_counts += counts
            heads += counts if shapes is None else shapes
            owners.append(np.arange(offset, offset + len(counts)) if where is None else
                          np.asarray(where, np.int64) + offset)
    keys = np.zeros(sum(sizes), np.uint64)
    for (slot, dtype), (flats, counts, owners, heads) in sorted(groups.items(),
                                                                key=lambda g: g[0][0]):
        width, flat = dtype.itemsize, torch.cat(flats)
        words = flat.view(_AS_INT[width]).long() if width in _AS_INT else \
            flat.contiguous().view(torch.int64)  # 16-byte values: two words each
        head = np.asarray(heads, np.int64).view(np.uint64) ^ \
            np.uint64(hash(dtype) & 0xFFFF_FFFF_FFFF_FFFF)
        tensors = _tensor_keys(words.numpy().view(np.uint64),
                               np.asarray(counts, np.int64) * max(width // 8, 1), head)
        owner = np.concatenate(owners)
        keys[owner] = _mix(keys[owner] * _ODD + (tensors ^ _mix(np.full(1, slot, np.uint64))))
    return keys


def _tensor_keys(values: np.ndarray, counts: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Per run of `counts` words, a key of its words in order and its head word: each word
    mixed with its position, summed (modulo 2^64)."""
    if len(counts) and counts[0] and (counts == counts[0]).all():  # runs of one length
        words = (values.reshape(len(counts), -1) + _positions(int(counts[0]))[:counts[0]]) * _ODD
        words ^= words >> np.uint64(29)
        words *= np.uint64(0xBF58476D1CE4E5B9)
        return _mix(_mix(heads) + words.sum(axis=1, dtype=np.uint64))
    ends = np.cumsum(counts)
    starts = ends - counts
    at = np.arange(len(values)) - np.repeat(starts, counts)
    words = (values + _positions(len(values))[at]) * _ODD  # one-to-one per position,
    words ^= words >> np.uint64(29)  # then not linear: [1, 2] does not sum as [2, 1]
    words *= np.uint64(0xBF58476D1CE4E5B9)
    mixed = np.concatenate([np.zeros(1, np.uint64), np.cumsum(words)])
    return _mix(_mix(heads) + mixed[ends] - mixed[starts])


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

