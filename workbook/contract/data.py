"""Data: reading raw examples, splitting by group without leaks, encoding and batching."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ..base.errors import WorkbookError, reason
from .sources import SPLITS, Checks, read_splits, rows, split_of
from .task import Task


class JsonlRows:
    """The objects of a JSONL file, one per line, read lazily on every pass (a task's
    `load_examples` may return it as it is: the file is never held in memory); a malformed line
    is reported with its file and number when the pass reaches it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise WorkbookError(f"data file {self.path} does not exist",
                                "check the path, or regenerate the samples with "
                                "`python data_samples/make_samples.py`")

    def __len__(self) -> int:
        """The examples a pass will give (non-blank lines), counted without parsing: the
        progress bar's total."""
        with self.path.open("rb") as handle:
            return sum(1 for line in handle if line.strip())

    def __iter__(self) -> Iterator[dict]:
        path = self.path
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise WorkbookError(f"{path}:{number}: malformed JSON line ({exc.msg})",
                                        f"fix or remove line {number} of {path}") from exc
                if not isinstance(row, dict):
                    raise WorkbookError(f"{path}:{number}: expected a JSON object, got "
                                        f"{type(row).__name__}",
                                        f"write line {number} as an object {{...}}")
                yield row


def read_jsonl(path: str | Path) -> list[dict]:
    """Every object of a JSONL file as a list (`JsonlRows` reads them lazily instead)."""
    rows = list(JsonlRows(path))
    if not rows:
        raise WorkbookError(f"data file {path} holds no examples", "point the task at a file "
                            "with at least one JSON line")
    return rows


def load_examples(task: Task) -> list[dict]:
    """The task's raw examples as a list, checked for ids and group keys (the notebooks read
    them streaming instead: `sources.read_splits`)."""
    checks, examples = Checks(task), []
    for position, example in enumerate(rows(task)):
        if checks.ok(position, example):
            examples.append(example)
    checks.raise_any()
    return examples


def split_examples(task: Task, examples: list[dict]) -> dict[str, list[dict]]:
    """Assign each example to train / validation / test with the task's rule."""
    splits: dict[str, list[dict]] = {name: [] for name in SPLITS}
    for ex in examples:
        splits[split_of(task, ex)].append(ex)
    for name in ("train", "validation"):
        if not splits[name]:
            raise WorkbookError(f"the {name} split of task {task.name!r} is empty",
                                "add examples or groups, or change split_fractions")
    return splits


@dataclass
class Item:
    """One encoded example, the id of the raw example it came from and that raw example (the
    training loader encodes it again on every pass, as a campaign's Dataset does)."""

    id: Any
    tensors: dict[str, Tensor]
    raw: dict | None = field(default=None, repr=False, compare=False)


def encode_example(task: Task, example: dict) -> Item:
    """Encode one raw example; a failing encode names the example."""
    try:
        tensors = task.encode(example)
    except Exception as exc:
        raise encode_failed(task, example, exc) from exc
    return Item(example[task.id_key], tensors, example)


def encode_failed(task: Task, example: dict, exc: Exception) -> WorkbookError:
    """The error for an encode that raised on an example, naming it."""
    return WorkbookError(f"encode failed on example {example.get(task.id_key)!r}: {exc!r}",
                         "fix the task's encode for this example")


def encode_examples(task: Task, examples: list[dict]) -> list[Item]:
    """Encode raw examples; a failing encode names the example."""
    return [encode_example(task, ex) for ex in examples]


@dataclass
class Prepared:
    """A task's examples ready for the loop: the raw rows of every split (after the limits)
    and the encoded items of the splits asked for."""

    raw: dict[str, list[dict]]
    items: dict[str, list[Item]]

    @property
    def train(self) -> list[Item]:
        return self.items["train"]

    @property
    def validation(self) -> list[Item]:
        return self.items["validation"]


def prepare(task: Task, encode: tuple[str, ...] = ("train", "validation"),
            limits: dict[str, int] | None = None,
            keep: tuple[str, ...] | None = None) -> Prepared:
    """The prologue of every capability: one pass over the task's source, split by group,
    keeping the raw rows of the splits in `keep` (default: those encoded or limited, else all) - the
    first `limits[split]` of a split (0: all) - and encoding the splits in `encode`. A split
    whose rows are not kept is not held in memory; once every kept split has its limit, the
    source is not read further."""
    if keep is None:
        keep = tuple(dict.fromkeys([*encode, *(n for n, v in (limits or {}).items() if v)])) \
            or SPLITS
    raw = read_splits(task, keep, limits)
    return Prepared(raw, {name: encode_examples(task, raw[name]) for name in encode})


@dataclass
class Batch:
    """A collated micro-batch: tensors for the model and loss, plus the example ids."""

    ids: list[Any]
    tensors: dict[str, Tensor]

    def __len__(self) -> int:
        return len(self.ids)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.ids, {k: v.to(device, non_blocking=True) for k, v in
                                self.tensors.items()})


