"""What notebook 01's pass counts, a chunk of one split at a time: the statistics of a `Scan`
(coverage, targets, label ids, inputs' keys for the repeats across splits), folded in by
`count`. A block counted by a worker comes back as a `Scan` of its own and is `merge`d in the
order it was sent, so a scan on several cores adds up as it would on one."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...contract.data import Item, collate_items
from ...contract.hash_index import HashIndex
from ...contract.sources import SPLITS
from ...contract.targets import IGNORE_INDEX, contributes
from ...contract.task import Task
from .coverage import batch_coverage, prompt_spans

COLLATE = 64  # examples collated at a time (a batch's padding is part of what is counted)
CHUNK = 4 * COLLATE  # examples counted at a time: their batches, digests and label ids at once
FINDINGS = 5  # example ids kept per finding (its count covers every example)
BITS = {name: 1 << i for i, name in enumerate(SPLITS)}
COVERED = ("labels", "attention_mask", "prompt_mask")  # what batch_coverage reads of a batch


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

    def merge(self, other: Finding) -> None:
        """Add what a later part of the pass found."""
        self.examples += other.examples
        self.amount += other.amount
        self.ids += other.ids[:FINDINGS - len(self.ids)]


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
        if v.numel():
            mean = float(v.mean())
            self.merge(Moments(v.numel(), mean, float(((v - mean) ** 2).sum()), float(v.min()),
                               float(v.max())))

    def merge(self, other: Moments) -> None:
        """Fold in the moments of other values (Chan et al.'s pairwise update)."""
        if not other.n:
            return
        delta, total = other.mean - self.mean, self.n + other.n
        self.m2 += other.m2 + delta**2 * self.n * other.n / total
        self.mean += delta * other.n / total
        self.n, self.low, self.high = total, min(self.low, other.low), max(self.high, other.high)

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
    # until the output size is known: per chunk, the ids of the examples with label ids and
    # their lowest and highest id (`held`: how many examples in all)
    label_range: list[tuple[list, np.ndarray, np.ndarray]] = field(default_factory=list)
    held: int = 0
    outputs: int | None = None
    probed: bool = False  # the model's output size was asked for (None: it could not be told)
    moments: dict[str, Moments] = field(default_factory=lambda: defaultdict(Moments))
    train_square: Moments = field(default_factory=Moments)
    nonfinite: Finding = field(default_factory=Finding)
    crossing_groups: list[str] = field(default_factory=list)
    crossing_inputs: list[list[str]] = field(default_factory=list)
    groups: HashIndex | None = None
    inputs: HashIndex | None = None
    queued: list[tuple[int, list, list]] = field(default_factory=list)  # for `input_keys`
    queued_examples: int = 0
    workers: int = 0  # processes that encoded and counted beside the one reading

    def note_outputs(self, outputs: int | None) -> None:
        """The model's output size, once known: the label ids held until then are checked."""
        self.outputs, self.probed = outputs, True
        for held in self.label_range:
            self._check_ranges(*held)
        self.label_range, self.held = [], 0

    def _check_ranges(self, ids: list, low: np.ndarray, high: np.ndarray) -> None:
        if self.outputs is not None:
            for i in np.flatnonzero((low < 0) | (high >= self.outputs)).tolist():
                self.out_of_range.add(ids[i])

    def hold_ranges(self, ids: list, low: np.ndarray, high: np.ndarray) -> None:
        """Examples' lowest and highest label ids, checked now if the output size is known,
        else held."""
        if self.probed:
            self._check_ranges(ids, low, high)
        elif len(ids):
            self.label_range.append((ids, low, high))
            self.held += len(ids)


def count(result: Scan, name: str, items: list[Item]) -> None:
    """Fold one chunk of a split into the statistics (then the chunk can go)."""
    if not items:
        return
    task, kind = result.task, result.task.target_kind
    spans = prompt_spans(task, items)
    if spans is not None:
        result.prompt_examples += len(spans)
        result.unchecked_prompts.update(s for s in spans if isinstance(s, str))
    batches = []
    floats: list[Item] = []  # those of batches with floats, which reach the model
    for start in range(0, len(items), COLLATE):
        batches.append(collate_items(task, items[start:start + COLLATE]).tensors)
        if any(t.is_floating_point() for t in batches[-1].values()):
            floats += items[start:start + COLLATE]
    positions, targets, padding, prompt = _coverage(task, items, batches, spans)
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
    # floats reach the model in the batch (an int tensor holds no NaN): then each example's own
    for it in floats:
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
               for t in it.tensors.values()):
            result.nonfinite.add(it.id)
    columns: dict[str, tuple[torch.Tensor, list[int]]] = {}
    result.queued.append((BITS[name], [it.id for it in items], _digest(task, items, columns)))
    result.queued_examples += len(items)
    flat, sizes = columns.get("labels") or _labels(items)
    if kind.float_targets:  # moments a batch at a time, added as they always were
        for values in flat.split([sum(sizes[i:i + COLLATE])
                                  for i in range(0, len(sizes), COLLATE)]):
            values = values.float()
            values = values[contributes(values)]
            result.moments[name].add(values)
            if name == "train":
                result.train_square.add(values**2)
        return
    if not result.probed:  # held until the model's output size is known
        which, low, high = _label_ranges(flat, sizes)
        result.hold_ranges([items[i].id for i in which.tolist()], low, high)
    elif result.outputs is not None and flat.numel():
        ids = flat.long()
        low, high = torch.aminmax(ids)  # every id in range: one look at the chunk
        bad = (ids != IGNORE_INDEX) & ((ids < 0) | (ids >= result.outputs)) \
            if int(low) < 0 or int(high) >= result.outputs else None
        if bad is not None and bool(bad.any()):
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


