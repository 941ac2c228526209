"""A torch `IterableDataset` that shards itself across DataLoader workers by
`torch.utils.data.get_worker_info()` and keeps its own position, read through torchdata's
`StatefulDataLoader(num_workers=2)` - the idiom of torchdata's README and PyTorch's
IterableDataset docs (each worker takes a contiguous range; `state_dict` / `load_state_dict`
on the dataset, which StatefulDataLoader calls inside each worker):

    class WindowRange(IterableDataset):
        def __iter__(self):
            info = get_worker_info()            # this worker's contiguous share
            for k in range(self.position, len(share)): self.position = k + 1; yield ...
        def state_dict(self): return {"epoch": self.epoch, "position": self.position}

    python -m workbook pilot --task examples.worker_shards:task --smoke --only 07,09

The data and model are examples/token_stream.py's (windows of a uint16 token file, a small
GPT); only the training pipeline differs: this rank's windows (`shards[rank::world]` of
shards of 16), in an order shuffled per pass (`set_epoch`), split between two workers.

`pipeline_bug="reset_in_iter"` plants the report's mistake: `__iter__` starts each worker at
its share's beginning, so the position load_state_dict gave back (restored before the
iterator is made) is dropped - 07 names it "the pass restarted from its beginning on
restore". Other options: token_stream's (`data_file`, `block_size`, model size).
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import partial

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from examples.token_stream import TokenStream
from examples.token_stream import make_task as token_task
from workbook.contract.task import split_by_group_hash

BUGS = ("reset_in_iter",)
WORKERS = 2


class WindowRange(IterableDataset):
    """This rank's windows of a pass, each worker a contiguous range of them; its position
    (the pass and the windows this worker has yielded) is its state."""

    def __init__(self, stream: TokenStream, train: list[int], seed: int, rank: int, world: int,
                 shard: int = 16, bug: str = ""):
        self.stream, self.seed, self.bug = stream, seed, bug
        shards = [train[i:i + shard] for i in range(0, len(train), shard)]
        self.shards = shards[rank::world]
        self.epoch, self.position = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def share(self) -> list[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards))
        windows = [w for s in order for w in self.shards[s]]
        info = get_worker_info()
        if info is None:
            return windows
        per = -(-len(windows) // info.num_workers)
        return windows[info.id * per:(info.id + 1) * per]

    def __iter__(self):
        windows = self.share()
        if self.bug == "reset_in_iter":
            self.position = 0  # each pass "starts at the worker's share", the loaded one too
        block, group = self.stream.block_size, self.stream.group_windows
        for k in range(self.position, len(windows)):
            self.position = k + 1
            w = windows[k]
            yield {"id": w, "group": w // group, "start": w * block}
        self.position = 0  # the pass is over: the next starts at the beginning

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def train_pipeline(stream: TokenStream, bug: str, seed: int, rank: int = 0, world: int = 1):
    """A StatefulDataLoader over this rank's WindowRange, two workers, one raw example at a
    time (batch_size=None), its own generator."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    warnings.filterwarnings("ignore", "'set_vital' is deprecated")  # torchdata 0.11's own
    train = [w for w in range(stream.windows())
             if split_by_group_hash(w // stream.group_windows, (0.8, 0.1, 0.1)) == "train"]
    return StatefulDataLoader(WindowRange(stream, train, seed, rank, world, bug=bug),
                              batch_size=None, num_workers=WORKERS,
                              generator=torch.Generator().manual_seed(seed))


def make_task(pipeline_bug: str = "", **options) -> "wb.Task":  # noqa: F821
    if pipeline_bug and pipeline_bug not in BUGS:
        raise ValueError(f"pipeline_bug {pipeline_bug!r} is not one of {BUGS}")
    task = token_task(**options)
    stream = task.train_pipeline.args[0]  # token_stream's partial(train_pipeline, stream, ...)
    return dataclasses.replace(task, name="worker-shards",
                               train_pipeline=partial(train_pipeline, stream, pipeline_bug))


task = make_task
