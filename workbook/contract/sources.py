"""Where a task's raw examples come from, read one at a time: whatever `load_examples` returns -
a list, a map-style dataset read lazily by index (`__len__` and `__getitem__`: a memory-mapped
`datasets.Dataset`, a torch `Dataset`) or any iterable (a generator, a torch `IterableDataset`, a
streaming `datasets.IterableDataset`). Nothing here turns the source into a list; every row is
checked as it passes (a dict, an id, a group key, ids unique - 9 bytes per example, no Python
object), and the problems of a pass are raised together, with their counts, at its end."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from torch.utils.data import IterableDataset

from ..base.errors import WorkbookError, reason
from .hash_index import HashIndex, keys_of
from .task import Task, own_code

SPLITS = ("train", "validation", "test")
FEW = 5  # positions or ids an error names; its count covers all
BLOCK = 4096  # ids hashed at a time
# rows read without reaching the source's end while a split is asked whole: an endless stream
# (or one too long for the pilot to hold a split of) is refused there, never read forever
WHOLE_MOST = 2_000_000


def rows(task: Task) -> Iterator[Any]:
    """The rows of the task's source in order, read lazily; a source that raises while it is
    read is named with the position it had reached."""
    return opened(task)[0]


def opened(task: Task) -> tuple[Iterator[Any], Any]:
    """`rows`, and the source they come from (for `length`)."""
    source = own_code("load_examples", task.load_examples,
                      receives="no arguments and returns a list, a dataset or an iterable of "
                      "dicts")
    if isinstance(source, (str, bytes, Mapping)) or not (
            isinstance(source, Iterable) or hasattr(source, "__getitem__")):
        raise WorkbookError(f"load_examples of {task.name!r} returned a "
                            f"{type(source).__name__}, not examples",
                            "return a list of dicts, a map-style dataset (len and getitem) or "
                            "an iterable of dicts (a generator, an IterableDataset)")
    frames = sys.modules.get("pandas")
    if frames is not None and isinstance(source, frames.DataFrame):  # indexing picks a column
        raise WorkbookError(f"load_examples of {task.name!r} returned a pandas DataFrame, whose "
                            "rows are not read one by one as dicts (iterating it gives the "
                            "column names, indexing it a column)",
                            "return df.to_dict('records') (a list of dicts), or yield its rows: "
                            "(row.to_dict() for _, row in df.iterrows())")
    # torch's IterableDataset inherits a __getitem__ that raises: it is read by iterating
    lazy = length(source) is not None and hasattr(source, "__getitem__") and \
        not isinstance(source, (list, tuple, IterableDataset))
    it = (source[i] for i in range(len(source))) if lazy else iter(source)
    return _named(task, it), source


def length(source: Any) -> int | None:
    """How many rows a source says it has (None: a stream, or a len() that refuses)."""
    try:
        return len(source) if hasattr(source, "__len__") else None
    except TypeError:
        return None


def numbered(source: Iterable, failed: Callable[[int, Exception], WorkbookError]
             ) -> Iterator[tuple[int, Any]]:
    """(position, item) of an iterable, in order; an exception its reading raises (other than
    a WorkbookError) is raised as `failed(position, exc)`, naming where it stopped."""
    it, i = iter(source), 0
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except WorkbookError:
            raise
        except Exception as exc:
            raise failed(i, exc) from exc
        yield i, item
        i += 1


def _named(task: Task, it: Iterator[Any]) -> Iterator[Any]:
    position = 0
    try:
        for row in it:  # only the source's own next() raises in here
            yield row
            position += 1
    except WorkbookError:
        raise
    except Exception as exc:
        raise WorkbookError(f"reading the examples of {task.name!r} failed at position "
                            f"{position}: {reason(exc, 300)}",
                            "fix the source load_examples returns (the file, shard or "
                            "dataset at that position)") from exc


def split_of(task: Task, example: dict) -> str:
    """The split the task's rule puts an example in, checked."""
    try:
        name = task.split(example)
    except WorkbookError:
        raise
    except Exception as exc:
        raise WorkbookError(f"the task's split rule failed on example "
                            f"{example.get(task.id_key)!r}: {reason(exc, 200)}",
                            "fix split_of (or the group key the default rule reads) for this "
                            "example") from exc
    if name not in SPLITS:
        raise WorkbookError(f"task split rule returned {name!r} for example "
                            f"{example[task.id_key]!r}", f"return one of {SPLITS}")
    return name


