"""Notebook 01's checks: clean samples raise no flag; each planted bug is flagged by name."""

import dataclasses
from functools import partial

import pytest
import torch

from workbook import load_task
from workbook.inspection import batch_view, browser, inspect_task, render_tokens
from workbook.samples import classification, generation
from workbook.samples.models import TrigramClassifier


def checks(task):
    return {f.check for f in inspect_task(task).flags}


@pytest.mark.parametrize("fixture", ["gen_task", "cls_task"])
def test_clean_samples_raise_no_flag(fixture, request):
    ins = inspect_task(request.getfixturevalue(fixture))
    assert ins.verdict == "pass", ins.flag_table()
    assert ins.figures["zero_target_examples"] == 0 and ins.figures["targets_on_padding"] == 0


def test_generation_figures(gen_task):
    fig = inspect_task(gen_task).figures
    assert fig["num_outputs"] == 259 and fig["expected_initial_loss"] == pytest.approx(5.5568)
    assert 0.2 < fig["contributing_share"] < 0.6  # only response tokens count


def test_shifted_label_map_is_flagged(cls_task):
    shifted = {name: (i + 1) % 5 for i, name in enumerate(cls_task.label_names)}
    task = dataclasses.replace(cls_task, encode=partial(classification.encode, label_map=shifted,
                                                        max_length=128))
    assert "label map round trip" in checks(task)


def test_label_id_beyond_the_output_layer_is_flagged(cls_task):
    bigger = {name: i + 3 for i, name in enumerate(cls_task.label_names)}
    task = dataclasses.replace(cls_task, encode=partial(classification.encode, label_map=bigger,
                                                        max_length=128),
                               decode=lambda ids: ",".join(str(i) for i in ids))
    assert "label ids out of range" in checks(task)


def test_prompt_tokens_not_excluded_are_flagged(gen_task):
    # the encode keeps prompt targets, while the task claims the prompt is excluded
    task = dataclasses.replace(gen_task, encode=partial(generation.encode, max_length=64,
                                                        prompt_in_loss=True))
    assert "loss on prompt" in checks(task)
    # declared on purpose, the same labels raise no flag
    assert checks(load_task("workbook.samples.generation:task", prompt_in_loss=True)) == set()


def test_loss_over_padding_is_flagged(gen_task):
    def collate_padding_labels(items):
        batch = generation.collate(items)
        batch["labels"] = torch.where(batch["attention_mask"] == 1, batch["labels"], 256)
        return batch
    found = checks(dataclasses.replace(gen_task, collate=collate_padding_labels))
    assert {"loss on padding", "loss reads ignored positions"} <= found


def test_loss_that_ignores_the_ignore_index_is_flagged(gen_task):
    def careless_loss(logits, batch):
        labels = batch["labels"].clamp(min=0)  # -100 silently becomes token 0
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 reduction="sum")
        return loss, (batch["labels"] != -100).sum()
    assert "loss reads ignored positions" in checks(dataclasses.replace(gen_task,
                                                                        loss=careless_loss))


def test_truncation_leaving_no_targets_is_flagged():
    task = load_task("workbook.samples.generation:task", max_length=10)
    ins = inspect_task(task)
    assert "zero targets" in {f.check for f in ins.flags}
    assert ins.figures["zero_target_examples"] > 100


def test_group_in_two_splits_is_flagged(gen_task):
    from workbook.task import split_by_group_hash

    by_example = dataclasses.replace(
        gen_task, split_of=lambda ex: split_by_group_hash(ex["id"], (0.8, 0.1, 0.1)))
    found = checks(by_example)
    assert "group crosses splits" in found


def test_duplicate_input_across_splits_is_flagged(cls_task):
    rows = cls_task.load_examples()
    copy = dict(rows[0], id="dup", author="someone-else-entirely")
    task = dataclasses.replace(cls_task, load_examples=lambda: rows + [copy],
                               split_of=lambda ex: "test" if ex["id"] == "dup" else
                               cls_task.split(ex) if cls_task.split(ex) != "test" else "train")
    assert "duplicate input crosses splits" in checks(task)


def test_model_whose_output_depends_on_padding_is_flagged(cls_task):
    class LeakyPool(TrigramClassifier):
        def forward(self, input_ids, attention_mask):  # mean over padding too
            return self.head(self.embed(input_ids).mean(1))
    task = dataclasses.replace(cls_task, build_model=partial(LeakyPool, 259, 5))
    assert "padding changes outputs" in checks(task)


def test_token_view_marks_prompt_padding_and_targets(gen_task, gen_items):
    items = sorted(gen_items["train"][:6], key=lambda it: it.tensors["input_ids"].numel())
    view = batch_view(gen_task, [items[0], items[-1]])
    first = view[view.example == items[0].id]
    assert first.padding.any() and not (first.padding & first.contributes).any()
    assert not first[first.prompt].contributes.any() and first.contributes.any()
    html = render_tokens(view)
    assert "line-through" in html and "#c8f0c8" in html and "outline" not in html


def test_a_headless_run_creates_no_widget(gen_task, gen_items, monkeypatch):
    import ipywidgets

    def no_widgets(*args, **kwargs):
        raise AssertionError("a live widget was created in a headless run")

    monkeypatch.setattr(ipywidgets, "IntSlider", no_widgets)
    monkeypatch.setenv("WORKBOOK_HEADLESS", "1")
    assert browser(gen_task, gen_items["train"][:3]) is None
    monkeypatch.setenv("WORKBOOK_HEADLESS", "0")
    with pytest.raises(AssertionError, match="live widget"):
        browser(gen_task, gen_items["train"][:3])


def test_the_browser_moves_across_splits_and_finds_ids_and_groups(gen_task, monkeypatch):
    monkeypatch.setenv("WORKBOOK_HEADLESS", "0")
    ins = inspect_task(gen_task, probe_size=2)
    view = browser(gen_task, ins.items, ins.splits)
    (split, query), index, status = view.children[0].children, view.children[1], \
        view.children[2]
    assert split.options == ("train", "validation", "test") and index.max == 3530
    target = ins.items["validation"][5]
    query.value = str(target.id)
    assert (split.value, index.value) == ("validation", 5) and str(target.id) in status.value
    group = str(ins.splits["test"][3][gen_task.group_key])
    query.value = group
    assert split.value == "test" and group in status.value
    query.value = "no-such-id"
    assert "no example" in status.value
