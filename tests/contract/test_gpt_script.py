"""examples/gpt_script.py: a GPT written as the public single-file scripts write it (forward(idx,
targets) -> (logits, loss), configure_optimizers with decay/no-decay groups, a block_size
position table) is a Task with no wrapper class. Its outputs are found, a short train runs, each
planted bug is named by the check meant for it and the clean twin raises nothing."""

import dataclasses
import math

import pytest
import torch

from workbook import TrainConfig, WorkbookError, load_task, train
from workbook.commands import params
from workbook.contract.data import SPLITS, collate_items, prepare
from workbook.notebooks.gates import GateRun, GateSettings, run
from workbook.notebooks.inspection import inspect_task
from workbook.training.loop import UpdateShape

TASK = "examples.gpt_script:task"


@pytest.fixture(scope="module")
def clean():
    return load_task(TASK)


@pytest.fixture(scope="module")
def items(clean):
    return prepare(clean, SPLITS).items


def flags(**options):
    return {f.check: f for f in inspect_task(load_task(TASK, **options)).flags}


def test_the_targets_reach_forward_and_the_tuple_is_read(clean, items):
    model = clean.build_model().eval()
    batch = collate_items(clean, items["train"][:4]).tensors
    args, kwargs = clean.forward_arguments(model, batch)
    assert len(args) == 1 and set(kwargs) == {"targets"}  # idx by position, labels as targets
    with torch.no_grad():
        out = clean.outputs(model, batch)
    assert out.logits.shape == (*batch["labels"].shape, 256)
    summed, count = clean.loss(out.logits, batch)
    assert float(out.loss) == pytest.approx(float(summed) / float(count), rel=1e-5)
    assert math.log(256) * 0.9 < float(out.loss) < math.log(256) * 1.1


def test_without_the_targets_the_last_position_logits_are_refused_with_the_fix(clean, items):
    task = dataclasses.replace(clean, model_inputs=("input_ids",))
    batch = collate_items(task, items["train"][:2]).tensors
    with pytest.raises(WorkbookError, match=r"(?s)Tensor\[2, 1, 256\].*cover 1 position of "
                                            r"64.*model_inputs=\('input_ids', 'labels'\)"):
        task.forward(task.build_model(), batch)


def test_a_short_train_runs_on_the_tasks_own_optimizer(clean, items):
    result = train(clean, items["train"][:16], TrainConfig(UpdateShape(2, 2), updates=4,
                                                           lr=3e-3, device="cpu"))
    losses = [r.loss for r in result.steps]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert [g["weight_decay"] for g in result.optimizer.param_groups] == [0.1, 0.0]


def test_the_clean_task_raises_no_flag_in_01():
    assert flags() == {}


def test_targets_off_by_one_are_named_without_the_label_shift_fix():
    found = flags(targets_off_by_one=True)
    assert set(found) == {"targets copy the input"}
    fix = found["targets copy the input"].fix
    assert "label_shift=1" not in fix and "y = data[i + 1:i + 1 + T]" in fix
    assert "its model" in fix


def test_a_model_loss_that_shifts_again_is_named():
    found = flags(model_shifts=True)
    assert set(found) == {"model's own loss"}
    assert "is not the task's loss" in found["model's own loss"].message


def gate_rows(task, items, tmp_path):
    report = GateRun(task, GateSettings(UpdateShape(2, 2), eval_batch=8, input_updates=2),
                     items["train"][:48], items["validation"][:16], tmp_path / "gates").run()
    return {r.phase: r for r in report.rows}


def test_03_notes_decay_of_norms_and_biases_as_a_convention_and_passes(clean, items, tmp_path):
    rows = gate_rows(clean, items, tmp_path / "clean")
    assert all(r.verdict == "pass" for r in rows.values()), {p: r.detail for p, r in rows.items()}
    planted = load_task(TASK, decay_everything=True)
    rows = gate_rows(planted, items, tmp_path / "planted")
    first = rows["update (first)"]
    # a convention (torchvision's recipe decays everything), not a finding: the gate passes
    assert first.verdict == "pass" and "note: weight decay 0.1 applies to 18 norm" in \
        first.detail
    assert "a convention, not an error" in first.detail
    assert "transformer.h.0.ln_1.weight" in first.detail
    assert all(r.verdict == "pass" for r in rows.values())


def test_03_fails_a_plan_longer_than_the_block_size_in_the_models_own_words(tmp_path):
    common = dict(small=True, task=TASK, train_limit=60)
    refused = run(params.of("03_phase_gates", plan_length=256, **common), tmp_path / "long")
    assert refused.verdict == "fail" and refused.report.verdict == "pass"
    # the model's own words at the first length past its limit (the fine run below plans 64)
    assert "at 65 positions its forward says AssertionError: Cannot forward sequence of length " \
        "65, block size is only 64" in refused.plan_refused
    assert "plan_length=64" in refused.plan_refused and "position table" in \
        refused.plan_refused
    fine = run(params.of("03_phase_gates", **common), tmp_path / "fits")
    assert fine.verdict == "pass" and fine.plan_refused is None
    assert fine.plan.length == 64  # plan_length 0: the model's block_size
    assert fine.planned.predicted_peak_bytes.notna().all()


def test_no_weight_decay_at_all_raises_nothing(clean, items, tmp_path):
    from examples.gpt_script import build_optimizer

    task = dataclasses.replace(load_task(TASK, decay_everything=True),
                               build_optimizer=lambda m, lr: build_optimizer(m, lr, 0.0))
    rows = gate_rows(task, items, tmp_path)
    assert rows["update (first)"].verdict == "pass", rows["update (first)"].detail


def test_the_model_runs_on_fake_tensors_for_the_memory_prediction(clean, items):
    from workbook.training.predict import Plan, predict

    frame = predict(clean, items["train"][:32], items["validation"][:8],
                    Plan(UpdateShape(2, 2), 64, 4))
    assert frame.predicted_peak_bytes.notna().all() and (frame.note == "").all()
    assert torch.is_tensor(clean.forward(clean.build_model(), collate_items(
        clean, items["validation"][:2]).tensors))


def test_a_model_that_shifts_copied_targets_itself_is_offered_the_label_shift_declaration():
    """Targets that copy the input, read by a model whose own loss shifts them (the Hugging
    Face convention): declaring label_shift=1 is then the fix, not shifting the data."""
    found = flags(targets_off_by_one=True, model_shifts=True)
    assert "label_shift=1" in found["targets copy the input"].fix
    assert "model's own loss" in found