@dataclass
class Checks:
    """What a pass found wrong with its rows, kept as counts and a few positions."""

    task: Task
    read: int = 0
    not_dicts: list[tuple[int, str]] = field(default_factory=list)  # the first few
    missing: dict[str, list[int]] = field(default_factory=dict)
    repeated: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # every one: not_dicts, missing:<key>, ...
    ids: HashIndex = field(init=False)
    _ids: list = field(default_factory=list, repr=False)  # read, not yet hashed

    def __post_init__(self):
        self.ids = HashIndex(lambda key, prior, bit: self._note("repeated", self.repeated, key))

    def _note(self, what: str, kept: list, value: Any) -> None:
        self.counts[what] += 1
        if len(kept) < FEW:
            kept.append(value)

    def ok(self, position: int, example: Any) -> bool:
        """Whether a row can be used; a row that cannot is counted, not dropped silently."""
        self.read += 1
        if not isinstance(example, dict):
            self._note("not_dicts", self.not_dicts, (position, type(example).__name__))
            return False
        example_id = example.get(self.task.id_key)
        if example_id in (None, "") or example.get(self.task.group_key) in (None, ""):
            for key in (self.task.id_key, self.task.group_key):
                if example.get(key) in (None, ""):
                    self._note(f"missing:{key}", self.missing.setdefault(key, []), position)
            return False
        self._ids.append(example_id)
        if len(self._ids) >= BLOCK:
            self._index_ids()
        return True

    def usable(self, positions: list[int], examples: list) -> list[int]:
        """`ok` on each row of a block, in one loop: the indices of those that can be used
        (their ids wait for `take_ids`)."""
        id_key, group_key, ids, empty = self.task.id_key, self.task.group_key, self._ids, \
            (None, "")
        out = []
        for i, example in enumerate(examples):
            if isinstance(example, dict):
                example_id = example.get(id_key)
                if example_id not in empty and example.get(group_key) not in empty:
                    ids.append(example_id)
                    out.append(i)
                    continue
            self.ok(positions[i], example)  # counted and noted, not used
        self.read += len(out)
        return out

    def take_ids(self) -> list[str]:
        """The ids of the rows passed since the last time, as strings, not hashed here (a
        worker's checks send them to the pass's own: `merge`)."""
        ids, self._ids = list(map(str, self._ids)), []
        return ids

    def found(self) -> tuple:
        """What these checks found, to be sent to the pass's own (`merge`)."""
        return self.read, self.counts, self.not_dicts, self.missing

    def merge(self, found: tuple, ids: list[str], keys: np.ndarray) -> None:
        """Fold in what a worker's checks `found` on a later block of the pass (`ids`: the ids
        of its rows that passed, in order, and their `keys_of`)."""
        read, counts, not_dicts, missing = found
        self.read += read
        self.counts.update(counts)
        self.not_dicts += not_dicts[:FEW - len(self.not_dicts)]
        for key, positions in missing.items():
            mine = self.missing.setdefault(key, [])
            mine += positions[:FEW - len(mine)]
        self.ids.add_many(keys, 1, ids)

    def _index_ids(self) -> None:
        """Hash the ids read since the last time, a block at once."""
        said = list(map(str, self._ids))
        self.ids.add_many(keys_of(said), 1, said)
        self._ids = []

    def raise_any(self) -> None:
        """One error for what the pass found, in the order a user fixes them."""
        task, n = self.task, self.read
        self._index_ids()
        self.ids.flush()
        if not n:
            raise WorkbookError(f"task {task.name!r} returned no examples",
                                "make load_examples return the raw examples - a new iterable on "
                                "every call (the notebooks read the source more than once), "
                                "not one generator that a first pass used up")
        if self.not_dicts:
            pos, kind = self.not_dicts[0]
            raise WorkbookError(f"{self.counts['not_dicts']} of {n} raw examples are not dicts "
                                f"(e.g. position {pos} is a {kind})",
                                f"make load_examples return dicts with {task.id_key!r}, "
                                f"{task.group_key!r} and the fields encode reads")
        for key, what in ((task.id_key, "id"), (task.group_key, "group key")):
            missing, count = self.missing.get(key, []), self.counts[f"missing:{key}"]
            if missing:
                raise WorkbookError(
                    f"{count} of {n} examples have no {what} {key!r} "
                    f"(positions {missing}{'...' if count > len(missing) else ''})",
                    f"give every example a {key!r} field"
                    + (" (the unit of leakage: conversation, patient, document, period)"
                       if key == task.group_key else ""))
        if self.repeated:
            raise WorkbookError(f"example ids are not unique (e.g. {self.repeated[:3]})",
                                "give every example its own id")


def read_splits(task: Task, keep: tuple[str, ...] = SPLITS,
                limits: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """One pass over the task's source: every row checked and put in its split, the rows of
    the splits in `keep` kept (the first `limits[split]` of each; 0 or absent: all). Reading
    stops as soon as every kept split is full, so the first rows of a split of a stream of any
    length are drawn without reading the rest."""
    limits = {n: int((limits or {}).get(n) or 0) for n in SPLITS}
    splits: dict[str, list[dict]] = {n: [] for n in SPLITS}
    seen = dict.fromkeys(SPLITS, 0)
    checks = Checks(task)
    stopped = False
    whole = [n for n in keep if not limits[n]]
    for position, example in enumerate(rows(task)):
        if whole and position >= WHOLE_MOST:
            raise WorkbookError(
                f"read {WHOLE_MOST:,} rows of task {task.name!r}'s source without reaching its "
                f"end while the {' and '.join(whole)} split is asked whole: an endless stream, "
                "or one too long to hold a split of", "give the notebook a limit for it (e.g. "
                "-p validation_limit=2000 or train_limit=...), or make the stream end")
        if not checks.ok(position, example):
            continue
        name = split_of(task, example)
        seen[name] += 1
        if name in keep and (not limits[name] or len(splits[name]) < limits[name]):
            splits[name].append(example)
        if keep and all(limits[n] and len(splits[n]) >= limits[n] for n in keep):
            stopped = True
            break
    checks.raise_any()
    if not stopped:
        for name in ("train", "validation"):
            if not seen[name]:
                raise WorkbookError(f"the {name} split of task {task.name!r} is empty",
                                    "add examples or groups, or change split_fractions")
    return splits
