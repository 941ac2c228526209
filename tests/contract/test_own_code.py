"""The task's own step, evaluation and checkpoint code judged as the campaign runs it, on a task
written the way users write theirs (tests/careful_task.py): each planted classic is named, the
clean twin raises nothing."""

import pandas as pd
import pytest
import torch

from workbook import WorkbookError
from workbook.contract.data import prepare
from workbook.contract.task import load_task
from workbook.notebooks import accounting as acc
from workbook.notebooks.accounting.own_code_checks import clipping_held_off
from workbook.training import checkpoint as ckpt
from workbook.training.loop import HeldBehaviour, TrainConfig, UpdateShape, train

TASK = "tests.careful_task:task"


def _items(**options):
    task = load_task(TASK, **options)
    prepared = prepare(task)
    return task, prepared.train, prepared.validation


def test_a_clean_step_with_model_train_dropout_and_batch_norm_passes_the_normalisation_check():
    task, items, _ = _items()
    check = acc.normalisation_check(task, items[:8], (8, 2, 1))
    own = check[check.normalisation == "the task's train_step"]
    assert own.within_tolerance.all(), own  # was 0.46-1.6 with the step's model.train()


@pytest.mark.parametrize("clip_by_name", [False, True])
def test_a_step_that_means_per_micro_batch_is_still_named_through_its_clipping(clip_by_name):
    """Clipping held off however the step reaches it: `torch.nn.utils.clip_grad_norm_` or
    `from torch.nn.utils import clip_grad_norm_` at the top of the user's module. The norm is
    so small that every split is clipped: a step k times too large would read as exact."""
    task, items, _ = _items(mean_per_micro_batch=True, clip_by_name=clip_by_name,
                            clip_norm=1e-3)
    check = acc.normalisation_check(task, items[:8], (8, 2, 1))
    own = check[check.normalisation == "the task's train_step"]
    assert not own.within_tolerance.iloc[1:].any()
    clean_task, _, _ = _items(clip_by_name=clip_by_name, clip_norm=1e-3)
    clean = acc.normalisation_check(clean_task, items[:8], (8, 2, 1))
    assert clean[clean.normalisation == "the task's train_step"].within_tolerance.all()
    from tests import careful_task
    assert careful_task.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_  # given back


def test_clipping_held_off_reaches_a_closure_and_gives_every_binding_back():
    from torch.nn.utils import clip_grad_norm_ as clip

    def step():
        return clip

    original = torch.nn.utils.clip_grad_norm_
    with clipping_held_off(step):
        assert step() is not original and torch.nn.utils.clip_grad_norm_ is not original
        weight = torch.nn.Parameter(torch.ones(3))
        weight.grad = torch.full((3,), 10.0)
        step()([weight], 1.0)
        assert torch.equal(weight.grad, torch.full((3,), 10.0))  # measured, not clipped
    assert step() is original and torch.nn.utils.clip_grad_norm_ is original


def test_held_behaviour_keeps_eval_behaviour_and_gives_every_mode_back():
    model = load_task(TASK).build_model()
    model.train()
    model[3].eval()  # a mixed state must come back as it was
    with HeldBehaviour(model) as held:
        model.train()
        assert not any(m.training for m in model.modules())
    assert held.sets_train_mode
    assert model.training and not model[3].training and model[1].training
    assert "train" not in vars(model) and "train" not in vars(model[1])
    own = model.train = lambda mode=True: model  # a task's own override on the instance
    with HeldBehaviour(model):
        model.train()
    assert vars(model)["train"] is own


def test_the_step_loss_agrees_with_the_task_loss_and_another_loss_is_named():
    task, items, _ = _items()
    clean = acc.step_loss_check(task, items[:8])
    assert clean.agree.all() and clean.train_step_sets_train_mode.all()
    task, items, _ = _items(label_smoothing=0.2, returns="float")
    other = acc.step_loss_check(task, items[:8])
    assert not other.agree.all() and other.divided_by.isna().all()  # another loss, not 1/k


@pytest.mark.planted
def test_a_step_dividing_its_loss_again_is_named_with_the_divisor_measured_on_the_gradient():
    """A loss divided by hand by the accumulation steps before a backward that divides again
    (huggingface/accelerate#3533): its loss and the gradient it steps with both 1/k of the
    task's, measured - not another objective."""
    task, items, _ = _items(divide_by=4)
    check = acc.step_loss_check(task, items[:8])
    assert check.divided_by.tolist() == [4]
    assert abs(check.gradient_ratio.iloc[0] - 0.25) < 1e-4
    assert acc.own_code_checks.divided_by(0.5, 0.7) is None  # the gradient must agree
    assert acc.own_code_checks.divided_by(1.3, 1.3) is None


def test_a_step_returning_a_dict_trains():
    task, items, _ = _items()
    steps = train(task, items, TrainConfig(UpdateShape(4, 2), updates=3, lr=1e-3)).steps
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(s.loss)) for s in steps)


def test_a_step_returning_something_else_is_refused_with_the_fix():
    from dataclasses import replace

    task, items, _ = _items()
    step = task.train_step
    task = replace(task, train_step=lambda m, o, b: {"logits": step(m, o, b)["loss"]})
    with pytest.raises(WorkbookError, match="returned a dict with keys \\['logits'\\]"):
        train(task, items, TrainConfig(UpdateShape(4, 1), updates=1))