class ItemDataset(Dataset):
    """A map-style dataset over items, for torch's DataLoader. Given the task, an item that
    came from a raw example is encoded again in `__getitem__` (in the loader's workers when it
    has any), so every pass pays the encoding a campaign pays. In a worker process the random
    streams (Python, NumPy, torch) are seeded for each example from `seed` and the example's
    index, as torch seeds each worker from the loader's base seed: a random augmentation then
    depends on the pass and the example, not on which worker read it or how far that worker
    had come - a run resumed mid-pass augments as the uninterrupted one did."""

    def __init__(self, items: list[Item], task: Task | None = None, seed: int = 0):
        self.items, self.task, self.seed = items, task, seed

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Item:
        item = self.items[index]
        if self.task is None or item.raw is None:
            return item
        if get_worker_info() is not None:
            seed_example(self.seed, index)
        return encode_example(self.task, item.raw)


def seed_example(seed: int, index: int) -> None:
    """Seed this (worker) process's random streams for one example of a pass."""
    import random

    import numpy as np

    value = (seed * 1_000_003 + index) % 2**63
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def collate_items(task: Task, items: list[Item], training: bool = False) -> Batch:
    """Collate items with the task's collate (`training`: its training collate) and keep their
    ids; a collate that raises, or returns anything but a dict of tensors, is named with the
    examples it was given."""
    ids = [it.id for it in items]
    piece = "train_collate" if training and task.train_collate is not None else "collate"
    try:
        batch = task.collator(training)([it.tensors for it in items])
    except Exception as exc:
        raise WorkbookError(f"the task's {piece} raised {type(exc).__name__} "
                            f"({reason(exc, 200)}) on a batch of {len(ids)} examples (ids "
                            f"{ids[:5]})", "collate receives a list of encode's dicts and "
                            "returns one batch dict of padded tensors: run it on these "
                            "examples to see the whole traceback") from exc
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # a BatchEncoding, as Hugging Face's collators return
    if not isinstance(batch, dict) or not all(isinstance(v, Tensor) for v in batch.values()):
        shown = {k: type(v).__name__ for k, v in batch.items()} if isinstance(batch, dict) \
            else type(batch).__name__
        raise WorkbookError(f"the task's {piece} returned {shown}, not a dict of tensors",
                            "return {name: tensor} with the model inputs and 'labels' (e.g. "
                            "torch.utils.data.default_collate over encode's dicts)")
    return Batch(ids, batch)


def micro_batches(task: Task, items: list[Item], size: int,
                  training: bool = True) -> Iterator[Batch]:
    """Items in order, `size` at a time (the last one may be smaller), collated as training
    batches (`training` off: by `collate`, which draws nothing per batch in a comparison)."""
    for start in range(0, len(items), size):
        yield collate_items(task, items[start:start + size], training=training)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The shuffled order of one pass: a pure function of (seed, epoch), so resume can redo it."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


def epoch_updates(order: list[int], micro_batch: int, accumulation: int,
               drop_partial: bool) -> list[list[list[int]]]:
    """Split one pass into updates (groups) of micro-batches of example indices.

    The last micro-batch and the last group may be partial; with `drop_partial` the examples
    that do not fill a whole update are left out of this pass.
    """
    per_update = micro_batch * accumulation
    if drop_partial:
        order = order[: len(order) // per_update * per_update]
    groups = []
    for start in range(0, len(order), per_update):
        chunk = order[start:start + per_update]
        groups.append([chunk[i:i + micro_batch] for i in range(0, len(chunk), micro_batch)])
    return groups


def picklable_for_workers(task: Task) -> None:
    """Worker processes started by 'spawn' or 'forkserver' (macOS, Windows, Python 3.14's
    Linux default) receive the task pickled; one built from lambdas or local functions cannot
    be - a clear error here instead of one from inside the DataLoader."""
    import multiprocessing
    import pickle

    method = multiprocessing.get_start_method(allow_none=True) or \
        multiprocessing.get_context().get_start_method()
    if method == "fork":
        return
    try:
        pickle.dumps(task)
    except Exception as exc:
        raise WorkbookError(f"DataLoader workers started by {method!r} need the task pickled, "
                            f"and task {task.name!r} cannot be ({reason(exc, 160)})",
                            "define the task's functions at module level (no lambdas or "
                            "local functions), or use workers=0") from None


def loader(task: Task, items: list[Item], batches: list[list[int]], workers: int = 0,
           seed: int = 0, encode: bool = True) -> DataLoader:
    """A DataLoader that yields the given training micro-batches (lists of item indices) in
    order, encoding each raw example again unless `encode` is off. It draws its worker seed from its
    own generator, never from the global one, so creating it mid-epoch on resume leaves the
    training random stream (dropout) untouched."""
    if workers > 0:
        picklable_for_workers(task)
    return DataLoader(ItemDataset(items, task if encode else None, seed), batch_sampler=batches,
                      num_workers=workers,
                      collate_fn=partial(collate_items, task, training=True),
                      generator=torch.Generator().manual_seed(seed))
