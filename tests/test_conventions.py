"""Hugging Face conventions on a plain-PyTorch task (examples/shifted_lm.py): labels aligned with
input_ids and shifted inside the loss, left padding with position ids, tied embeddings. A clean
task raises no flag; each classic mistake is named by the check meant for it."""

import pytest

from workbook import WorkbookError, load_task
from workbook.contract.data import SPLITS, prepare
from workbook.notebooks.gates import GateRun, GateSettings
from workbook.notebooks.inspection import inspect_task
from workbook.notebooks.overfit import overfit
from workbook.training.checkpoint import tied_groups
from workbook.training.loop import UpdateShape

TASK = "examples.shifted_lm:task"


def flags(**options):
    return {f.check: f for f in inspect_task(load_task(TASK, **options)).flags}


def test_a_clean_shifted_left_padded_task_raises_no_flag():
    assert flags() == {}


def test_a_wrong_label_shift_declaration_is_named_with_the_alignment_the_loss_uses():
    found = flags(declared_shift=0)  # as declared, position t would copy its input token
    assert set(found) == {"label alignment", "targets copy the input"}
    assert "position t predicts labels[t + 1]" in found["label alignment"].message
    assert "label_shift=1" in found["label alignment"].fix


def test_left_padding_without_the_attention_mask_is_named():
    found = flags(drop_attention_mask=True)
    assert "padding changes outputs" in found
    assert "left-padded" in found["padding changes outputs"].message


def test_overfit_compares_the_argmax_with_the_shifted_targets():
    result = overfit(load_task(TASK), examples=4, updates=120, lr=3e-3)
    assert result.verdict == "pass", result.checks
    assert result.figures["exact_examples"] == 4


@pytest.mark.parametrize("declared", [1])
def test_gates_pass_with_left_padding_and_tied_weights(declared, tmp_path):
    task = load_task(TASK, declared_shift=declared)
    items = prepare(task, SPLITS).items
    model = task.build_model()
    assert tied_groups(model) == [("embed.weight", "head.weight")]
    report = GateRun(task, GateSettings(UpdateShape(2, 2), eval_batch=8, input_updates=2),
                     items["train"][:64],
                     items["validation"][:16], tmp_path / "gates").run()
    rows = {r.phase: r for r in report.rows}
    assert all(r.verdict == "pass" for r in report.rows), report.table()[["phase", "detail"]]
    assert rows["resume"].detail.endswith("max |diff| = 0")


def test_labels_aligned_with_the_inputs_but_never_shifted_are_named_as_copying():
    import dataclasses

    from workbook.contract.targets import target_accuracy, token_cross_entropy

    task = dataclasses.replace(load_task(TASK, declared_shift=0), loss=token_cross_entropy,
                               metrics=target_accuracy)  # the bug: nothing shifts the labels
    found = {f.check: f for f in inspect_task(task).flags}
    assert "targets copy the input" in found and "label_shift=1" in found[
        "targets copy the input"].fix
    assert "targets copy the input" not in flags(), "the clean task shifts: no flag"


# slow: notebook 09 under nbval runs tied embeddings through DDP and FSDP (its default
# task_options), and 03's resume gate on hf_gpt2 (lm_head tied to wte) is tested above
@pytest.mark.slow
def test_tied_weights_and_shifted_labels_through_resume_archive_and_data_parallel(tmp_path):
    from workbook.commands.pilot import run_pilot

    run, index = run_pilot(TASK, out=str(tmp_path / "run"), smoke=True, only="07,09",
                           progress=False)
    assert index.verdict.tolist() == ["pass", "pass"], index.error.tolist()


def test_a_hugging_face_gpt2_passes_inspection_overfit_and_the_gates(tmp_path):
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    task = load_task("examples.hf_gpt2:task")
    assert inspect_task(task).flags == []
    assert overfit(task, examples=4, updates=120, lr=3e-3).verdict == "pass"
    items = prepare(task, SPLITS).items
    model = task.build_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    report = GateRun(task, GateSettings(UpdateShape(2, 2, activation_checkpointing=True),
                                        eval_batch=8, input_updates=2),
                     items["train"][:64], items["validation"][:16], tmp_path / "gates").run()
    assert all(r.verdict == "pass" for r in report.rows), report.table()[["phase", "detail"]]


def test_a_train_override_that_leaves_submodules_in_eval_mode_fails_validation(tmp_path):
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    task = load_task("examples.hf_gpt2:task", sticky_eval=True)
    items = prepare(task, SPLITS).items
    report = GateRun(task, GateSettings(UpdateShape(2, 2), eval_batch=8, input_updates=1),
                     items["train"][:32], items["validation"][:16], tmp_path / "gates").run()
    rows = {r.phase: r for r in report.rows}
    assert rows["validation"].verdict == "fail"
    assert "stayed in eval mode while the model went back to training" in \
        rows["validation"].detail
    assert "transformer.drop" in rows["validation"].detail


def test_a_hugging_face_users_own_step_and_checkpoint_run_and_their_planted_bugs_are_named(
        tmp_path):
    """examples/hf_gpt2.py with own_loop=True: the update through the model's `labels=` loss
    and a `save_pretrained` checkpoint pass 04's gradient check and 03's save/resume gates; the
    pre-4.46 accumulation bug and a checkpoint without the optimizer are each named."""
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from workbook.notebooks.accounting import normalisation_check

    def own_rows(**planted):
        task = load_task("examples.hf_gpt2:task", own_loop=True, **planted)
        check = normalisation_check(task, prepare(task, SPLITS).items["train"][:8], (8, 2, 1))
        return check[check.normalisation == "the task's train_step"]

    assert own_rows().within_tolerance.all()
    wrong = own_rows(hf_mean_loss=True)
    assert not wrong.within_tolerance.all() and wrong.max_relative_deviation.max() > 1e-2

    def gates(name, **planted):
        task = load_task("examples.hf_gpt2:task", own_loop=True, **planted)
        items = prepare(task, SPLITS).items
        report = GateRun(task, GateSettings(UpdateShape(2, 2), eval_batch=8, input_updates=1),
                         items["train"][:32], items["validation"][:16], tmp_path / name).run()
        return {r.phase: r for r in report.rows}

    clean = gates("clean")
    assert clean["checkpoint save"].verdict == "pass" and clean["resume"].verdict == "pass"
    broken = gates("broken", ckpt_without_optimizer=True)["resume"]
    assert broken.verdict == "fail" and "did not bring back the optimizer" in broken.detail
    with pytest.raises(WorkbookError, match="own_loop=True"):
        load_task("examples.hf_gpt2:task", hf_mean_loss=True)