def test_a_careful_eval_step_passes_and_each_planted_evaluation_bug_is_named():
    task, _, val = _items()
    clean = acc.evaluation_check(task, val[:10], sets_train_mode=False)
    assert clean.ok.all() and acc.evaluation_findings(clean) == []
    named = {
        "eval_counts_padding": "counts the padding copies",
        "eval_without_eval_mode": "evaluates with dropout and batch statistics on",
        "eval_leaves_eval_mode": "leaves the model in eval mode",
    }
    for option, words in named.items():
        task, _, val = _items(**{option: True})
        found = acc.evaluation_findings(acc.evaluation_check(task, val[:10]))
        assert any(words in f for f in found), (option, found)


def test_eval_mode_left_behind_is_harmless_when_the_step_sets_train_mode_itself():
    task, _, val = _items(eval_leaves_eval_mode=True)
    check = acc.evaluation_check(task, val[:10], sets_train_mode=True)
    assert acc.evaluation_findings(check) == []


def test_the_loop_evaluates_with_the_task_eval_step():
    from workbook.training.evaluation import evaluation_sums

    for counts_padding, counted in ((False, 10), (True, 12)):  # 10 examples in batches of 4
        task, _, val = _items(eval_counts_padding=counts_padding)
        sums, _ = evaluation_sums(task, task.build_model(), val[:10], 4, torch.device("cpu"))
        assert sums["accuracy"][1] == counted


def test_the_checkpoint_objects_carry_the_sampler_and_step_and_a_restarting_restore_is_named(
        tmp_path):
    from workbook.notebooks.resume import recipe, run_recipe

    cfg = TrainConfig(UpdateShape(4, 2), updates=6)
    for restarts in (False, True):
        spec = recipe(TASK, {"restore_reseeds_sampler": restarts}, cfg)
        folder = tmp_path / str(restarts)
        reference, weights = run_recipe(spec, 6, folder, checkpoint_at=(3,))
        saved = torch.load(folder / "ckpt-000003" / "training.pt", weights_only=True)
        assert saved["step"] == {"step": 3} and "generator" in saved["sampler"]
        if restarts:  # the order starts over: the sampler is not what was saved
            with pytest.raises(WorkbookError, match="did not bring back the sampler state"):
                run_recipe(spec, 6, start_from=folder / "ckpt-000003")
        else:
            resumed, again = run_recipe(spec, 6, start_from=folder / "ckpt-000003")
            assert resumed == reference[3:]
            assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_a_restore_that_leaves_the_sampler_alone_leaves_it_to_the_workbook(tmp_path):
    from dataclasses import replace

    task, items, _ = _items()

    def model_only_save(folder, objects):
        torch.save(objects["model"].state_dict(), folder / "w.pt")

    def model_only_restore(folder, objects):
        objects["model"].load_state_dict(torch.load(folder / "w.pt", weights_only=True))

    task = replace(task, save_state=model_only_save, restore_state=model_only_restore)
    from workbook.training.loop import build_stepper, make_sampler

    cfg = TrainConfig(UpdateShape(4, 2), updates=2)
    stepper = build_stepper(task, cfg)
    stepper.sampler = make_sampler(task, len(items), 0)
    train(task, items, cfg, stepper=stepper)
    path = ckpt.save_checkpoint(tmp_path / "c", stepper.model, counters={"step": 2},
                                own=task.save_state, sampler=stepper.sampler)
    fresh = build_stepper(task, cfg)
    ckpt.load_checkpoint(path, fresh.model, own=task.restore_state,
                         sampler=make_sampler(task, len(items), 0))  # raises nothing


def _notebook_04(tmp_path, **options):
    from workbook.commands import params

    p = params.of("04_batch_accounting", small=True, task=TASK, task_options=options)
    tmp_path.mkdir()
    result = acc.run(p, tmp_path)
    return acc.save(result, tmp_path), result.findings


def test_notebook_04_passes_the_careful_task_and_names_its_planted_step(tmp_path):
    assert _notebook_04(tmp_path / "clean") == ("pass", [])  # batch norm: 21 -> 20 examples
    verdict, findings = _notebook_04(tmp_path / "mean", mean_per_micro_batch=True)
    assert verdict == "fail"
    assert findings[0].startswith("your train_step's gradient depends on how the update is "
                                  "split")
    # each micro-batch's mean back-propagated as is: exactly k times, and said so
    assert "the loss is not divided by the number of micro-batches" in findings[0]
    assert "(2 x 4: 4 times, 1 x 8: 8 times)" in findings[0]


def test_a_gradient_k_times_too_large_is_told_apart_from_another_normalisation():
    rows = pd.DataFrame({"micro_batch x accumulation": ["4 x 2", "2 x 4"],
                         "max_relative_deviation": [1.0, 3.0000004]})
    assert acc.k_times_too_large(rows) == "4 x 2: 2 times, 2 x 4: 4 times"
    rows["max_relative_deviation"] = [0.31, 0.52]  # unequal micro-batches: another error
    assert acc.k_times_too_large(rows) == ""


def test_batch_norm_meeting_a_single_example_is_named_with_the_campaign_fix():
    task, items, _ = _items()
    with pytest.raises(WorkbookError, match="batch norm cannot train on a micro-batch of 1 "
                                            r"example \(this update's micro-batches hold "
                                            r"\[2, 1\]"):
        train(task, items[:3], TrainConfig(UpdateShape(2, 2), updates=1))
