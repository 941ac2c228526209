"""Notebook 05's variants: recorded rows, honest flags, not-applicable rows, bad input."""

import pytest

from workbook.notebooks import variants
from workbook.notebooks.variants import Variant, VariantStudy, default_variants
from workbook.training.loop import UpdateShape
from workbook.training.predict import Plan

from ..conftest import CLASSIFICATION, GENERATION


@pytest.fixture(scope="module")
def gen_table():
    """Planned on the sample's trained model, not its campaign model: the campaign's sizing
    (test_campaign.py, 05 under nbval) took two thirds of this fixture."""
    study = VariantStudy(GENERATION, {"campaign_layers": 0}, updates=3, train_limit=120,
                         val_limit=16,
                         plan=Plan(UpdateShape(8, 2), length=256, eval_batch=8))
    return study.run(default_variants(Variant("control", UpdateShape(4, 2)), 20)).set_index("id")


def test_every_variant_keeps_its_row(gen_table):
    assert list(gen_table.index) == ["control", "micro-batch/2", "max_length=20",
                                     "checkpointing", "bf16", "fp16+scaler",
                                     "micro-batch/2+checkpointing", "bf16+checkpointing"]
    assert (gen_table.effective_batch == 8).all()


def test_the_numbers_table_leaves_the_words_to_the_next_one(gen_table):
    """05 shows the flags, reasons and the plan's model in a table of their own: beside a dozen
    numbers they made the table wider than a 1280 px page (tests/test_browser.py measures it)."""
    table = gen_table.reset_index()
    numbers, words = variants.display_table(table), variants.words_table(table)
    assert set(numbers.columns) & set(words.columns) == {"id", "effective_batch", "status"}
    assert {"peak_mib", "memory_ratio", "plan_peak_mib"} <= set(numbers.columns)
    assert {"plan_model", "flags", "reason"} <= set(words.columns)


def test_fp16_on_cpu_is_not_applicable_not_a_silent_fallback(gen_table):
    row = gen_table.loc["fp16+scaler"]
    assert row.status == "not applicable" and "needs CUDA" in row.reason


def test_truncation_that_removes_targets_changes_the_experiment(gen_table):
    flags = gen_table.loc["max_length=20", "flags"]
    assert "changes the experiment" in flags and "targets from" in flags
    assert gen_table.loc["control", "flags"] == ""


def test_smaller_micro_batch_keeps_the_update_and_notes_what_it_does_not_free(gen_table):
    row = gen_table.loc["micro-batch/2"]
    assert "does not free weights or optimizer state" in row["flags"]
    assert row.examples_seen == gen_table.loc["control", "examples_seen"]
    # the same examples, the same normalisation: the same model after the same updates
    assert row.val_loss == pytest.approx(gen_table.loc["control", "val_loss"], abs=1e-5)


def test_checkpointing_lowers_the_planned_activation_peak(gen_table):
    assert gen_table.loc["checkpointing", "plan_peak_bytes"] < \
        gen_table.loc["control", "plan_peak_bytes"]
    assert gen_table.loc["max_length=20", "plan_peak_bytes"] < \
        gen_table.loc["control", "plan_peak_bytes"]


def test_classification_variants_run(tmp_path):
    study = VariantStudy(CLASSIFICATION, {}, updates=2, train_limit=80, val_limit=8)
    table = study.run([Variant("control", UpdateShape(4, 2)), Variant("bf16", UpdateShape(4, 2,
                                                                                          precision="bf16")),
                       Variant("bigger batch", UpdateShape(8, 2))]).set_index("id")
    assert (table.status == "measured").all()
    assert "effective batch changed" in table.loc["bigger batch", "flags"]


def test_truncating_a_classification_text_is_noted():
    study = VariantStudy(CLASSIFICATION, {}, updates=1, train_limit=40, val_limit=8)
    table = study.run([Variant("control", UpdateShape(4, 1)), Variant("cut", UpdateShape(4, 1),
                                                                      max_length=12)])
    assert "shortens the input of" in table["flags"][1]
    assert "changes the experiment" not in table["flags"][1]


def test_max_length_shorter_than_every_prompt_keeps_every_row():
    """The truncation variant that leaves no target is its row's finding; the control is still
    measured (it was an error ending 05 before: a --smoke short_length under chat prompts)."""
    study = VariantStudy(GENERATION, {}, updates=1, train_limit=30, val_limit=4)
    table = study.run([Variant("control", UpdateShape(2, 1)), Variant("cut", UpdateShape(2, 1),
                                                                      max_length=3)])
    assert table.status.tolist() == ["measured", "not applicable"]
    assert "shorter than every prompt" in table.reason[1]


def test_a_task_without_max_length_gets_a_not_applicable_row():
    study = VariantStudy("tests.own_task:task", {}, updates=1, val_limit=8)
    table = study.run([Variant("control", UpdateShape(4, 1)), Variant("cut", UpdateShape(4, 1),
                                                                      max_length=8)])
    assert table.status.tolist() == ["measured", "not applicable"]
    assert "max_length" in table.reason[1]


def test_a_variant_that_trains_to_nan_fails_the_notebook_and_says_where(tmp_path):
    from workbook.notebooks.variants import VariantsResult, save

    # one pass of 7 updates of 64 reaches the rows whose features hold NaN
    study = VariantStudy("examples.regression:task", {"nan_inputs": True}, updates=7,
                         val_limit=16)
    table = study.run([Variant("control", UpdateShape(32, 2))])
    assert "non-finite loss or gradient at updates [" in table["flags"].iloc[0]
    assert table.peak_bytes.iloc[0] > 0, "memory is still measured"
    clean = VariantStudy("examples.regression:task", {}, updates=3, train_limit=64,
                         val_limit=16)
    (tmp_path / "nan").mkdir()
    (tmp_path / "clean").mkdir()
    control = Variant("control", UpdateShape(4, 2))
    assert save(VariantsResult(study.control_task, [], table), tmp_path / "nan") == "fail"
    assert save(VariantsResult(clean.control_task, [control], clean.run([control])),
                tmp_path / "clean") == "pass"


def test_grad_scaler_skips_are_not_a_broken_fp16_run():
    """Measured on an H200: fp16's first updates overflow at the GradScaler's initial scale and
    are skipped by design (all 3 of 05 --smoke); 05 failed the run on them. Only a non-finite
    loss breaks an fp16 variant."""
    from workbook.notebooks.variants import NON_FINITE, training_flags
    from workbook.storage.records import StepRecord

    def steps(*norms, loss=1.0):
        return [StepRecord(i + 1, 0, 1, 4, 4, loss, 1e-3, n, 0.01, 0.0)
                for i, n in enumerate(norms)]

    inf = float("inf")
    skipped = training_flags(steps(inf, inf, 0.5, 0.4), "fp16")
    assert len(skipped) == 1 and "GradScaler skipped updates [1, 2]" in skipped[0]
    assert "2 of 4 updates applied" in skipped[0] and NON_FINITE not in skipped[0]
    assert training_flags(steps(0.5, 0.4), "fp16") == []
    none = training_flags(steps(inf, inf, inf), "fp16")[0]  # 05 --smoke on an H200
    assert "none of the 3 updates applied: not judged" in none and NON_FINITE not in none
    assert NON_FINITE in training_flags(steps(0.5, 0.4, loss=float("nan")), "fp16")[0]
    assert NON_FINITE in training_flags(steps(inf, 0.5), "bf16")[0]  # no scaler there

