"""Three streaming pipelines written in the idiom of the public report of their bug, each with
its fix as the clean twin (`bug=False`), over the windows of examples/token_stream.py's memmap:

- `stale_after_load` (huggingface/datasets#8295): the dataset's state dict holds a reference to
  its shard iterator's state; `load_state_dict` rebinds the iterator's state to a new dict, so
  `state_dict()` keeps copying the old, zero-initialised one - a second resume restarts.
- `trainer_skip` (huggingface/transformers#26413): the steps done are kept and, on resume, the
  stream skips `seen % len(files)` examples - a length of the stream's files, not of a pass.
- `commit_at_end` (Lightning-AI/litData#649): a cycling stream whose cursor is saved at the end
  of `__iter__`; a loop that breaks early never reaches it, and its state never moves mid-pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from examples import token_stream
from workbook.contract.task import split_by_group_hash

KINDS = ("stale_after_load", "trainer_skip", "commit_at_end")


class ShardIterable:
    """The windows of some shards, in order; its state is (shard, example in the shard)."""

    def __init__(self, shards: list[list[dict]]):
        self.shards = shards
        self._init_state_dict()

    def _init_state_dict(self) -> None:
        self._state_dict = {"shard_idx": 0, "shard_example_idx": 0}

    def load_state_dict(self, state: dict) -> None:
        self._init_state_dict()  # rebinds: whoever held the old dict keeps a stale one
        self._state_dict.update(state)

    def __iter__(self):
        s = self._state_dict
        while s["shard_idx"] < len(self.shards):
            shard = self.shards[s["shard_idx"]]
            while s["shard_example_idx"] < len(shard):
                s["shard_example_idx"] += 1
                yield shard[s["shard_example_idx"] - 1]
            s["shard_idx"], s["shard_example_idx"] = s["shard_idx"] + 1, 0


class StaleAfterLoad(torch.utils.data.IterableDataset):
    """datasets' IterableDataset in small: shards shuffled per epoch, state_dict a deep copy of
    {"epoch", "examples_iterable": <the shard iterator's state dict>}, that dict built when an
    iteration is prepared. On a resume the state is loaded after it is built: the report's bug
    keeps the dict built before (zero-initialised); the fix points it at the loaded state."""

    def __init__(self, shards: list[list[dict]], seed: int, bug: bool):
        self.shards, self.seed, self.bug, self.epoch = shards, seed, bug, 0
        self._pending: dict | None = None
        self._state_dict = {"epoch": 0, "examples_iterable": ShardIterable([])._state_dict}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards))
        ex = ShardIterable([self.shards[i] for i in order])
        pending, self._pending = self._pending, None
        if pending is not None and pending["epoch"] == self.epoch:
            ex.load_state_dict(pending["examples_iterable"])  # rebinds ex's state dict
            if self.bug:  # state_dict goes on copying the dict it held before the load
                yield from ex
                return
        self._state_dict = {"epoch": self.epoch, "examples_iterable": ex._state_dict}
        yield from ex

    def state_dict(self) -> dict:
        return {"epoch": self._state_dict["epoch"],
                "examples_iterable": dict(self._state_dict["examples_iterable"])}

    def load_state_dict(self, state: dict) -> None:
        self._pending = {"epoch": state["epoch"],
                         "examples_iterable": dict(state["examples_iterable"])}
        self.epoch = state["epoch"]


class TrainerSkip(torch.utils.data.IterableDataset):
    """A stream over shard files read in an order shuffled per epoch; like a Trainer resuming,
    it keeps the examples seen and skips `seen % len(self.files)` on resume (the fix: keep the
    epoch and the examples read in it)."""

    def __init__(self, shards: list[list[dict]], seed: int, bug: bool):
        self.files, self.seed, self.bug, self.epoch = shards, seed, bug, 0
        self.seen, self.in_epoch, self._skip = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.in_epoch = epoch, 0

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.files))
        rows = [w for i in order for w in self.files[i]]
        skip, self._skip = self._skip, 0
        self.in_epoch = skip
        for row in rows[skip:]:
            self.seen, self.in_epoch = self.seen + 1, self.in_epoch + 1
            yield row

    def state_dict(self) -> dict:
        return {"seen": self.seen} if self.bug else {"epoch": self.epoch,
                                                     "in_epoch": self.in_epoch}

    def load_state_dict(self, state: dict) -> None:
        if self.bug:
            self.seen = state["seen"]
            self._skip = self.seen % len(self.files)
        else:
            self.epoch, self._skip = state["epoch"], state["in_epoch"]


class CyclingStream(torch.utils.data.IterableDataset):
    """litData's ParallelStreamingDataset with a `length`: each __iter__ gives `length` rows
    and the next goes on where it left off (cycling); the cursor is saved at the end of
    __iter__ (the fix: as each row is yielded)."""

    def __init__(self, rows: list[dict], length: int, bug: bool):
        self.rows, self.length, self.bug, self.cursor = rows, length, bug, 0

    def __iter__(self):
        start = self.cursor
        for i in range(self.length):
            if not self.bug:
                self.cursor = (start + i + 1) % len(self.rows)
            yield self.rows[(start + i) % len(self.rows)]
        self.cursor = (start + self.length) % len(self.rows)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state["cursor"]


def pipeline(stream, fractions, kind: str, bug: bool, seed: int):
    windows = [{"id": w, "group": w // stream.group_windows, "start": w * stream.block_size}
               for w in range(stream.windows())]
    train = [w for w in windows if split_by_group_hash(w["group"], fractions) == "train"]
    shards = [train[i:i + 16] for i in range(0, len(train), 16)]
    if kind == "stale_after_load":
        return StaleAfterLoad(shards, seed, bug)
    if kind == "trainer_skip":
        return TrainerSkip(shards[:4], seed, bug)
    return CyclingStream(train, 999, bug)


def task(data_file: str, kind: str, bug: bool = True, block_size: int = 16, n_layer: int = 1,
         n_embd: int = 32):
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    base = token_stream.make_task(block_size=block_size, data_file=data_file, n_layer=n_layer,
                                  n_embd=n_embd)
    stream = token_stream.TokenStream(data_file, block_size)

    def train_pipeline(seed: int):
        return pipeline(stream, (0.8, 0.1, 0.1), kind, bug, seed)

    return dataclasses.replace(base, train_pipeline=train_pipeline)
