import dataclasses

import pytest
import torch

from workbook import TrainConfig, WorkbookError, evaluate, train
from workbook.notebooks.accounting import update_gradients
from workbook.training.devices import resolve_device
from workbook.training.loop import UpdateShape


def _update_gradients(task, items, micro_batch, wrong=False):
    torch.manual_seed(0)
    model = task.build_model().eval()  # no dropout: the same examples must give the same update
    return update_gradients(task, model, items, micro_batch, mean_per_micro_batch=wrong)


@pytest.mark.parametrize("fixture", ["gen", "cls"])
def test_one_update_has_the_same_gradient_for_1x16_2x8_16x1(fixture, request):
    task = request.getfixturevalue(f"{fixture}_task")
    items = request.getfixturevalue(f"{fixture}_items")["train"][:16]
    lengths = {it.tensors["input_ids"].numel() for it in items}
    assert len(lengths) > 1, "the check needs sequences of different lengths"
    reference = _update_gradients(task, items, 16)
    for micro in (2, 1):
        grads = _update_gradients(task, items, micro)
        assert grads.keys() == reference.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-6)


def test_per_micro_batch_normalisation_is_caught(gen_task, gen_items):
    items = gen_items["train"][:16]
    right = _update_gradients(gen_task, items, 16)
    wrong = _update_gradients(gen_task, items, 2, wrong=True)
    worst = max(float((wrong[k] - right[k]).abs().max() / right[k].abs().max().clamp(min=1e-12))
                for k in right)
    assert worst > 1e-2


def test_train_records_every_update_and_learns(cls_task, cls_items):
    cfg = TrainConfig(UpdateShape(4, 2), updates=60, lr=3e-3, eval_every=20, device="cpu")
    result = train(cls_task, cls_items["train"], cfg, val_items=cls_items["validation"])
    steps = result.steps
    assert [s.step for s in steps] == list(range(1, 61))
    assert all(s.examples == 8 and s.micro_batches == 2 and len(s.example_ids) == 8
               for s in steps)
    assert [e.step for e in result.evals] == [20, 40, 60]
    first = sum(s.loss for s in steps[:5]) / 5
    last = sum(s.loss for s in steps[-5:]) / 5
    assert last < first * 0.8
    assert result.evals[-1].metrics["accuracy"] > 0.4  # five classes: chance is about 0.25


def test_partial_final_group_is_counted_with_its_real_size(cls_task, cls_items):
    items = cls_items["train"][:20]
    cfg = TrainConfig(UpdateShape(4, 2), updates=3, device="cpu")
    steps = train(cls_task, items, cfg).steps
    assert [s.examples for s in steps] == [8, 8, 4]
    assert [s.epoch for s in steps] == [0, 0, 0]
    assert len({i for s in steps for i in s.example_ids}) == 20


def test_evaluation_does_not_depend_on_eval_batch(gen_task, gen_items):
    torch.manual_seed(0)
    model = gen_task.build_model()
    items = gen_items["validation"][:37]
    a = evaluate(gen_task, model, items, 5, torch.device("cpu"))
    b = evaluate(gen_task, model, items, 37, torch.device("cpu"))
    assert a.targets == b.targets and a.loss == pytest.approx(b.loss, rel=1e-5)
    assert a.metrics["accuracy"] == pytest.approx(b.metrics["accuracy"])
    assert model.training, "evaluate restores training mode"


