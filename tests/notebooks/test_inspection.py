"""Notebook 01's checks: clean samples raise no flag; each planted bug is flagged by name."""

import dataclasses
from functools import partial

import pytest
import torch

from workbook import load_task
from workbook.contract.data import prepare
from workbook.notebooks.inspection import inspect_task
from workbook.notebooks.inspection.example_views import (
    batch_view,
    browser,
    browser_view,
    render_tokens,
)
from workbook.samples import classification, generation
from workbook.samples import tokenizer as tok
from workbook.samples.models import TinyDecoder, TrigramClassifier


def checks(task):
    return {f.check for f in inspect_task(task).flags}


@pytest.fixture
def readme_task():
    """The README's own task (a plain Dataset), as the pilot's tests run it."""
    return load_task("tests.own_task:task")


@pytest.mark.parametrize("fixture", ["gen_task", "cls_task", "readme_task"])
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
    from workbook.contract.task import split_by_group_hash

    by_example = dataclasses.replace(
        gen_task, split_of=lambda ex: split_by_group_hash(ex["id"], (0.8, 0.1, 0.1)))
    found = checks(by_example)
    assert "group crosses splits" in found


def test_duplicate_input_across_splits_is_flagged(cls_task):
    rows = list(cls_task.load_examples())  # the sample reads its file lazily
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
    view = browser_view(gen_task, ins.items, ins.splits)
    (split, query, again), index, status = view.children[0].children, view.children[1], \
        view.children[2]
    assert split.options == ("train", "validation", "test") and index.max == 3531
    assert (index.min, index.value) == (1, 1) and status.value.startswith("train 1 of 3531")
    target = ins.items["validation"][5]
    query.value = str(target.id)
    assert (split.value, index.value) == ("validation", 6) and str(target.id) in status.value
    assert status.value.startswith("validation 6 of")  # the slider and the line agree
    index.value = 2  # moved away, the same search again (the button) comes back
    again.click()
    assert index.value == 6 and str(target.id) in status.value
    group = str(ins.splits["test"][3][gen_task.group_key])
    query.value = group
    assert split.value == "test" and group in status.value
    query.value = group.upper()  # another case
    assert split.value == "test" and group in status.value
    query.value = group[:-1]  # a part: the first match, and how many there are
    assert "matching" in status.value and group[:-1] in status.value
    query.value = "no-such-id"
    assert "no example" in status.value