def _coverage(task: Task, items: list[Item], batches: list[dict],
              spans: list | None) -> tuple[list[int], ...]:
    """`batch_coverage` of a chunk's batches (COLLATE examples each): in one go when they
    agree in what it reads (the same tensors of COVERED, each of one dtype and of one shape
    past the first dimension - its figures are per row), else batch by batch."""
    agree = {tuple((k, b[k].dtype, b[k].shape[1:], b[k].dim()) for k in COVERED if k in b)
             for b in batches}
    if len(batches) > 1 and len(agree) == 1 and all(dim for *_, dim in next(iter(agree))):
        return batch_coverage(task, items, {k: torch.cat([b[k] for b in batches])
                                            for k, *_ in agree.pop()}, spans)
    out: tuple[list[int], ...] = ([], [], [], [])
    for i, batch in enumerate(batches):
        at = slice(i * COLLATE, (i + 1) * COLLATE)
        for whole, got in zip(out, batch_coverage(task, items[at], batch,
                                                  None if spans is None else spans[at]),
                              strict=True):
            whole += got
    return out


def merge(result: Scan, part: Scan) -> None:
    """Fold the counts of a later block of the pass (a worker's) into the scan's."""
    for split, hist in part.targets_hist.items():
        result.targets_hist[split].update(hist)
    for split, classes in part.classes.items():
        result.classes[split].update(classes)
    for split, moments in part.moments.items():
        result.moments[split].merge(moments)
    result.train_square.merge(part.train_square)
    result.positions += part.positions
    result.targets += part.targets
    result.prompt_examples += part.prompt_examples
    result.unchecked_prompts.update(part.unchecked_prompts)
    for finding in ("zero", "on_padding", "on_prompt", "mismatched", "out_of_range",
                    "nonfinite"):
        getattr(result, finding).merge(getattr(part, finding))
    result.first_mismatch = result.first_mismatch or part.first_mismatch
    for held in part.label_range:
        result.hold_ranges(*held)


def input_keys(result: Scan) -> tuple[np.ndarray, np.ndarray, list]:
    """The inputs' keys of the chunks counted since the last time, their splits' bits and their
    examples' ids, in order (the queue emptied)."""
    queued, result.queued, result.queued_examples = result.queued, [], 0
    if not queued:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint8), []
    bits = np.concatenate([np.full(len(ids), bit, np.uint8) for bit, ids, _ in queued])
    ids = [i for _, chunk, _ in queued for i in chunk]
    return _input_keys([d for _, _, d in queued], [len(c) for _, c, _ in queued]), bits, ids


class Where:
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


def _labels(items: list[Item]) -> tuple[torch.Tensor, list[int]]:
    """The labels of a chunk as one flat tensor, and each example's size."""
    labels = [it.tensors["labels"] for it in items]
    return _flat(labels)[0], [t.numel() for t in labels]


def _label_ranges(flat: torch.Tensor, sizes: list[int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which examples of a chunk have a label id other than -100, and the lowest and highest
    of each, for the chunk at once."""
    flat = flat.long()
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    real = flat != IGNORE_INDEX
    flat, owner = flat[real], owner[real]
    count = torch.zeros(len(sizes), dtype=torch.long).index_add_(0, owner, torch.ones_like(owner))
    big = torch.iinfo(torch.long).max
    low = torch.full((len(sizes),), big).scatter_reduce(0, owner, flat, "amin")
    high = torch.full((len(sizes),), -big).scatter_reduce(0, owner, flat, "amax")
    has = count > 0
    return np.flatnonzero(has.numpy()), low[has].numpy(), high[has].numpy()


def _digest(task: Task, items: list[Item],
            columns: dict[str, tuple[torch.Tensor, list[int]]]) -> list[tuple]:
    """The model inputs of a chunk, for `_input_keys`: per input and dtype its number, the
    dtype, the tensors' values as one flat tensor, their sizes, their examples (None: all) and
    a word of their shapes (None: all 1-d, the shape is the size). An input every example has,
    of one dtype, goes into `columns` as (flat, sizes) for `count` to use again."""
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
            sizes = list(map(torch.Tensor.numel, group))
            if where is None:
                columns[name] = (flat, sizes)
            parts.append((slot, dtype, flat.detach().cpu(), sizes, where, shapes))
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