@pytest.mark.parametrize("change, words", [
    ({"shape": UpdateShape(0)},
     r"field 'shape.micro_batch' should be greater than or equal to 1 \(got 0\)"),
    ({"shape": UpdateShape(2, -1)}, r"field 'shape.accumulation' .* \(got -1\)"),
    ({"lr": 0.0}, r"field 'lr' should be greater than 0 \(got 0.0\)"),
    ({"lr": "1e-3", "seed": -1}, r"field 'lr' should be a valid number \(got '1e-3'\); field "
     r"'seed' should be greater than or equal to 0"),
    ({"updates": True}, r"field 'updates' should be a valid integer \(got True\)"),
    ({"shape": UpdateShape(10_000)}, "larger than the"),
    ({"device": "tpu"}, "unknown device"),
])
def test_bad_configuration_is_refused(change, words, cls_task, cls_items):
    cfg = dataclasses.replace(TrainConfig(updates=1, device="cpu"), **change)
    with pytest.raises(WorkbookError, match=words):
        train(cls_task, cls_items["train"], cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_an_error_not_a_fallback():
    with pytest.raises(WorkbookError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def test_update_without_targets_is_an_error(gen_task, gen_items):
    task = dataclasses.replace(gen_task, loss=lambda logits, batch: (logits.sum() * 0,
                                                                     torch.tensor(0)))
    with pytest.raises(WorkbookError, match="no contributing targets"):
        train(task, gen_items["train"][:4], TrainConfig(UpdateShape(2, 1), updates=1, device="cpu"))


def test_eval_mode_restores_the_mode_also_after_an_error():
    from workbook.contract.outputs import eval_mode

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with pytest.raises(RuntimeError):
        with eval_mode(model):
            assert not model.training and not torch.is_grad_enabled()
            raise RuntimeError("boom")
    assert model.training and torch.is_grad_enabled()
    model.eval()
    with eval_mode(model):
        pass
    assert not model.training, "a model in eval mode stays in eval mode"


def test_control_outputs_leave_a_training_model_training(gen_task, gen_items):
    from workbook.notebooks.resume.archive import control_outputs

    model = gen_task.build_model().train()
    control_outputs(gen_task, model, gen_items["validation"][:2])
    assert model.training


def test_an_update_shape_makes_the_loop_configuration():
    from workbook import UpdateShape

    shape = UpdateShape(4, 3, "bf16", True)
    cfg = TrainConfig(shape, updates=7, lr=0.5)
    assert (cfg.shape, cfg.updates, cfg.lr) == (shape, 7, 0.5)
    assert TrainConfig.from_dict(dataclasses.asdict(cfg)) == cfg
    # a recipe written before the shape was one field reads back the same
    flat = {**{k: v for k, v in dataclasses.asdict(cfg).items() if k != "shape"},
            **dataclasses.asdict(shape)}
    assert TrainConfig.from_dict(flat) == cfg
    with pytest.raises(WorkbookError, match="field 'microbatch' is not a field of the update "
                       "shape") as caught:
        UpdateShape.from_dict({"micro_batch": 2, "microbatch": 4})
    assert "its fields: micro_batch, accumulation" in caught.value.fix
    with pytest.raises(WorkbookError, match=r"field 'replicas' should be greater than or equal "
                       r"to 1 \(got 0\)"):
        UpdateShape(2, replicas=0).validate()
    with pytest.raises(WorkbookError, match=r"update shape: field 'micro_batch' should be a "
                       r"valid integer \(got '2'\); field 'precision' should be 'fp32', 'bf16' "
                       r"or 'fp16' \(got 'fp8'\)"):
        UpdateShape.from_dict({"micro_batch": "2", "precision": "fp8"})
    with pytest.raises(WorkbookError, match="update shape should be a valid dictionary"):
        UpdateShape.from_dict([2])
    with pytest.raises(WorkbookError, match="field 'x' is not a field of the training "
                       "configuration"):
        TrainConfig.from_dict({**dataclasses.asdict(cfg), "x": 1})
    assert TrainConfig.from_dict({**dataclasses.asdict(cfg), "lr": 1}).lr == 1  # kept an int
    with pytest.raises(WorkbookError, match=r"micro_batch 4 is larger than the 3 training "
                       r"examples; with drop_partial, one update needs 12 examples but there "
                       r"are 3") as caught:
        dataclasses.replace(cfg, drop_partial=True, device="cpu").validate(3)
    assert caught.value.fix.startswith("lower micro_batch or give the task more examples; ")
    with pytest.raises(WorkbookError, match="train runs one process"):
        train(None, [], TrainConfig(UpdateShape(1, replicas=2), updates=1, device="cpu"))


def test_cuda_resolves_to_the_current_device_index(monkeypatch):
    # tensors report "cuda:0": a bare "cuda" would never compare equal and forced needless
    # copies (a fake-tensor model cannot be copied at all)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_tasks_optimizer_factory_sees_the_run_it_is_built_for(cls_task, cls_items):
    """Schedules sized by the run (OneCycleLR over Lightning's estimated_stepping_batches, a
    Trainer's num_training_steps) read `current_run()` inside build_optimizer."""
    from workbook.training.loop import RunLength, current_run

    seen = []

    def build_optimizer(model, lr):
        seen.append(current_run())
        return torch.optim.SGD(model.parameters(), lr=lr)
    task = dataclasses.replace(cls_task, build_optimizer=build_optimizer)
    shape = UpdateShape(2, 2)
    train(task, cls_items["train"][:12], TrainConfig(shape, updates=3))
    assert seen == [RunLength(3, shape, 12)] and current_run() is None
