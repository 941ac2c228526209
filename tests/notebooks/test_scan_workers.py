"""Notebook 01's pass on several processes (notebooks/inspection/scanning.py's workers,
base/forked.py): with workers the figures, flags and kept examples are exactly those of one
process, planted trouble far into the stream included; a worker that raises or dies is named, and
no process is left behind (the pool itself: tests/base/test_forked.py)."""

import math
import multiprocessing
import os
import signal

import pytest
import torch

import workbook as wb
from tests.notebooks.test_scan import NAMES, Counted, row, task_over
from workbook.base import forked
from workbook.base.forked import WorkerTraceback
from workbook.notebooks.inspection import inspect_task, scanning

pytestmark = pytest.mark.skipif(not forked.fork_available(), reason="workers are forked (Linux)")
PARENT = os.getpid()


def troubled(n: int = 6000):
    """Rows of `row`, with trouble planted past the first blocks: a train row of validation's
    group p0, one input in train and validation, label id 7 (the model has 2 outputs), a NaN
    input, a row without its group."""
    for i in range(n):
        ex = row(i)
        if i == 4500:
            ex["patient"] = "p0"
        if i in (3000, 5325):  # patient 750 is validation, 1331 train
            ex["x"] = [9.0, 9.0]
        if i in (2600, 5900):
            ex["label"] = "seven"
        if i == 3333:
            ex["x"] = [math.nan, 0.0]
        if i == 5555:
            del ex["patient"]
        yield ex


def troubled_task() -> wb.Task:
    task = task_over(None)
    task.load_examples = troubled
    task.encode = lambda ex: {"x": torch.tensor(ex["x"]), "labels": torch.tensor(
        7 if ex["label"] == "seven" else NAMES.index(ex["label"]))}
    return task


def seen(ins) -> dict:
    """What a page shows of an inspection: figures, flags, tables and the examples kept."""
    return {"figures": {k: v for k, v in ins.figures.items() if k != "scan_workers"},
            "flags": [(f.check, f.count, f.examples) for f in ins.flags],
            "splits": ins.split_table.to_dict("records"),
            "coverage": ins.coverage.to_dict("records"),
            "classes": None if ins.classes is None else ins.classes.to_dict("records"),
            "kept": {name: [it.id for it in items] for name, items in ins.items.items()},
            "raw": {name: [ex["id"] for ex in rows] for name, rows in ins.splits.items()}}


def test_workers_find_what_one_process_finds(monkeypatch):
    monkeypatch.setattr(scanning, "KEEP", 700)  # kept examples span blocks and workers
    with pytest.raises(wb.WorkbookError, match="1 of 6000 examples have no group key"):
        inspect_task(troubled_task(), workers=0)
    task = troubled_task()
    task.load_examples = lambda: (ex for ex in troubled() if "patient" in ex)
    alone = inspect_task(task, workers=0)
    assert alone.figures["scan_workers"] == 0
    checks = {f.check for f in alone.flags}
    assert {"group crosses splits", "duplicate input crosses splits",
            "label ids out of range", "non-finite inputs", "label map round trip"} <= checks, checks
    for workers in sorted({1, min(2, forked.cores())}):
        beside = inspect_task(task, workers=workers)
        assert beside.figures["scan_workers"] == workers
        assert seen(beside) == seen(alone)
    assert multiprocessing.active_children() == []


def test_a_small_source_is_scanned_in_one_process():
    ins = inspect_task(task_over(Counted(scanning.FORK_FROM - 1)))
    assert ins.figures["scan_workers"] == 0 and ins.verdict == "pass"


def test_a_worker_whose_encode_raises_names_the_example():
    task = task_over(Counted(5000))
    encode = task.encode

    def failing(ex):
        if ex["id"] == 4321:
            raise ValueError("no such token")
        return encode(ex)

    task.encode = failing
    with pytest.raises(wb.WorkbookError, match="encode failed on example 4321") as raised:
        inspect_task(task, workers=1)
    assert isinstance(raised.value.__cause__, (ValueError, WorkerTraceback))
    assert multiprocessing.active_children() == []


def test_a_worker_that_dies_is_named_with_its_signal():
    task = task_over(Counted(6000))
    encode = task.encode

    def dying(ex):
        if os.getpid() != PARENT:  # only a worker: the block it is sent first
            os.kill(os.getpid(), signal.SIGKILL)
        return encode(ex)

    task.encode = dying
    with pytest.raises(wb.WorkbookError, match=r"(?s)worker 0 \(pid \d+\) died \(killed by "
                                               r"signal 9, out of memory\?\).*scan_workers=0"):
        inspect_task(task, workers=1)
    assert multiprocessing.active_children() == []


def test_examples_that_cannot_be_sent_to_a_worker_are_named():
    task = task_over(None)
    task.load_examples = lambda: ({**row(i), "hook": lambda: None} for i in range(5000))
    with pytest.raises(wb.WorkbookError, match=r"(?s)raw examples at positions \d+-\d+ cannot "
                                               "be sent.*scan_workers=0"):
        inspect_task(task, workers=1)
    assert inspect_task(task, workers=0).verdict == "pass"
    assert multiprocessing.active_children() == []


def test_an_interrupted_scan_leaves_no_worker():
    def interrupted():
        for i in range(6000):
            if i == 5000:
                raise KeyboardInterrupt
            yield row(i)

    task = task_over(None)
    task.load_examples = interrupted
    with pytest.raises(KeyboardInterrupt):
        inspect_task(task, workers=1)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("asked, said", [(-2, "an integer >= -1"), (True, "an integer >= -1"),
                                         (10_000, "give scan_workers <=")])
def test_a_count_of_workers_that_cannot_be_is_refused(asked, said):
    with pytest.raises(wb.WorkbookError, match=said):
        scanning.scan_workers(asked)


def test_kept_tensors_packed_for_the_trip_come_back_as_they_were():
    import pickle

    from workbook.notebooks.inspection.scan_block import Packed

    window = torch.arange(65)
    kept = {"train": [(0, {"input_ids": window[:-1], "labels": window[1:],
                           "x": torch.randn(2, 3).bfloat16(), "label": torch.tensor(3),
                           "note": "as it is"}),
                      (5, {"input_ids": torch.arange(3), "labels": torch.tensor([1, -100, 2])})],
            "test": [(2, {"input_ids": torch.zeros(0, dtype=torch.long),
                          "labels": torch.zeros(0, dtype=torch.long)})]}
    back = pickle.loads(pickle.dumps(Packed(kept))).unpack()
    assert back.keys() == kept.keys()
    for name in kept:
        for (i, sent), (j, came) in zip(kept[name], back[name], strict=True):
            assert i == j and sent.keys() == came.keys()
            for key, value in sent.items():
                if isinstance(value, torch.Tensor):
                    assert came[key].dtype == value.dtype and came[key].shape == value.shape
                    assert torch.equal(came[key], value)
                else:
                    assert came[key] == value

