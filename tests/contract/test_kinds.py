"""Target kinds (workbook/contract/kinds/): one module per kind, what each decides, and token
classification (examples/token_tagging.py) end to end - a clean tagger raises nothing, each
planted bug is named, 02 memorises its tags."""

from pathlib import Path

import pytest
import torch

import workbook as wb
from workbook.contract import kinds
from workbook.contract.targets import IGNORE_INDEX
from workbook.notebooks.inspection import inspect_task

TAGGER = "examples.token_tagging:task"


def test_each_kind_is_one_module_and_named_by_its_file():
    folder = Path(kinds.__file__).parent
    files = {p.stem for p in folder.glob("*.py")} - {"__init__", "base"}
    assert files == set(kinds.KINDS)
    for name, kind in kinds.KINDS.items():
        assert type(kind).__module__ == f"workbook.contract.kinds.{name}"


def test_an_unknown_kind_is_named_with_the_kinds_there_are():
    with pytest.raises(wb.WorkbookError, match="must be one of .*token_classification.*got 'seg'"):
        kinds.of("seg")
    task = wb.load_task(TAGGER)
    with pytest.raises(wb.WorkbookError, match="got 'seg'"):
        wb.task.validate_task(wb.Task(**{**vars(task), "kind": "seg"}))


def test_named_classes_need_their_names():
    task = wb.load_task(TAGGER)
    with pytest.raises(wb.WorkbookError, match="`label_names` .* required for token_classif"):
        wb.task.validate_task(wb.Task(**{**vars(task), "label_names": None}))
    with pytest.raises(wb.WorkbookError, match="label_shift"):
        wb.task.validate_task(wb.Task(**{**vars(task), "label_shift": 1}))


def test_what_each_kind_counts_and_expects():
    labels = torch.tensor([[1, 2, IGNORE_INDEX]])
    gen, tok = kinds.of("generation"), kinds.of("token_classification")
    assert gen.targets(labels, 1).tolist() == [[2, IGNORE_INDEX, IGNORE_INDEX]]
    assert tok.targets(labels, 0).tolist() == labels.tolist()  # never shifted
    values = torch.tensor([2.0, float("nan"), 2.0])
    assert kinds.of("regression").expected_initial_loss(1, values) == pytest.approx(4.0)
    assert tok.expected_initial_loss(7) == pytest.approx(1.9459, abs=1e-4)
    logits = torch.zeros(1, 3, 7)
    logits[0, :, 4] = 1
    assert tok.predicted(logits, labels).tolist() == [[4, 4, 4]]


def test_a_token_position_is_its_own_context_but_a_prefix_is_shared():
    """02's ambiguity: two tags of the same sentence at different positions are not one context
    (token classification), two continuations of the same prefix are (generation)."""
    row = torch.tensor([5, 6, 7])
    tok, gen = kinds.of("token_classification"), kinds.of("generation")
    assert tok.context(row, None, 0, [row]).tolist() != tok.context(row, None, 1, [row]).tolist()
    assert gen.context(row, None, 1, [row]).tolist() == [5, 6]


def test_a_clean_tagger_raises_no_flag_and_counts_tags_per_word():
    ins = inspect_task(wb.load_task(TAGGER))
    assert ins.verdict == "pass", ins.flag_table()
    assert ins.figures["targets_on_padding"] == 0 and ins.figures["contributing_share"] == 1.0
    assert list(ins.classes.index[:3]) == ["O", "B-PER", "I-PER"]


@pytest.mark.parametrize("planted, check", [
    ("tags_on_padding", "loss on padding"),
    ("shifted_tag_map", "label map round trip"),
])
def test_each_planted_tagging_bug_is_named(planted, check):
    flags = {f.check for f in inspect_task(wb.load_task(TAGGER, **{planted: True})).flags}
    assert check in flags


def test_overfit_gives_back_every_tag_of_the_subset(tmp_path):
    params = wb.params.of("02_overfit", small=True, task=TAGGER)
    result = wb.overfit.run(params, tmp_path)
    assert result.verdict == "pass", result.checks
    row = result.reproduction.iloc[0]
    assert row.predicted == row.target and len(row.target.split()) == row.tags


@pytest.mark.slow  # 100 s on 2 cores: every notebook on the tagger, as its README line claims
def test_the_tagger_passes_all_nine_notebooks(tmp_path):
    from workbook.commands.pilot import run_pilot

    run, index = run_pilot(TAGGER, out=str(tmp_path / "run"), smoke=True, progress=False)
    assert index.verdict.tolist() == ["pass"] * 9, index.error.tolist()


def test_a_context_of_ids_and_values_keeps_the_values():
    """02's ambiguity: a categorical id and a float feature are one context only when both
    agree - the float is not cast to the id's integer type."""
    cls = kinds.of("classification")
    ids = torch.tensor([1])
    one = cls.context(ids, None, 0, [ids, torch.tensor([0.2])])
    other = cls.context(ids, None, 0, [ids, torch.tensor([0.7])])
    assert one.tolist() != other.tolist()


def test_a_truncated_tagged_example_keeps_its_first_tags_and_raises_nothing():
    from examples import token_tagging

    task = wb.load_task(TAGGER)
    full = task.encode
    task.encode = lambda ex: {k: v[:6] for k, v in full(ex).items()}  # max_length=6, as a
    task.collate = token_tagging.collate  # tokenizer's truncation cuts words and tags alike
    assert "label map round trip" not in {f.check for f in inspect_task(task).flags}
    shifted = wb.load_task(TAGGER, shifted_tag_map=True)
    cut = shifted.encode
    shifted.encode = lambda ex: {k: v[:6] for k, v in cut(ex).items()}
    assert "label map round trip" in {f.check for f in inspect_task(shifted).flags}
