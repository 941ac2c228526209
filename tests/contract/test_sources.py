"""Data sources that are not a list (contract/sources.py): a generator, a map-style dataset read
by index, a torch IterableDataset - drawn the first N of a split without reading the rest,
every row checked as it passes, and a source that fails named with its position."""

import itertools

import pytest
import torch
from torch import nn

import workbook as wb
from workbook.contract.data import load_examples, prepare

NAMES = ["no", "yes"]


def row(i: int) -> dict:
    return {"id": i, "patient": f"p{i // 4}", "label": NAMES[i % 2], "x": [float(i % 7), 1.0]}


class Counted:
    """A stream of rows that counts how many were read."""

    def __init__(self, n: int | None):
        self.n, self.read = n, 0

    def __iter__(self):
        for i in itertools.count() if self.n is None else range(self.n):
            self.read += 1
            yield row(i)


class Indexed:
    """A map-style dataset (len and getitem, as a memory-mapped datasets.Dataset) that counts
    the rows it was asked for."""

    def __init__(self, n: int):
        self.n, self.asked = n, set()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.asked.add(i)
        return row(i)


def task_over(source) -> wb.Task:
    return wb.Task(
        name="points", kind="classification", load_examples=lambda: source,
        encode=lambda ex: {"x": torch.tensor(ex["x"]),
                           "labels": torch.tensor(NAMES.index(ex["label"]))},
        collate=torch.utils.data.default_collate,
        build_model=lambda: nn.Linear(2, 2), decode=lambda ids: ", ".join(NAMES[int(i)]
                                                                       for i in ids),
        group_key="patient", model_inputs=("x",), label_names=NAMES, label_field="label")


def test_the_first_rows_of_a_split_are_drawn_from_a_long_stream_without_reading_the_rest():
    stream = Counted(1_000_000)
    data = prepare(task_over(stream), ("train",), {"train": 8, "validation": 4})
    assert len(data.train) == 8 and len(data.raw["validation"]) == 4
    assert data.raw["test"] == []  # a split nobody asked for is not held
    assert stream.read < 200  # about (8 + 4) / 0.9 rows, not a million


def test_an_endless_stream_with_limits_ends():
    stream = Counted(None)
    data = prepare(task_over(stream), ("train", "validation"), {"train": 5, "validation": 3})
    assert [len(data.train), len(data.validation)] == [5, 3]


def test_the_first_rows_are_the_same_as_those_of_the_whole_list():
    whole = prepare(task_over([row(i) for i in range(400)]), ("train",))
    drawn = prepare(task_over(Counted(400)), ("train",), {"train": 10})
    assert [it.id for it in drawn.train] == [it.id for it in whole.train[:10]]


def test_a_map_style_dataset_is_read_by_index_and_only_as_far_as_needed():
    source = Indexed(100_000)
    data = prepare(task_over(source), ("train",), {"train": 6, "validation": 2})
    assert len(data.train) == 6 and max(source.asked) < 100
    assert len(load_examples(task_over(Indexed(50)))) == 50


def test_a_torch_iterable_dataset_is_a_source():
    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (row(i) for i in range(60))

    assert len(prepare(task_over(Rows()), ("train",)).train) > 30


def test_a_source_that_fails_while_read_is_named_with_its_position():
    def broken():
        for i in range(10):
            if i == 7:
                raise OSError("shard-00003.jsonl: unexpected end of data")
            yield row(i)

    with pytest.raises(wb.WorkbookError, match="failed at position 7: .*shard-00003"):
        prepare(task_over(broken()), ("train",))


@pytest.mark.parametrize("source, message", [
    ({"id": 1}, "returned a dict, not examples"),
    ("data.jsonl", "returned a str, not examples"),
    (42, "returned a int, not examples"),
    ([], "returned no examples"),
])
def test_what_is_not_a_source_of_examples_is_named(source, message):
    with pytest.raises(wb.WorkbookError, match=message):
        prepare(task_over(source))


def test_bad_rows_are_counted_over_what_was_read():
    rows = [row(i) for i in range(12)]
    rows[5] = ["not", "a", "dict"]
    with pytest.raises(wb.WorkbookError, match=r"1 of 12 raw examples are not dicts \(e.g. "
                                               r"position 5 is a list\)"):
        prepare(task_over(iter(rows)))
    rows[5] = row(3)
    with pytest.raises(wb.WorkbookError, match="ids are not unique"):
        load_examples(task_over(rows))


def test_an_iterable_dataset_with_a_length_is_iterated_not_indexed():
    class Sized(torch.utils.data.IterableDataset):  # inherits Dataset's raising __getitem__
        def __iter__(self):
            return (row(i) for i in range(40))

        def __len__(self):
            return 40

    assert len(load_examples(task_over(Sized()))) == 40


def test_a_used_up_generator_says_a_fresh_iterable_is_needed():
    rows = (row(i) for i in range(400))
    task = task_over(rows)
    prepare(task, ("train",))
    with pytest.raises(wb.WorkbookError, match="a new iterable on every call"):
        prepare(task, ("train",))


def test_bad_rows_name_a_few_and_count_all():
    rows = [{"id": i, "label": "no", "x": [0.0, 1.0]} for i in range(10_000)]  # no patient
    with pytest.raises(wb.WorkbookError, match=r"10000 of 10000 examples have no group key "
                                               r"'patient' \(positions \[0, 1, 2, 3, 4\]\.\.\.\)"):
        load_examples(task_over(rows))


def test_a_pandas_data_frame_is_named_with_the_fix():
    import pandas as pd

    frame = pd.DataFrame([row(i) for i in range(40)])
    with pytest.raises(wb.WorkbookError, match=r"(?s)returned a pandas DataFrame.*"
                                               r"to_dict\('records'\)"):
        prepare(task_over(frame), ("train",))
    assert len(load_examples(task_over(frame.to_dict("records")))) == 40


def test_an_endless_stream_with_a_split_asked_whole_is_refused_not_read_forever(monkeypatch):
    from workbook.contract import sources

    monkeypatch.setattr(sources, "WHOLE_MOST", 5_000)
    stream = Counted(None)
    with pytest.raises(wb.WorkbookError, match="(?s)read 5,000 rows of task 'points'.*the "
                       "validation split is asked whole: an endless stream.*validation_limit"):
        prepare(task_over(stream), ("train", "validation"), {"train": 5})
    assert stream.read == 5_001
    data = prepare(task_over(Counted(4_000)), ("train", "validation"), {"train": 5})
    assert len(data.validation) > 300  # a stream that ends below the bar is read whole
