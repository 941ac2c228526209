"""A block of notebook 01's pass, counted where it lands: in the process that reads the source,
or in a forked worker (`scan_workers`). The reader sends raw examples in the order it read them;
a `Tally` checks, splits, encodes and counts them a chunk of one split at a time, and answers
with a `Part` the reader merges in the order the blocks were sent: the counts, the keys of the
block's ids, groups and inputs for the pass's hash indexes, and the examples still wanted whole."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from ...contract.data import Item, encode_failed
from ...contract.hash_index import keys_of
from ...contract.sources import SPLITS, Checks, split_of
from ...contract.task import Task
from .scan_tally import BITS, CHUNK, COLLATE, Scan, Where, count, input_keys, merge

SPLITS_KEPT = 4096  # groups whose split is remembered (the default rule; cleared when full)


@dataclass
class Block:
    """Raw examples as read, their positions in the source, how many more of each split the
    reader wants whole, and what it knows of the model's output size."""

    examples: list
    positions: list[int]
    want: dict[str, int]
    probed: bool
    outputs: int | None


@dataclass
class Part:
    """What a block found (see the module's text)."""

    counts: Scan
    checked: tuple  # Checks.found()
    examples: Counter
    ids: list[str]
    id_keys: np.ndarray
    groups: list[str]  # a run of one group's rows in one split once
    group_keys: np.ndarray
    group_bits: np.ndarray
    input_keys: np.ndarray
    input_bits: np.ndarray
    input_ids: list
    kept: dict[str, list[tuple[int, dict]]] | Packed  # split -> (index in the block, tensors)


class Tally:
    """Counts blocks of one task's examples; `portable`: in a worker, whose answer is pickled,
    the kept tensors are `Packed`."""

    def __init__(self, task: Task, portable: bool = False):
        self.task, self.portable = task, portable
        # the default rule reads the group key alone: a group's split is remembered
        self.by_group = task.split_of is None and type(task).split is Task.split
        self.split_by: dict[str, str] = {}

    def __call__(self, block: Block) -> Part:
        task, split_by, by_group = self.task, self.split_by, self.by_group
        counts = Scan(task, "")
        counts.probed, counts.outputs = block.probed, block.outputs
        checks = Checks(task)
        group_key, id_key, encode = task.group_key, task.id_key, task.encode
        examples = dict.fromkeys(SPLITS, 0)
        pending: dict[str, list[Item]] = {n: [] for n in SPLITS}
        kept: dict[str, list[tuple[int, dict]]] = {n: [] for n in SPLITS}
        room = dict(block.want)
        groups: list[str] = []
        bits: list[int] = []
        last_group, last_name = "", ""
        first: list[str] = []  # the splits in the order their first batch filled
        examples_in = block.examples
        for i in checks.usable(block.positions, examples_in):
            example = examples_in[i]
            group = str(example[group_key])
            name = split_by.get(group) if by_group else None
            if name is None:
                name = split_of(task, example)
                if by_group:
                    if len(split_by) >= SPLITS_KEPT:
                        split_by.clear()
                    split_by[group] = name
            examples[name] += 1
            if group != last_group or name != last_name:
                last_group, last_name = group, name
                groups.append(group)
                bits.append(BITS[name])
            try:
                tensors = encode(example)
            except Exception as exc:
                raise encode_failed(task, example, exc) from exc
            if room[name]:
                room[name] -= 1
                kept[name].append((i, tensors))
            chunk = pending[name]
            chunk.append(Item(example[id_key], tensors, example))
            if not len(chunk) % COLLATE:  # a batch's worth
                if name not in first:
                    first.append(name)
                if len(chunk) == CHUNK:
                    count(counts, name, chunk)
                    pending[name] = []
        for name in SPLITS:
            count(counts, name, pending[name])
        first += [n for n in SPLITS if n not in first]
        for table in ("targets_hist", "classes"):  # splits in the order batches came to them
            counted = getattr(counts, table)
            setattr(counts, table, defaultdict(Counter, {n: counted[n] for n in first
                                                         if n in counted}))
        ids = checks.take_ids()
        keys, input_bits, input_ids = input_keys(counts)
        counts.task = None  # the reader's scan has it
        kept = {n: k for n, k in kept.items() if k}
        return Part(counts, checks.found(), Counter({n: c for n, c in examples.items() if c}),
                    ids, keys_of(ids), groups, keys_of(groups), np.array(bits, np.uint8), keys,
                    input_bits, input_ids, Packed(kept) if self.portable and kept else kept)


def merge_part(result: Scan, checks: Checks, examples: list, part: Part, keep: int) -> None:
    """Fold a block's part into the pass, in the order the blocks were sent (`examples`: the
    block's raw examples, for those kept whole)."""
    checks.merge(part.checked, part.ids, part.id_keys)
    result.examples.update(part.examples)
    result.groups.add_many(part.group_keys, part.group_bits, part.groups)
    if len(part.input_keys):
        result.inputs.add_many(part.input_keys, part.input_bits,
                               Where(part.input_bits, part.input_ids))
    merge(result, part.counts)
    key = result.task.id_key
    for name, kept in (part.kept.unpack() if isinstance(part.kept, Packed) else part.kept).items():
        for i, tensors in kept[:max(0, keep - len(result.kept[name]))]:
            result.kept[name].append(Item(examples[i][key], tensors, examples[i]))
            result.kept_raw[name].append(examples[i])


class Packed:
    """Kept examples' tensors for the trip back from a worker: those of one dtype as one numpy
    array (a tensor pickles by itself at about 50 us, an array of all of them at once in
    microseconds), cut into views again on arrival (`unpack`: one `split` per dtype)."""

    def __init__(self, kept: dict[str, list[tuple[int, dict]]]):
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        # split -> (i, [(key, None, value) or (key, dtype, shape)]), in the order packed
        self.index: dict[str, list[tuple[int, list]]] = {}
        for name, rows in kept.items():
            for i, tensors in rows:
                entries = []
                for key, t in tensors.items():
                    if not isinstance(t, torch.Tensor) or t.requires_grad or t.is_sparse:
                        entries.append((key, None, t))  # pickled as it is
                        continue
                    buckets.setdefault(t.dtype, []).append(t.reshape(-1))
                    entries.append((key, t.dtype, tuple(t.shape)))
                self.index.setdefault(name, []).append((i, entries))
        self.sizes = {dtype: [t.numel() for t in flat] for dtype, flat in buckets.items()}
        self.buckets = {dtype: _as_numpy(torch.cat(flat)) for dtype, flat in buckets.items()}

    def unpack(self) -> dict[str, list[tuple[int, dict]]]:
        pieces = {dtype: iter(_from_numpy(array, dtype).split(self.sizes[dtype]))
                  for dtype, array in self.buckets.items()}
        out: dict[str, list[tuple[int, dict]]] = {}
        for name, rows in self.index.items():
            out[name] = [(i, {key: value if dtype is None else _shaped(next(pieces[dtype]), value)
                              for key, dtype, value in entries}) for i, entries in rows]
        return out


def _shaped(flat: torch.Tensor, shape: tuple) -> torch.Tensor:
    return flat if flat.dim() == len(shape) == 1 else flat.view(shape)


def _as_numpy(flat: torch.Tensor) -> np.ndarray:
    """A flat tensor as numpy: its own dtype, or its bytes where numpy lacks it (bfloat16)."""
    try:
        return flat.numpy()
    except TypeError:
        return flat.view(torch.uint8).numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)
