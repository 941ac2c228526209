import dataclasses

import pytest
import torch

from workbook import Task, WorkbookError, load_task
from workbook.task import logits_of, token_cross_entropy, validate_task


def test_load_sample_tasks_with_options():
    task = load_task("workbook.samples.generation:task", max_length=16, prompt_in_loss=True)
    assert task.prompt_in_loss and task.options == {"max_length": 16, "prompt_in_loss": True}
    assert load_task("workbook.samples.classification:task").label_names[2] == "recall"


@pytest.mark.parametrize("path, words", [
    ("workbook.samples.generation", "package.module:attribute"),
    ("no_such_module_xyz:task", "cannot be imported"),
    ("workbook.samples.generation:tsak", "has no attribute 'tsak'"),
    ("workbook.samples.models:TinyDecoder", "failed"),
    ("workbook.samples:DATA_DIR", "not a workbook.Task"),
])
def test_bad_task_paths_name_the_problem(path, words):
    with pytest.raises(WorkbookError, match=words):
        load_task(path)


def test_unknown_task_option_is_refused():
    with pytest.raises(WorkbookError, match="max_lenght"):
        load_task("workbook.samples.generation:task", max_lenght=3)


def test_every_missing_capability_is_reported_at_once(gen_task):
    broken = dataclasses.replace(gen_task, encode=None, collate="not callable", kind="regression",
                                 split_fractions=(0.5, 0.5, 0.5))
    with pytest.raises(WorkbookError) as err:
        validate_task(broken)
    text = str(err.value)
    for part in ("`encode`", "`collate`", "`kind`", "`split_fractions`", "fix:"):
        assert part in text


def test_classification_needs_label_names(cls_task):
    with pytest.raises(WorkbookError, match="label_names"):
        validate_task(dataclasses.replace(cls_task, label_names=None))


def test_default_loss_sums_only_contributing_positions():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    loss, count = token_cross_entropy(logits, {"labels": labels})
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    assert int(count) == 3 and torch.allclose(loss, expected)


def test_logits_of_accepts_hugging_face_style_outputs():
    out = type("Out", (), {"logits": torch.ones(2)})()
    assert torch.equal(logits_of(out), torch.ones(2)) and torch.equal(logits_of(torch.ones(1)),
                                                                      torch.ones(1))


def test_task_from_a_plain_dataset_is_short():
    """The README's bring-your-own example: a Dataset, a collate_fn and a model."""
    from tests.own_task import task

    loaded = load_task("tests.own_task:task")
    assert isinstance(loaded, Task) and loaded.name == task.name
