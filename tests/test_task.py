import dataclasses

import pytest
import torch

from workbook import Task, WorkbookError, load_task
from workbook.loop import UpdateShape
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
    broken = dataclasses.replace(gen_task, encode=None, collate="not callable", kind="ranking",
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


def test_model_inputs_the_forward_does_not_take_are_named_with_the_fix():
    from torch import nn

    from workbook.data import collate_items, prepare

    class OnlyIds(nn.Module):  # a plain LM that takes no attention mask
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(300, 8)

        def forward(self, input_ids):
            return self.embed(input_ids)

    task = dataclasses.replace(load_task("workbook.samples.generation:task"),
                               build_model=OnlyIds)
    batch = collate_items(task, prepare(task, ("validation",)).validation[:2]).tensors
    with pytest.raises(WorkbookError, match="(?s)takes no argument attention_mask .*"
                                            r"model_inputs=\('input_ids',\)"):
        task.forward(OnlyIds(), batch)
    fixed = dataclasses.replace(task, model_inputs=("input_ids",))
    assert fixed.forward(OnlyIds(), batch).shape[:2] == batch["input_ids"].shape
    assert torch.is_tensor(task.forward(load_task("workbook.samples.generation:task")
                                        .build_model(), batch))


def test_a_loss_may_report_a_float_target_count(gen_task, gen_items):
    from workbook import TrainConfig, train

    def weighted(logits, batch):  # every target weighs half: a float count
        summed, count = token_cross_entropy(logits, batch)
        return summed * 0.5, count * 0.5

    task = dataclasses.replace(gen_task, loss=weighted)
    result = train(task, gen_items["train"][:8], TrainConfig(UpdateShape(2, 2), updates=2,
                                                             device="cpu"))
    assert all(r.loss > 0 for r in result.steps)


def test_the_tasks_own_pieces_failing_are_named_with_the_fix():
    """A model factory returning a non-module, examples that are not dicts, a collate that
    raises or returns something else: each a WorkbookError naming the piece, not a traceback
    from deep inside a notebook; the clean twin loads and collates."""
    from workbook.data import collate_items, load_examples, prepare

    task = load_task("tests.own_task:task")
    items = prepare(task, ("train",)).train[:4]
    assert isinstance(task.build_model(), torch.nn.Module)
    assert set(collate_items(task, items).tensors) == {"x", "labels"}
    with pytest.raises(WorkbookError, match="build_model returned a type, not a torch.nn.Module"):
        dataclasses.replace(task, build_model=lambda: torch.nn.Linear).build_model()
    with pytest.raises(WorkbookError, match="build_model failed: ValueError"):
        dataclasses.replace(task, build_model=lambda: int("x")).build_model()
    with pytest.raises(WorkbookError, match="position 1 is a str"):
        load_examples(dataclasses.replace(task, load_examples=lambda: [{"id": 0}, "row"]))

    def broken(rows):
        raise RuntimeError("stack expects each tensor to be equal size")
    with pytest.raises(WorkbookError, match=r"collate raised RuntimeError \(stack expects"):
        collate_items(dataclasses.replace(task, collate=broken), items)
    with pytest.raises(WorkbookError, match="collate returned list, not a dict of tensors"):
        collate_items(dataclasses.replace(task, collate=lambda rows: rows), items)


def test_an_error_reason_drops_terminal_colours_and_says_where_it_was_cut():
    from workbook.errors import reason

    assert reason(ValueError("\x1b[1;31mshape\x1b[0m mismatch\nsecond line")) == "shape mismatch"
    cut = reason(ValueError("the tensor " * 40), 40)
    assert cut.endswith("\u2026") and len(cut) <= 40 and not cut[:-1].endswith(" ")
