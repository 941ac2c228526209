"""Notebook 01's one pass (notebooks/inspection/scanning.py, contract/hash_index.py): a stream of
any length is scanned once with only its first examples kept whole, a prefix or a seeded sample
when asked, and a finding far past the kept examples is still counted and named."""

import itertools

import pytest
import torch

import workbook as wb
from workbook.contract import hash_index
from workbook.notebooks.inspection import inspect_task, scan_tally, scanning

NAMES = ["no", "yes"]


def row(i: int) -> dict:
    """Example i: patient i // 4, every input its own."""
    return {"id": i, "patient": f"p{i // 4}", "label": NAMES[i % 2], "x": [i / 1000, i % 7 / 7]}


class Counted:
    def __init__(self, n: int | None):
        self.n = n

    def __iter__(self):
        return (row(i) for i in (itertools.count() if self.n is None else range(self.n)))


def task_over(source) -> wb.Task:
    """Patients whose number ends in 0 are validation, the rest train (a rule of the task's)."""
    return wb.Task(
        name="points", kind="classification", load_examples=lambda: source,
        encode=lambda ex: {"x": torch.tensor(ex["x"]),
                           "labels": torch.tensor(NAMES.index(ex["label"]))},
        collate=torch.utils.data.default_collate, build_model=lambda: torch.nn.Linear(2, 2),
        decode=lambda ids: ", ".join(NAMES[int(i)] if 0 <= int(i) < 2 else f"<{int(i)}?>"
                                     for i in ids),
        group_key="patient", model_inputs=("x",), label_names=NAMES, label_field="label",
        split_of=lambda ex: "validation" if int(ex["id"]) // 4 % 10 == 0 else "train")


def test_the_hash_index_finds_repeats_within_and_across_blocks(monkeypatch):
    monkeypatch.setattr(hash_index, "BLOCK", 4)
    seen = []
    index = hash_index.HashIndex(lambda what, prior, bit: seen.append((what, prior, bit)))
    for key, bit in [("a", 1), ("b", 1), ("a", 2), ("c", 4), ("b", 1), ("d", 1), ("a", 1),
                     ("e", 2), ("c", 4), ("f", 1)]:
        index.add(hash_index.key_of(key), bit, key)
    index.flush()
    assert seen == [("a", 1, 2), ("b", 1, 1), ("a", 3, 1), ("c", 4, 4)]
    assert [index.count(), index.count(1), index.count(2), index.count(4)] == [6, 4, 2, 1]
    assert index.count(crossing=True) == 1  # only "a" sits in two splits


@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_the_hash_index_agrees_with_a_plain_dict(block, monkeypatch):
    import random

    monkeypatch.setattr(hash_index, "BLOCK", block)
    rng = random.Random(block)
    expected, reported, masks = [], [], {}
    index = hash_index.HashIndex(lambda i, prior, bit: reported.append((i, prior, bit)))
    for i in range(500):
        key, bit = rng.randint(0, 60), 1 << rng.randint(0, 2)
        if masks.get(key):
            expected.append((i, masks[key], bit))
        masks[key] = masks.get(key, 0) | bit
        index.add(hash_index.key_of(str(key)), bit, i)
    index.flush()
    assert sorted(reported) == expected
    assert index.count() == len(masks)
    assert [index.count(b) for b in (1, 2, 4)] == [sum(1 for m in masks.values() if m & b)
                                                   for b in (1, 2, 4)]
    assert index.count(crossing=True) == sum(1 for m in masks.values() if m & (m - 1))


@pytest.mark.parametrize("block", [5, 64, 1000])
def test_the_hash_index_takes_keys_one_or_many_at_a_time(block, monkeypatch):
    """Keys added singly and a chunk at once, over many merges of its sorted runs."""
    import random

    import numpy as np

    monkeypatch.setattr(hash_index, "BLOCK", block)
    rng = random.Random(block)
    expected, reported, masks = [], [], {}
    index = hash_index.HashIndex(lambda i, prior, bit: reported.append((i, prior, bit)))
    i = 0
    while i < 6000:
        chunk = [(rng.randint(0, 3000), 1 << rng.randint(0, 2)) for _ in range(rng.randint(1, 90))]
        for n, (key, bit) in enumerate(chunk):
            if masks.get(key):
                expected.append((i + n, masks[key], bit))
            masks[key] = masks.get(key, 0) | bit
        if rng.random() < 0.3:
            for n, (key, bit) in enumerate(chunk):
                index.add(hash_index.key_of(str(key)), bit, i + n)
        else:
            index.add_many(hash_index.keys_of([str(k) for k, _ in chunk]),
                           np.array([b for _, b in chunk]), range(i, i + len(chunk)))
        i += len(chunk)
    assert index.count() == len(masks)
    assert reported == expected  # in the order the keys came
    assert index.count(crossing=True) == sum(1 for m in masks.values() if m & (m - 1))
    assert [index.count(b) for b in (1, 2, 4)] == [sum(1 for m in masks.values() if m & b)
                                                   for b in (1, 2, 4)]
    assert list(index.keys) == sorted(hash_index.key_of(str(k)) for k in masks)


def test_a_stream_without_a_length_is_scanned_whole_and_passes():
    ins = inspect_task(task_over(Counted(3000)))
    assert ins.verdict == "pass", ins.flag_table()
    assert ins.figures["examples"] == 3000 and ins.figures["scanned"] == "the whole source"
    assert ins.split_table.examples.sum() == 3000
    assert ins.coverage.examples.sum() == 3000  # the histogram counts every example


def test_an_endless_stream_without_a_limit_stops_at_its_bound_and_says_so(monkeypatch):
    monkeypatch.setattr(scanning, "UNSIZED_MOST", 1200)
    endless = inspect_task(task_over(Counted(None)))
    assert endless.figures["examples"] == 1200
    assert endless.figures["scanned"].startswith("the first 1,200 examples (the source has no "
                                                 "length and had not ended there")


def test_a_prefix_and_a_seeded_sample_are_said():
    first = inspect_task(task_over(Counted(None)), limit=500)  # endless: the limit ends it
    assert first.figures["examples"] == 500
    assert first.figures["scanned"] == "the first 500 examples"
    half = inspect_task(task_over(Counted(2000)), sample=0.5, seed=3)
    again = inspect_task(task_over(Counted(2000)), sample=0.5, seed=3)
    assert 850 < half.figures["examples"] < 1150
    assert half.figures["examples"] == again.figures["examples"]
    assert half.figures["scanned"] == "a seeded sample of 50%"
    with pytest.raises(wb.WorkbookError, match="scan_sample"):
        inspect_task(task_over(Counted(10)), sample=1.5)


def test_findings_past_the_kept_examples_are_counted_and_named(monkeypatch):
    monkeypatch.setattr(scanning, "KEEP", 16)
    monkeypatch.setattr(hash_index, "BLOCK", 128)

    def late_trouble():
        for i in range(2000):
            ex = row(i)
            if i == 1500:  # a train row of patient p0, whose rows 0-3 are validation
                ex["patient"] = "p0"
            if i in (1700, 1720):  # one input in train (patient 425) and validation (430)
                ex["x"] = [123.0, 4.0]
            yield ex

    ins = inspect_task(task_over(late_trouble()))
    assert all(len(v) <= 16 for v in ins.items.values())
    flags = {f.check: f for f in ins.flags}
    assert flags["group crosses splits"].examples == ["p0"]
    assert flags["group crosses splits"].count == 1
    assert flags["duplicate input crosses splits"].count == 1
    assert "1720" in flags["duplicate input crosses splits"].examples[0]
    assert ins.figures["examples"] == 2000
    assert {f.check for f in inspect_task(task_over(Counted(2000))).flags} == set()


def test_label_ids_far_into_a_stream_are_checked_against_the_model(monkeypatch):
    monkeypatch.setattr(scanning, "KEEP", 8)
    bad = task_over(Counted(1200))
    bad.encode = lambda ex: {"x": torch.tensor(ex["x"]), "labels": torch.tensor(
        NAMES.index(ex["label"]) if ex["id"] < 1100 else 7)}
    found = {f.check: f for f in inspect_task(bad).flags}["label ids out of range"]
    assert found.count == 100 and all(i >= 1100 for i in found.examples)



@pytest.mark.parametrize("keep", [1, 5000])  # probed at once / only after the stream ended
def test_label_ids_held_for_the_probe_are_checked_as_those_that_come_after_it(keep):
    bad = task_over(Counted(1200))
    bad.encode = lambda ex: {"x": torch.tensor(ex["x"]), "labels": torch.tensor(
        7 if ex["id"] % 97 == 3 else NAMES.index(ex["label"]))}
    found = scanning.scan(bad, keep=keep, probe=lambda kept: 2, workers=0).out_of_range
    # example 3 is in validation, whose rows are counted after the block's train rows
    assert found.examples == 13 and found.ids == [100, 197, 294, 391, 488]
    assert scanning.scan(task_over(Counted(1200)), keep=keep, probe=lambda kept: 2,
                         workers=0).out_of_range.examples == 0

def test_inputs_of_other_lengths_or_dtypes_are_not_called_identical():
    """[1, 2] + [3] is not [1] + [2, 3]; a bf16 input is hashed, not refused."""
    def pairs():
        for i in range(400):
            src, tgt = ([1, 2], [3]) if i // 4 % 10 else ([1], [2, 3])  # validation: the other
            yield {"id": i, "patient": f"p{i // 4}", "label": NAMES[i % 2], "src": src,
                   "tgt": tgt, "x": [i / 1000, 0.5]}

    task = task_over(pairs())
    task.model_inputs = ("src", "tgt", "x")
    task.encode = lambda ex: {"src": torch.tensor(ex["src"]), "tgt": torch.tensor(ex["tgt"]),
                              "x": torch.tensor(ex["x"]).bfloat16(),
                              "labels": torch.tensor(NAMES.index(ex["label"]))}
    task.collate = lambda items: {k: torch.nn.utils.rnn.pad_sequence(
        [it[k].reshape(-1) for it in items], batch_first=True) if k != "labels" else
        torch.stack([it[k] for it in items]) for k in items[0]}
    task.build_model = lambda: Pairs()
    ins = inspect_task(task)
    assert "duplicate input crosses splits" not in {f.check for f in ins.flags}


class Pairs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(2, 2)

    def forward(self, src, tgt, x):
        return self.out(x.float())


def test_an_empty_split_is_named_with_what_was_scanned():
    task = task_over(Counted(400))
    task.split_of = lambda ex: "train" if ex["id"] < 100 else "validation"
    with pytest.raises(wb.WorkbookError, match="(?s)validation split .* is empty in the first 30 "
                                               "examples .*scan more of the source"):
        inspect_task(task, limit=30)
    with pytest.raises(wb.WorkbookError, match="drew none of the 64 examples"):
        inspect_task(task_over(Counted(64)), sample=0.001)


def test_a_group_in_two_splits_is_named_once():
    task = task_over(Counted(400))
    task.split_of = lambda ex: "validation" if ex["id"] % 2 else "train"  # by example
    found = {f.check: f for f in inspect_task(task).flags}["group crosses splits"]
    assert found.count == 100 and len(set(found.examples)) == len(found.examples) == 5


def test_input_keys_tell_inputs_apart_as_their_bytes_do_in_any_chunk():
    """The vectorised key of an input equals another's exactly when name, dtype, shape and
    bytes do, whatever else its chunk holds."""
    from workbook.contract.data import Item

    values = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32),
              torch.tensor([[1, 2, 3]]), torch.tensor([1, 2]), torch.tensor([0.0, -0.0]),
              torch.tensor([0.0, 0.0]), torch.tensor([1.5, 2.0]).bfloat16(), torch.tensor(7),
              torch.tensor([True, False]), torch.tensor([1 + 2j], dtype=torch.complex128),
              torch.tensor([3, 2, 1]), torch.tensor([1.0], requires_grad=True),
              torch.tensor([], dtype=torch.long)]

    def item(i, j):
        return Item(i, {"a": values[i % len(values)], **({"b": values[j]} if j >= 0 else {})})

    pairs = [(i, j) for i in range(len(values)) for j in (-1, 0, 4, 9)]
    task = task_over([])
    task.model_inputs = ("a", "b")

    def raw(it):
        return b"".join(n.encode() + b"|" + str(t.dtype).encode() + str(tuple(t.shape)).encode()
                        + t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
                        for n, t in it.tensors.items())

    def keys(*chunks):
        return scan_tally._input_keys([scan_tally._digest(task, c, {}) for c in chunks],
                                    [len(c) for c in chunks])

    whole = keys([item(i, j) for i, j in pairs])
    alone = [int(keys([item(i, j)])[0]) for i, j in pairs]
    assert [int(k) for k in keys(*([item(*p)] for p in pairs))] == alone
    assert [int(k) for k in whole] == alone
    same = {(raw(item(*p)), raw(item(*q))): whole[a] == whole[b]
            for a, p in enumerate(pairs) for b, q in enumerate(pairs)}
    assert all(equal == (x == y) for (x, y), equal in same.items())