def test_the_browser_displays_itself_whatever_the_cell_ends_in(gen_task, gen_items,
                                                               monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    monkeypatch.setenv("WORKBOOK_HEADLESS", "0")
    assert browser(gen_task, gen_items["train"][:3]) is None
    assert [type(s).__name__ for s in shown].count("VBox") == 1


# --- a model forward that raises: a flag naming the cause, the other checks still run


def _lm(**changes):
    return dataclasses.replace(load_task("examples.shifted_lm:task"), **changes)


def test_an_embedding_one_row_short_is_a_flag_and_the_other_checks_still_run():
    from examples.shifted_lm import LeftPaddedDecoder
    from workbook.contract.task import split_by_group_hash

    short = _lm(build_model=partial(LeftPaddedDecoder, tok.VOCAB_SIZE - 1, 32, 1),
                split_of=lambda ex: split_by_group_hash(ex["id"], (0.8, 0.1, 0.1)))
    ins = inspect_task(short)  # raised a bare "IndexError: index out of range in self"
    found = {f.check: f for f in ins.flags}
    forward = found["model forward fails"]
    assert "the data holds token id 258 but the model's embedding `embed` has 258 rows" in \
        forward.message and "IndexError" in forward.message
    assert "make the vocabulary size at least max id + 1 = 259" in forward.fix
    assert forward.count == ins.figures["examples"], "every example holds the end token 258"
    assert "group crosses splits" in found, "the checks without the model still ran"
    assert ins.verdict == "fail" and ins.figures["num_outputs"] is None
    # the clean twin: the same model with every row
    assert inspect_task(_lm(build_model=partial(LeftPaddedDecoder, tok.VOCAB_SIZE, 32,
                                                1))).flags == []


def test_label_ids_beyond_the_classification_head_name_the_head(cls_task):
    ins = inspect_task(dataclasses.replace(cls_task, build_model=partial(TrigramClassifier,
                                                                         259, 4)))
    found = {f.check: f for f in ins.flags}
    assert set(found) == {"loss fails", "label ids out of range"}
    assert "the labels hold id 4, beyond the model's 4 outputs (ids 0..3" in \
        found["loss fails"].message
    assert "at least max label id + 1 = 5 wide" in found["loss fails"].fix


class _FixedBatch(torch.nn.Module):
    """A planted model that only runs batches of 8 (a reshape with a hard-coded batch)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(259, 8), torch.nn.Linear(8, 259)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.embed(input_ids).reshape(8, input_ids.shape[1], 8))


class _Unexplained(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 259)

    def forward(self, input_ids, attention_mask=None):
        raise ValueError("planted: the model refuses")


def _collate_inputs_padded_with_ignore_index(items):
    batch = generation.collate(items)
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


@pytest.mark.parametrize("changes, message, fix", [
    ({"build_model": partial(TinyDecoder, tok.VOCAB_SIZE, 32, 1, 4, 12)},
     "embedding `pos` is looked up with index 28 but has 12 rows: a sequence of 29 positions "
     "is longer than this position table", "cut the data to at most 12 positions"),
    ({"build_model": lambda: torch.nn.Sequential(torch.nn.Embedding(259, 8),
                                                 torch.nn.Linear(9, 259))},
     "(mat1 and mat2 shapes cannot be multiplied (232x8 and 9x259)) on a batch of 8 examples: "
     "a shape mismatch", "make the model's sizes match"),
    ({"build_model": _FixedBatch}, "on a batch of 1 example: a shape mismatch",
     "make the model's sizes match"),
    ({"build_model": _Unexplained},
     "raised ValueError (planted: the model refuses) on a batch of 8 examples",
     "call task.forward(model, batch) on one batch"),
    ({"collate": _collate_inputs_padded_with_ignore_index},
     "the inputs hold id -100 for the model's embedding `embed`", "pad inputs with a pad token"),
])
def test_a_failing_forward_names_the_cause_it_can_find(gen_task, changes, message, fix):
    ins = inspect_task(dataclasses.replace(gen_task, model_inputs=("input_ids",), **changes))
    (forward,) = [f for f in ins.flags if f.check == "model forward fails"]
    assert message in forward.message and fix in forward.fix


# --- prompt tokens without a prompt_mask: 01 finds the prompt itself


def _unmasked(encode):
    """`encode` without its prompt_mask, and a collate that needs none."""
    def encoded(ex):
        out = dict(encode(ex))
        out.pop("prompt_mask")
        return out

    def collate(items):
        batch = generation.collate([{**it, "prompt_mask": torch.zeros_like(it["labels"])}
                                    for it in items])
        batch.pop("prompt_mask")
        return batch
    return encoded, collate


def test_prompt_targets_without_a_prompt_mask_are_flagged(gen_task):
    encode, collate = _unmasked(partial(generation.encode, max_length=64, prompt_in_loss=True))
    ins = inspect_task(dataclasses.replace(gen_task, encode=encode, collate=collate))
    (flag,) = ins.flags
    assert flag.check == "loss on prompt" and flag.message.startswith(
        "4350 of 4350 examples have targets on prompt tokens")
    assert "the loss learns to predict the instruction" in flag.message
    assert "set labels to -100 on the prompt" in flag.fix
    assert ins.figures["targets_on_prompt"] == flag.count and ins.notes == []
    # the clean twin: the same encode with the prompt masked, still without a prompt_mask
    encode, collate = _unmasked(partial(generation.encode, max_length=64,
                                        prompt_in_loss=False))
    clean = inspect_task(dataclasses.replace(gen_task, encode=encode, collate=collate))
    assert clean.flags == [] and clean.notes == [] and clean.figures["targets_on_prompt"] == 0
    view = batch_view(clean.task, clean.items["train"][:1])
    assert view.prompt.any() and not (view.prompt & view.contributes).any()


def test_shifted_labels_without_a_prompt_mask_are_judged_at_their_shift():
    from examples import shifted_lm

    def left_collate(items):  # shifted_lm's left padding, without a prompt_mask
        batch = shifted_lm.collate([{**it, "prompt_mask": torch.zeros_like(it["labels"])}
                                    for it in items])
        batch.pop("prompt_mask")
        return batch

    def unmasked(ex, keep_prompt):  # planted: labels on the prompt (its <s> aside)
        out = shifted_lm.encode(ex, 64)
        out.pop("prompt_mask")
        if keep_prompt:
            out["labels"] = out["input_ids"].clone()
            out["labels"][0] = -100
        return out

    clean = inspect_task(_lm(encode=partial(unmasked, keep_prompt=False), collate=left_collate))
    assert clean.flags == [] and clean.notes == []
    planted = inspect_task(_lm(encode=partial(unmasked, keep_prompt=True), collate=left_collate))
    assert [f.check for f in planted.flags] == ["loss on prompt"]
    # the token view of the clean task shows no "bug" box (the prompt moves with the labels)
    assert "outline" not in render_tokens(batch_view(clean.task, clean.items["train"][:2]))
    lm = _lm()  # with its prompt_mask: the last prompt position predicts the response
    assert "outline" not in render_tokens(batch_view(lm, prepare(lm, limits={"train": 2}).train))


def test_prompt_masking_that_cannot_be_checked_is_a_note_not_a_failure(gen_task):
    def refuses_empty(ex, keep):
        if not ex["response"]:
            raise ValueError("no response")
        return keep(ex)

    def response_first(ex):  # the prompt-only encoding is no prefix of the full one
        return keep({**ex, "instruction": ex["response"], "response": ex["instruction"]})

    keep, collate = _unmasked(partial(generation.encode, max_length=64, prompt_in_loss=False))
    for encode, words in ((partial(refuses_empty, keep=keep), "raised ValueError: no "
                           "response"), (response_first, "is not a prefix of the full one")):
        ins = inspect_task(dataclasses.replace(gen_task, encode=encode, collate=collate))
        assert ins.verdict == "pass" and ins.flags == []
        (note,) = ins.notes
        assert note.message.startswith("01 could not check prompt masking on any example")
        assert words in note.message and "prompt_mask" in note.fix
        table = ins.flag_table()
        assert table.check.tolist() == ["no flags", "prompt masking not checked"]
        assert "(see the notes)" in table.message[0]


def test_label_shift_is_offered_only_where_the_workbooks_loss_is_the_one_trained(gen_task):
    """Labels that copy the input: label_shift=1 is the fix for a task trained on its `loss`;
    a task whose own train_step (or model) computes the loss is told to shift its data."""
    from workbook.notebooks.inspection.loss_probes import copy_audit

    def copying(ex, **kw):
        out = generation.encode(ex, max_length=64, prompt_in_loss=True)
        return {**out, "labels": out["input_ids"].clone()}

    task = dataclasses.replace(gen_task, encode=copying, prompt_in_loss=True)
    items = prepare(task, ("train",)).train[:16]
    plain = copy_audit(task, items)
    assert [f.check for f in plain] == ["targets copy the input"]
    assert "label_shift=1" in plain[0].fix
    own = copy_audit(dataclasses.replace(task, train_step=lambda m, o, b: 0.0), items)
    assert [f.check for f in own] == ["targets copy the input"]
    assert "label_shift=1" not in own[0].fix and "its own train_step" in own[0].fix
    clean = prepare(gen_task, ("train",)).train[:16]
    assert copy_audit(dataclasses.replace(gen_task, train_step=lambda m, o, b: 0.0), clean) == []
