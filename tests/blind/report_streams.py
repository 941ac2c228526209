"""Training streams resumed by their own `state_dict`, each written in the shape of the public
report it comes from, behind one small classifier (`Task.train_pipeline`, README: "your
DataLoader or streaming dataset, resumed by its own state_dict"). The examples are 64 points in
three classes; the first 48 are the training split, read in shards of 8 in an order shuffled
per epoch.

`stream=` picks the pipeline:

- `"stale_reference"` - huggingface/datasets#8295 ("Bug Fix: Resuming Twice Resets the
  Dataloader", with huggingface/datasets#8308): the stream's `_state_dict` holds a reference to
  its examples-iterable's own state dict; `load_state_dict` makes the examples-iterable rebind
  its `_state_dict` to a fresh object (`_init_state_dict()`), so the stream keeps reporting the
  stale, zero-initialised one. The first resume reads from the right place; every later
  `state_dict()` says shard 0, example 0, and a second resume restarts the pass.
- `"trainer_skip"` - huggingface/transformers#26413 (with huggingface/transformers#33544): the
  checkpoint holds the steps done (`global_step`), and the resume does what the Trainer does,
  `epochs_trained = global_step // len(dataloader)` and `steps_trained_in_current_epoch =
  global_step % len(dataloader)`, where the stream's `len()` is its number of shards, not the
  examples a pass yields.
- `"commit_at_end"` - Lightning-AI/litData#649 ("ParallelStreamingDataset does not resume when
  breaking early", with Lightning-AI/litData#760): the state is saved and the epoch moved on at
  the end of `__iter__`, so a pass broken off early (Lightning's `limit_train_batches`) leaves
  the next `iter()` yielding the same samples again.
- `"stateful"` - the clean twin: epoch and position kept while yielding, restored exactly.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import workbook as wb

CLASSES = ["low", "mid", "high"]
N, TRAIN, SHARD = 64, 48, 8


def points() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return [{"id": i, "group": i, "x": x[i].tolist(),
             "label": CLASSES[int(x[i].sum() > 0.5) + int(x[i].sum() > -0.5)]}
            for i in range(N)]


EXAMPLES = points()


def split_of(example: dict) -> str:
    return "train" if example["id"] < TRAIN else \
        "validation" if example["id"] < TRAIN + 8 else "test"


def encode(example: dict) -> dict:
    return {"x": torch.tensor(example["x"]),
            "labels": torch.tensor(CLASSES.index(example["label"]))}


def shard_order(seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(TRAIN // SHARD, generator=g).tolist()


def rows_of(seed: int, epoch: int) -> list[dict]:
    return [EXAMPLES[s * SHARD + k] for s in shard_order(seed, epoch) for k in range(SHARD)]


# datasets#8295 ------------------------------------------------------------------------------

class ShardExamplesIterable:
    """The examples-iterable: yields shard after shard, its `_state_dict` counting where it is."""

    def __init__(self, seed: int):
        self.seed, self.epoch = seed, 0
        self._init_state_dict()

    def _init_state_dict(self) -> dict:
        self._state_dict = {"shard_idx": 0, "shard_example_idx": 0}
        return self._state_dict

    def __iter__(self):
        order = shard_order(self.seed, self.epoch)
        while self._state_dict["shard_idx"] < len(order):
            shard = order[self._state_dict["shard_idx"]]
            k = self._state_dict["shard_example_idx"]
            if k >= SHARD:
                self._state_dict["shard_idx"] += 1
                self._state_dict["shard_example_idx"] = 0
                continue
            self._state_dict["shard_example_idx"] += 1
            yield EXAMPLES[shard * SHARD + k]

    def load_state_dict(self, state: dict, in_place: bool) -> None:
        if in_place:  # the fix: load into the object the stream refers to
            self._state_dict.update(copy.deepcopy(state))
        else:  # as the report: a brand-new object, the stream's reference left stale
            self._init_state_dict()
            self._state_dict.update(copy.deepcopy(state))


class StreamingIterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, seed: int, fixed: bool = False):
        self.seed, self.fixed = seed, fixed
        self.ex_iterable = ShardExamplesIterable(seed)
        self._epoch = 0
        self._starting_state_dict: dict | None = None
        self._state_dict = {"epoch": 0, "examples_iterable": self.ex_iterable._state_dict}

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def _prepare_ex_iterable_for_iteration(self) -> ShardExamplesIterable:
        ex = self.ex_iterable
        ex.epoch = self._epoch
        self._state_dict = {"epoch": self._epoch, "examples_iterable": ex._state_dict}
        if self._starting_state_dict is not None and \
                self._starting_state_dict["epoch"] == self._epoch:
            ex.load_state_dict(self._starting_state_dict["examples_iterable"], self.fixed)
            if self.fixed:
                self._state_dict["examples_iterable"] = ex._state_dict
        else:
            ex._state_dict.update({"shard_idx": 0, "shard_example_idx": 0})
        self._starting_state_dict = None
        return ex

    def __iter__(self):
        yield from self._prepare_ex_iterable_for_iteration()

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state_dict)

    def load_state_dict(self, state: dict) -> None:
        self._starting_state_dict = copy.deepcopy(state)
        self._epoch = state["epoch"]


# transformers#26413 -------------------------------------------------------------------------

class ShardedTextStream(torch.utils.data.IterableDataset):
    """A stream of shards whose `len()` is the shard count, resumed the Trainer's way: the
    checkpoint holds `global_step`; on resume the first `global_step % len(dataloader)` steps
    of epoch `global_step // len(dataloader)` are skipped."""

    def __init__(self, seed: int):
        self.seed, self.epoch = seed, 0
        self.global_step = 0  # examples trained on since the run began (batch size 1)
        self.steps_trained_in_current_epoch = 0

    def __len__(self) -> int:
        return TRAIN // SHARD  # the number of shards, as a sharded stream states it

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        skip, self.steps_trained_in_current_epoch = self.steps_trained_in_current_epoch, 0
        for step, row in enumerate(rows_of(self.seed, self.epoch)):
            if step < skip:
                continue
            self.global_step += 1
            yield row

    def state_dict(self) -> dict:
        return {"global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        self.global_step = state["global_step"]
        num_update_steps_per_epoch = len(self)
        self.epoch = self.global_step // num_update_steps_per_epoch
        self.steps_trained_in_current_epoch = self.global_step % num_update_steps_per_epoch


# litData#649 --------------------------------------------------------------------------------

class CyclingStreamingDataset(torch.utils.data.IterableDataset):
    """Saves its state and moves its epoch on at the end of `__iter__`, as the report's
    ParallelStreamingDataset does: a pass broken off early commits nothing, so the next
    `iter()` yields the same samples again. `set_epoch` is read when the dataset first starts
    (a fresh dataset opened at a later epoch), afterwards its own committed state rules."""

    def __init__(self, seed: int):
        self.seed = seed
        self.current_epoch = 0
        self._requested_epoch = 0
        self.num_samples_yielded = 0
        self.restore = False
        self._state: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        self._requested_epoch = epoch

    def __iter__(self):
        if self._state is None:  # the first iter(): start where the loop asks
            self._state = {"current_epoch": self._requested_epoch, "num_samples_yielded": 0}
        if not self.restore:
            self.current_epoch = self._state["current_epoch"]
            self.num_samples_yielded = 0
        self.restore = False
        rows = rows_of(self.seed, self.current_epoch)
        for row in rows[self.num_samples_yielded:]:
            self.num_samples_yielded += 1
            yield row
        # the end of iter(): save the state, move the epoch on
        self._state = {"current_epoch": self.current_epoch + 1, "num_samples_yielded": 0}

    def state_dict(self) -> dict:
        return {"current_epoch": self.current_epoch,
                "num_samples_yielded": self.num_samples_yielded}

    def load_state_dict(self, state: dict) -> None:
        self.current_epoch = state["current_epoch"]
        self._state = dict(state)
        self.num_samples_yielded = state["num_samples_yielded"]
        self.restore = True


# the clean twin -----------------------------------------------------------------------------

class StatefulStream(torch.utils.data.IterableDataset):
    def __init__(self, seed: int):
        self.seed, self.epoch, self.position = seed, 0, 0
        self._resume: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        start, resume, self._resume = 0, self._resume, None
        if resume is not None and resume["epoch"] == self.epoch:
            start = resume["position"]
        rows = rows_of(self.seed, self.epoch)
        for k in range(start, len(rows)):
            self.position = k + 1
            yield rows[k]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._resume = dict(state)


STREAMS = {"stale_reference": StreamingIterableDataset, "trainer_skip": ShardedTextStream,
           "commit_at_end": CyclingStreamingDataset, "stateful": StatefulStream,
           "stale_reference_fixed": lambda seed: StreamingIterableDataset(seed, fixed=True)}


def task(stream: str = "stateful") -> wb.Task:
    make = STREAMS[stream]
    return wb.Task(
        name=f"stream-{stream}", kind="classification",
        load_examples=lambda: list(EXAMPLES), encode=encode,
        collate=torch.utils.data.default_collate,
        build_model=lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)),
        decode=lambda ids: ", ".join(CLASSES[int(i)] for i in ids),
        model_inputs=("x",), label_names=CLASSES, label_field="label",
        split_of=split_of, lr=1e-2,
        train_pipeline=lambda seed: make(seed))
