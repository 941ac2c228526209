"""A block of notebook 01's pass, counted where it lands: in the process that reads the source,
or in a forked worker (`scan_workers`). The reader sends raw examples in the order it read them;
a `Tally` checks, splits, encodes and counts them a chunk of one split at a time, and answers
with a `Part` the reader merges in the order the blocks were sent: the counts, the keys of the
block's ids, groups and inputs for the pass's hash indexes, and the examples still wanted whole."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..contract.data import Item, encode_failed
from ..contract.hash_index import keys_of
from ..contract.sources import SPLITS, Checks, split_of
from ..contract.task import Task
from .scan_tally import BITS, CHUNK, Scan, Where, count, input_keys, merge

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
    kept: dict[str, list[tuple[int, dict]]]  # split -> (index in the block, tensors)


class Tally:
    """Counts blocks of one task's examples; `portable` sends kept tensors as numpy arrays
    (a worker's answer is pickled: 30x faster than a tensor's own pickling)."""

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
        ok, group_key, id_key, encode = checks.ok, task.group_key, task.id_key, task.encode
        examples = dict.fromkeys(SPLITS, 0)
        pending: dict[str, list[Item]] = {n: [] for n in SPLITS}
        kept: dict[str, list[tuple[int, dict]]] = {n: [] for n in SPLITS}
        room = dict(block.want)
        groups: list[str] = []
        bits: list[int] = []
        last_group, last_name = "", ""
        for i, (position, example) in enumerate(zip(block.positions, block.examples,
                                                     strict=True)):
            if not ok(position, example):
                continue
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
                kept[name].append((i, _portable(tensors) if self.portable else tensors))
            chunk = pending[name]
            chunk.append(Item(example[id_key], tensors, example))
            if len(chunk) == CHUNK:
                count(counts, name, chunk)
                pending[name] = []
        for name in SPLITS:
            count(counts, name, pending[name])
        ids = checks.take_ids()
        keys, input_bits, input_ids = input_keys(counts)
        counts.task = None  # the reader's scan has it
        return Part(counts, checks.found(), Counter({n: c for n, c in examples.items() if c}),
                    ids, keys_of(ids), groups, keys_of(groups), np.array(bits, np.uint8), keys,
                    input_bits, input_ids, {n: k for n, k in kept.items() if k})


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
    for name, kept in part.kept.items():
        for i, tensors in kept[:max(0, keep - len(result.kept[name]))]:
            tensors = {k: torch.from_numpy(t) if isinstance(t, np.ndarray) else t
                       for k, t in tensors.items()}
            result.kept[name].append(Item(examples[i][key], tensors, examples[i]))
            result.kept_raw[name].append(examples[i])


def _portable(tensors: dict[str, Any]) -> dict[str, Any]:
    """Tensors as numpy arrays where numpy has their dtype (not bfloat16): they pickle fast."""
    out = {}
    for k, t in tensors.items():
        try:
            out[k] = t.numpy() if isinstance(t, torch.Tensor) and not t.requires_grad else t
        except TypeError:
            out[k] = t
    return out
