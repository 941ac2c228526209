import dataclasses

import pytest
import torch

from workbook import Task, WorkbookError, load_task
from workbook.contract.targets import token_cross_entropy
from workbook.contract.task import logits_of, validate_task
from workbook.training.loop import UpdateShape


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


def test_a_task_function_with_keyword_arguments_takes_any_option(monkeypatch):
    import sys
    import types

    module = types.ModuleType("kw_task_module")

    def task(count=3, **planted):
        return load_task("workbook.samples.generation:task", max_length=count, **planted)

    module.task = task
    monkeypatch.setitem(sys.modules, "kw_task_module", module)
    loaded = load_task("kw_task_module:task", count=12, prompt_in_loss=True)
    assert loaded.prompt_in_loss and loaded.options == {"count": 12, "prompt_in_loss": True}
    with pytest.raises(WorkbookError, match="max_lenght"):  # still refused where it lands
        load_task("kw_task_module:task", max_lenght=3)


def test_every_missing_capability_is_reported_at_once(gen_task):
    broken = dataclasses.replace(gen_task, encode=None, collate="not callable", kind="listwise",
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

    from workbook.contract.data import collate_items, prepare

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
    from workbook.contract.data import collate_items, load_examples, prepare

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
    from workbook.base.errors import reason

    assert reason(ValueError("\x1b[1;31mshape\x1b[0m mismatch\nsecond line")) == "shape mismatch"
    cut = reason(ValueError("the tensor " * 40), 40)
    assert cut.endswith("\u2026") and len(cut) <= 40 and not cut[:-1].endswith(" ")


class _Returns(torch.nn.Module):
    """A tiny LM whose forward returns what `shape` says, around the same logits."""

    def __init__(self, shape="tensor"):
        super().__init__()
        self.embed = torch.nn.Embedding(300, 300)
        self.shape = shape

    def forward(self, input_ids, attention_mask=None):
        logits = self.embed(input_ids)
        loss = logits.float().logsumexp(-1).mean()
        hidden = logits[..., :8]
        return {"tensor": lambda: logits,
                "tuple": lambda: (logits, loss),
                "loss first": lambda: (loss, hidden.sum(-1), logits),
                "dict": lambda: {"loss": loss, "logits": logits},
                "dict without logits": lambda: {"scores": logits, "loss": loss},
                "object": lambda: type("Out", (), {"logits": logits, "loss": None})(),
                "two scalars": lambda: (logits, loss, loss * 2),
                "last only": lambda: (logits[:, [-1]], None),
                "string": lambda: "logits"}[self.shape]()


@pytest.fixture(scope="module")
def lm_batch():
    from workbook.contract.data import collate_items, prepare

    task = load_task("workbook.samples.generation:task")
    return task, collate_items(task, prepare(task, ("validation",)).validation[:2]).tensors


@pytest.mark.parametrize("shape, has_loss", [("tensor", False), ("tuple", True),
                                             ("dict", True), ("object", False),
                                             ("two scalars", False)])
def test_logits_and_the_models_loss_are_found_when_unambiguous(shape, has_loss, lm_batch):
    task, batch = lm_batch
    out = task.outputs(_Returns(shape), batch)
    assert out.logits.shape == (*batch["labels"].shape, 300)
    assert (out.loss is not None) == has_loss


def test_a_tuple_whose_logits_are_not_first_is_found_by_the_batchs_leading_dims(lm_batch):
    task, batch = lm_batch
    out = task.outputs(_Returns("loss first"), batch)
    assert out.logits.shape[-1] == 300 and out.loss.dim() == 0


def test_logits_at_and_loss_at_say_where_they_are(lm_batch):
    task, batch = lm_batch
    told = dataclasses.replace(task, logits_at="scores", loss_at="loss")
    out = told.outputs(_Returns("dict without logits"), batch)
    assert out.logits.shape[-1] == 300 and out.loss.dim() == 0
    by_index = dataclasses.replace(task, logits_at=2, loss_at=0)
    assert by_index.outputs(_Returns("loss first"), batch).logits.shape[-1] == 300


@pytest.mark.parametrize("shape, fields, words", [
    ("dict without logits", {}, r"(?s)returned dict\(scores=Tensor\[2, \d+, 300\] float32, "
                                r"loss=Tensor\[\] float32\).*logits_at"),
    ("string", {}, r"(?s)returned str.*logits_at"),
    ("tuple", {"logits_at": 5}, r"returned tuple\(.*\), which has no 5 \(the task's "
                                r"logits_at=5\)"),
    ("tuple", {"logits_at": 1}, r"logits_at=1 holds Tensor\[\] float32, not a tensor of "
                                r"logits \(one number: its loss\?\)"),
    ("last only", {}, r"(?s)cover 1 position of \d+.*model_inputs=\('input_ids', 'labels'\)"),
    ("dict", {"loss_at": "nll"}, r"no 'nll' \(the task's loss_at='nll'\)"),
])
def test_ambiguous_outputs_name_what_was_returned_and_the_field(shape, fields, words, lm_batch):
    task, batch = lm_batch
    with pytest.raises(WorkbookError, match=words):
        dataclasses.replace(task, **fields).forward(_Returns(shape), batch)


def test_output_fields_of_the_wrong_type_are_refused_at_load(gen_task):
    with pytest.raises(WorkbookError, match="(?s)`logits_at`.*`forward_names`"):
        validate_task(dataclasses.replace(gen_task, logits_at=1.5, forward_names=["labels"]))


def test_labels_reach_a_forward_that_takes_targets_and_forward_names_maps_others(lm_batch):
    from torch import nn

    class Script(nn.Module):  # nanoGPT's signature
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(300, 300)

        def forward(self, idx, targets=None):
            logits = self.embed(idx)
            return logits, None if targets is None else nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    class Named(Script):
        def forward(self, tokens, y=None):
            return super().forward(tokens, y)

    task, batch = lm_batch
    script = dataclasses.replace(task, model_inputs=("input_ids", "labels"))
    args, kwargs = script.forward_arguments(Script(), batch)
    assert len(args) == 1 and set(kwargs) == {"targets"}
    assert script.outputs(Script(), batch).loss is not None
    # inside DataParallel (as DDP), the names are read from the module it wraps
    assert script.outputs(nn.DataParallel(Script()), batch).loss is not None
    with pytest.raises(WorkbookError, match=r"(?s)takes no argument labels.*forward_names="
                                            r"\{'labels': '<parameter>'\}"):
        script.forward(Named(), batch)
    mapped = dataclasses.replace(script, forward_names={"labels": "y"})
    assert mapped.outputs(Named(), batch).loss is not None
    assert script.loss_computed_by().startswith("its model")
    assert task.loss_computed_by() is None
