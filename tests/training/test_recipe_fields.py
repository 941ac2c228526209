"""The three fields torchvision's reference recipe needs (examples/torchvision_recipe.py): a
training collate apart from the evaluation one, a schedule stepped per pass, and an averaged
model built once, evaluated beside the model and carried by every checkpoint."""

import dataclasses

import pytest
import torch

from workbook import WorkbookError
from workbook.contract.data import prepare
from workbook.contract.task import load_task, validate_task
from workbook.notebooks import resume
from workbook.notebooks.accounting import batch_draws
from workbook.training.loop import TrainConfig, UpdateShape, train

TASK = "examples.torchvision_recipe:task"
SHAPE = UpdateShape(4, 2)  # 8 examples an update: 48 training examples make 6 updates a pass


@pytest.fixture(scope="module")
def data():
    return prepare(load_task(TASK), ("train", "validation"), {"train": 48, "validation": 12})


def halving(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)


@pytest.mark.parametrize("interval", ["pass", "update"])
def test_the_schedule_steps_once_per_pass_or_once_per_update(interval, data):
    task = dataclasses.replace(load_task(TASK), build_scheduler=halving,
                               scheduler_interval=interval, averaged_model=None)
    steps = train(task, data.train, TrainConfig(SHAPE, updates=15, lr=0.1)).steps
    lrs = [s.lr for s in steps]
    if interval == "pass":  # 6 updates a pass: 0.1 x 6, 0.05 x 6, 0.025 x 3
        assert [s.epoch for s in steps] == [0] * 6 + [1] * 6 + [2] * 3
        assert lrs == pytest.approx([0.1] * 6 + [0.05] * 6 + [0.025] * 3)
    else:
        assert lrs == pytest.approx([0.1 * 0.5 ** i for i in range(15)])


@pytest.mark.parametrize("change, words", [
    ({"scheduler_interval": "epoch"}, "`scheduler_interval` must be 'update' or 'pass'"),
    ({"scheduler_interval": "pass", "build_scheduler": None}, "give `build_scheduler` too"),
    ({"average_every": 0}, "`average_every` must be a whole number"),
])
def test_a_field_out_of_its_values_is_refused_with_the_fix(change, words):
    with pytest.raises(WorkbookError, match=words.replace("(", r"\(")) as caught:
        validate_task(dataclasses.replace(load_task(TASK), **change))
    assert caught.value.fix


def test_the_training_collate_serves_training_and_never_evaluation(data):
    task = load_task(TASK)
    calls = {"train": 0, "eval": 0}

    def counted(fn, key):
        def collate(batch):
            calls[key] += 1
            return fn(batch)
        return collate

    task = dataclasses.replace(task, collate=counted(task.collate, "eval"),
                               train_collate=counted(task.train_collate, "train"))
    result = train(task, data.train, TrainConfig(SHAPE, updates=3, lr=0.05, eval_every=3),
                   val_items=data.validation)
    assert calls["train"] == 3 * SHAPE.accumulation  # one call per training micro-batch
    assert calls["eval"] == 2  # the model's and the averaged model's evaluation, one batch each
    assert len(result.evals) == 1


def test_04_finds_the_mixing_in_the_training_collate_and_not_without_it(data):
    found = batch_draws(load_task(TASK), data.train[:8])
    assert [d.piece for d in found] == ["train_collate"] and found[0].mixes
    assert "your train_collate draws new random numbers" in found[0].words()
    assert batch_draws(load_task(TASK, mixup_alpha=0.0, cutmix_alpha=0.0),
                       data.train[:8]) == []  # the clean twin: no training collate


def test_the_averaged_model_is_built_once_updated_every_n_and_evaluated_beside(data):
    task = load_task(TASK, ema_steps=2)
    built = []
    factory = task.averaged_model
    task = dataclasses.replace(task, averaged_model=lambda m: built.append(1) or factory(m))
    result = train(task, data.train, TrainConfig(SHAPE, updates=7, lr=0.05, eval_every=4),
                   val_items=data.validation)
    assert len(built) == 1 and int(result.averaged.n_averaged) == 3  # after updates 2, 4, 6
    assert [sorted(e.averaged) for e in result.evals] == [["accuracy", "loss"]] * 2
    assert result.evals[0].averaged["loss"] != result.evals[0].loss


def test_an_averaged_model_without_update_parameters_is_refused(data):
    task = dataclasses.replace(load_task(TASK), averaged_model=lambda m: {"copy": m})
    with pytest.raises(WorkbookError, match="not a module with update_parameters"):
        train(task, data.train, TrainConfig(SHAPE, updates=1))


def _resumed(tmp_path, options):
    spec = resume.recipe(TASK, options, TrainConfig(SHAPE, updates=9, lr=0.05), 48)
    reference, weights = resume.run_recipe(spec, 9, tmp_path, checkpoint_at=(8,))
    resumed, w = resume.run_recipe(spec, 9, start_from=tmp_path / "ckpt-000008")
    return spec, reference, weights, resume.compare(reference, resumed, weights, w)[1]


@pytest.mark.parametrize("own", [False, True])
def test_a_resume_brings_the_averaged_model_back_exactly(own, tmp_path):
    spec, reference, weights, verdict = _resumed(tmp_path, {"own_checkpoint": own})
    assert verdict["exact"] and verdict["max_averaged_model_diff"] == 0.0, verdict
    assert any(k.startswith(resume.AVERAGED) for k in weights)
    if not own:  # the workbook's format: the planted restore without it is caught
        faults = resume.planted_faults(spec, 9, 8, tmp_path, reference, weights)
        row = faults[faults["planted bug"].str.startswith("averaged model")]
        assert len(row) == 1 and bool(row.caught.iloc[0])


def test_a_save_state_that_drops_the_averaged_model_is_caught(tmp_path):
    spec = resume.recipe(TASK, {"ema_in_checkpoint": False}, TrainConfig(SHAPE, updates=9,
                                                                         lr=0.05), 48)
    resume.run_recipe(spec, 9, tmp_path, checkpoint_at=(8,))
    with pytest.raises(WorkbookError, match="did not bring back the averaged_model state"):
        resume.run_recipe(spec, 9, start_from=tmp_path / "ckpt-000008")
