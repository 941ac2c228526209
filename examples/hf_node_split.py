"""A Hugging Face `datasets` streaming IterableDataset split between ranks with
`datasets.distributed.split_dataset_by_node(stream, rank=rank, world_size=world)` and resumed
by its own `state_dict()` / `load_state_dict()` - the stream itself is the training pipeline,
without a DataLoader, as datasets' "Stream" docs write a checkpointed loop:

    stream = load_dataset("json", data_files=shards, split="train", streaming=True)
    stream = split_dataset_by_node(stream.filter(is_train), rank=rank, world_size=world)
    state = stream.state_dict()   ...   stream.load_state_dict(state)

    python -m workbook pilot --task examples.hf_node_split:task --smoke --only 07,09

The shards, tokenizer and model are examples/hf_stream.py's (local JSONL shards, nothing is
downloaded); the stream is not shuffled, so every pass reads the rows in one order.

`pipeline_bug="skip_steps"` plants the resume written before streams had a state
(huggingface/transformers#26413: a Trainer skips `steps_done` batches of the pass it opens,
as accelerate's `skip_first_batches` does): the state is the examples read since the run
began, and a resume skips that many of this rank's rows from the pass's start - a stream has
no length to divide them by, so after the first pass the skip lands past the place the run
had reached. 07 and 09 name it "the resume skipped by a length
the stream does not have". Other options: hf_stream's (`data_dir`, `shards`, `rows`, model
size).
"""

from __future__ import annotations

import dataclasses
from functools import partial

from examples.hf_stream import FRACTIONS, Shards
from examples.hf_stream import make_task as stream_task
from workbook.contract.task import split_by_group_hash

BUGS = ("skip_steps",)


class SkipSteps:
    """The stream resumed by skipping the examples read since the run began: the planted bug."""

    def __init__(self, stream):
        self.stream, self.seen, self.skip = stream, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for k, row in enumerate(self.stream):  # accelerate's skip_first_batches, by rows
            if k >= skip:
                self.seen += 1
                yield row

    def state_dict(self) -> dict:
        return {"seen": self.seen}  # a Trainer's steps done, in examples

    def load_state_dict(self, state: dict) -> None:
        self.seen = self.skip = state["seen"]


def train_pipeline(data: Shards, bug: str, seed: int, rank: int = 0, world: int = 1):
    """The train split's rows, this rank's share by split_dataset_by_node; the datasets
    IterableDataset itself (its own state_dict), or the planted SkipSteps around it."""
    from datasets.distributed import split_dataset_by_node

    stream = data.stream(keep=lambda row: split_by_group_hash(
        row["conversation"], FRACTIONS) == "train")
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return SkipSteps(stream) if bug == "skip_steps" else stream


def make_task(pipeline_bug: str = "", **options) -> "wb.Task":  # noqa: F821
    if pipeline_bug and pipeline_bug not in BUGS:
        raise ValueError(f"pipeline_bug {pipeline_bug!r} is not one of {BUGS}")
    task = stream_task(**options)
    data = task.train_pipeline.args[0]  # hf_stream's partial(train_pipeline, data, ...)
    return dataclasses.replace(task, name="hf-node-split",
                               train_pipeline=partial(train_pipeline, data, pipeline_bug))


task = make_task
