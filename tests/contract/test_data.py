import dataclasses

import pytest

from workbook import WorkbookError, load_examples, read_jsonl, split_examples
from workbook.contract.data import epoch_order, epoch_updates


def test_malformed_jsonl_line_reports_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": 1}\n\n{"id": 2,\n')
    with pytest.raises(WorkbookError, match=r"d\.jsonl:3: malformed JSON"):
        read_jsonl(path)


def test_non_object_line_and_empty_file_and_missing_file(tmp_path):
    (tmp_path / "a.jsonl").write_text('[1, 2]\n')
    with pytest.raises(WorkbookError, match="a.jsonl:1: expected a JSON object"):
        read_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(WorkbookError, match="holds no examples"):
        read_jsonl(tmp_path / "e.jsonl")
    with pytest.raises(WorkbookError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_missing_group_key_names_the_field(gen_task):
    rows = [{"id": 1, "conversation": "a"}, {"id": 2}, {"id": 3, "conversation": ""}]
    task = dataclasses.replace(gen_task, load_examples=lambda: rows)
    with pytest.raises(WorkbookError, match="2 of 3 examples have no group key 'conversation'"):
        load_examples(task)


def test_duplicate_ids_and_empty_dataset(gen_task):
    with pytest.raises(WorkbookError, match="not unique"):
        load_examples(dataclasses.replace(gen_task, load_examples=lambda: [
            {"id": 1, "conversation": "a"}, {"id": 1, "conversation": "b"}]))
    with pytest.raises(WorkbookError, match="returned no examples"):
        load_examples(dataclasses.replace(gen_task, load_examples=lambda: []))


def test_empty_split_is_an_error(gen_task):
    rows = [{"id": i, "conversation": "only-one"} for i in range(5)]
    task = dataclasses.replace(gen_task, load_examples=lambda: rows)
    with pytest.raises(WorkbookError, match="split of task .* is empty"):
        split_examples(task, load_examples(task))


def test_group_split_keeps_groups_together_and_has_enough_training_examples(gen_task):
    splits = split_examples(gen_task, load_examples(gen_task))
    owner = {}
    for name, rows in splits.items():
        for row in rows:
            assert owner.setdefault(row["conversation"], name) == name
    # the worked example: 2 x 8 = 16 per update, 200 updates in one pass needs 3,200
    assert len(splits["train"]) >= 3200


def test_plan_epoch_partial_groups():
    groups = epoch_updates(list(range(37)), micro_batch=2, accumulation=8, drop_partial=False)
    assert [sum(map(len, g)) for g in groups] == [16, 16, 5]
    assert [len(mb) for mb in groups[-1]] == [2, 2, 1]
    dropped = epoch_updates(list(range(37)), 2, 8, drop_partial=True)
    assert len(dropped) == 2 and sorted(i for g in dropped for mb in g for i in mb) == \
        list(range(32))


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    assert epoch_order(50, 3, 1) == epoch_order(50, 3, 1)
    assert epoch_order(50, 3, 1) != epoch_order(50, 3, 2)
    assert sorted(epoch_order(50, 3, 1)) == list(range(50))


def test_workers_that_need_a_pickled_task_get_a_clear_error(monkeypatch):
    import multiprocessing

    from workbook import WorkbookError, load_task
    from workbook.contract.data import picklable_for_workers

    task = load_task("examples.regression:task")  # built from lambdas
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "fork")
    picklable_for_workers(task)  # fork: nothing is pickled
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    with pytest.raises(WorkbookError, match="'spawn' need the task pickled.*regression"):
        picklable_for_workers(task)
    picklable_for_workers(load_task("workbook.samples.generation:task"))  # partials pickle


def test_a_jsonl_file_is_read_lazily_and_a_bad_line_named_when_reached(tmp_path):
    from workbook.contract.data import JsonlRows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1}\n\n{"id": 2}\n{"id": \n')
    rows = iter(JsonlRows(path))
    assert next(rows) == {"id": 1} and next(rows) == {"id": 2}  # nothing read past them yet
    with pytest.raises(WorkbookError, match=r"rows.jsonl:4: malformed JSON line"):
        next(rows)
    assert len(JsonlRows(path)) == 3  # the non-blank lines: the progress bar's total
    with pytest.raises(WorkbookError, match="does not exist"):
        JsonlRows(tmp_path / "none.jsonl")
