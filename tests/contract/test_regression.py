"""Regression (float targets) through the pilot's checks: a clean plain-PyTorch MLP task
(examples/regression.py) raises no flag and fails no gate; each planted bug is named by the
check meant for it."""

import math

import pytest
import torch

from workbook import load_task
from workbook.contract.data import prepare
from workbook.notebooks.gates import GateRun, GateSettings
from workbook.notebooks.inspection import inspect_task
from workbook.notebooks.overfit import overfit
from workbook.training.evaluation import evaluate
from workbook.training.loop import UpdateShape
from workbook.training.predict import Plan, predict

TASK = "examples.regression:task"


def flags(**options):
    return [f.check for f in inspect_task(load_task(TASK, **options)).flags]


def gates(tmp_path, **options):
    task = load_task(TASK, **options)
    data = prepare(task, limits={"train": 64, "validation": 20})  # the first of each split
    report = GateRun(task, GateSettings(UpdateShape(4, 2), eval_batch=16, input_updates=2),
                     data.train, data.validation, tmp_path / "gates").run()
    return {r.phase: r for r in report.rows}


def test_a_clean_regression_task_raises_no_flag_and_shows_target_statistics():
    ins = inspect_task(load_task(TASK))
    assert ins.flags == [] and ins.verdict == "pass"
    assert list(ins.classes.columns) == ["train", "validation", "test"]
    assert ins.classes.loc["targets"].sum() == 512
    # an untrained MLP outputs about 0: the initial loss is about mean(target^2)
    assert 2 < ins.figures["expected_initial_loss"] < 5


def test_overfit_checks_values_not_ids_against_the_spread_of_the_targets():
    result = overfit(load_task(TASK), examples=8, updates=150, lr=3e-3)
    assert result.verdict == "pass", result.checks
    checks = result.checks.set_index("check")
    assert "mean(target^2)" in checks.index[0]
    assert checks.loc["targets reproduced within sqrt(final loss bar)", "passed"]


def test_gates_pass_on_float_targets(tmp_path):
    rows = gates(tmp_path)
    assert all(r.verdict == "pass" for r in rows.values()), {p: r.detail for p, r in
                                                             rows.items()}
    assert "mean(target^2)" in rows["forward + loss"].detail


@pytest.mark.parametrize("batch", [1, 3, 7, 64])
def test_evaluation_padding_copies_weigh_nothing_for_float_targets(batch):
    """The last evaluation batch is padded with copies whose targets are NaN (and weight 0):
    the loss is the same for every evaluation batch size."""
    task = load_task(TASK)
    items = prepare(task).items["validation"][:20]
    torch.manual_seed(0)
    model = task.build_model()
    reference = evaluate(task, model, items, 20, torch.device("cpu"))
    record = evaluate(task, model, items, batch, torch.device("cpu"))
    assert math.isclose(record.loss, reference.loss, rel_tol=1e-6)
    assert math.isclose(record.metrics["mae"], reference.metrics["mae"], rel_tol=1e-6)


def test_the_regression_loss_runs_in_the_memory_prediction():
    task = load_task(TASK)
    data = prepare(task, limits={"train": 40, "validation": 8})
    predicted = predict(task, data.train, data.validation, Plan(UpdateShape(4, 2)))
    assert (predicted.predicted_peak_bytes > 0).all() and (predicted.note == "").all()


def test_nan_inputs_are_named():
    assert flags(nan_inputs=True) == ["non-finite inputs"]


def test_dropout_active_in_eval_is_named_by_inspection_and_the_validation_gate(tmp_path):
    assert flags(dropout_in_eval=True) == ["random outputs in eval mode"]
    validation = gates(tmp_path, dropout_in_eval=True)["validation"]
    assert validation.verdict == "fail" and "dropout" in validation.detail


def test_a_mean_loss_with_count_one_is_named():
    """mse_loss's mean with a count of 1 weighs micro-batches instead of examples when updates
    accumulate, and reads the NaN targets of evaluation's padding copies."""
    assert flags(mean_loss=True) == ["loss target count", "loss reads padding copies"]


def test_one_hard_update_is_not_a_divergence(tmp_path):
    """Per-update regression losses are heavy-tailed; the study's divergence rule compares
    medians of 5 updates, so a clean task at a small learning rate finishes every trial."""
    from workbook.notebooks.study import Study, StudyDesign

    plan = StudyDesign(name="r", task=TASK, lrs=[1e-4, 3e-4], seeds=[0], updates=30,
                       shape=UpdateShape(2, 1), eval_every=10, eval_batch=16)
    study = Study(tmp_path / "study", plan)
    study.run_all()
    assert set(study.trial_table().status) == {"finished"}, study.trial_table()
    # the top-N checkpoints are written by the task's own save_state and read back by its
    # restore_state for the retrospective full evaluation
    kept = sorted((tmp_path / "study").rglob("step-*"))
    assert kept and all((k / "training_state.pt").is_file() for k in kept)
    assert study.best()["best_checkpoint"]


def test_an_optimizer_that_leaves_out_a_layer_fails_the_update_gate(tmp_path):
    """build_optimizer(model, lr) receives the model: parameter groups by name are possible,
    and so is forgetting one - the update gate names the tensors left out."""
    clean = gates(tmp_path / "clean")
    assert clean["update (first)"].verdict == "pass"
    forgot = gates(tmp_path / "forgot", forget_head=True)["update (first)"]
    assert forgot.verdict == "fail" and "not in the optimizer" in forgot.detail


def test_the_task_learning_rate_fills_lr_zero_and_leaves_the_study_to_its_range_test():
    from workbook.commands.params import of

    assert of("06_lr_study", task=TASK).lrs == []  # 06's range test places the grid
    p = of("03_phase_gates", task=TASK)
    assert (p.lr, p.lr_from) == (3e-3, "task")
    given = of("03_phase_gates", task=TASK, lr=0.1)
    assert (given.lr, given.lr_from) == (0.1, "parameter")
    sample = of("03_phase_gates", task="workbook.samples.generation:task")
    assert (sample.lr, sample.lr_from) == (1e-3, "fallback")


def test_an_old_style_build_optimizer_gets_a_clear_error():
    import dataclasses

    from workbook import WorkbookError
    from workbook.training.loop import TrainConfig, build_stepper

    task = dataclasses.replace(load_task(TASK), build_optimizer=lambda params, lr:
                               torch.optim.SGD(list(params), lr=lr))
    with pytest.raises(WorkbookError, match="receives the model: pass model.parameters()"):
        build_stepper(task, TrainConfig(UpdateShape(2, 1)))


def test_a_checkpoint_without_the_optimizer_state_is_named_by_03s_resume_gate(tmp_path):
    """save_state/restore_state are the task's: 03's resume gate runs them (its clean pass is
    test_gates_pass_on_float_targets; 07's exact resume in a new process is the sampler test's,
    its naming of the same planted bug test_notebook_07_fails_a_lost_optimizer_state...)."""
    broken = gates(tmp_path / "broken", ckpt_without_optimizer=True)["resume"]
    assert broken.verdict == "fail"
    assert "restore_state did not bring back the optimizer state" in broken.detail


def test_a_slow_getitem_makes_the_data_gate_warn_with_its_cost(tmp_path):
    """The training loader encodes every raw example again on every pass, as a campaign's
    Dataset does: the data gate's measured wait includes it, and names its share."""
    slow = gates(tmp_path / "slow", slow_getitem=True)["data"]
    assert slow.verdict == "warn" and "input-bound" in slow.detail
    assert "ms per example, paid on every pass" in slow.detail


@pytest.mark.parametrize("each_pass", [True, False])
def test_the_training_loader_encodes_on_every_pass(each_pass):
    import dataclasses

    from workbook.training.loop import TrainConfig, train

    base = load_task(TASK)
    calls = []

    def counted(example):
        calls.append(example["id"])
        return base.encode(example)

    task = dataclasses.replace(base, encode=counted, train_step=None)
    items = prepare(task).train[:12]
    calls.clear()
    cfg = TrainConfig(UpdateShape(2, 2), updates=6, encode_each_pass=each_pass)
    result = train(task, items, cfg)  # two passes of three updates
    assert len(calls) == (24 if each_pass else 0)
    assert sorted(calls) == (sorted([it.id for it in items] * 2) if each_pass else [])
    assert all(s.data_s > 0 for s in result.steps)


@pytest.mark.parametrize("reseeded", [False, True])
def test_the_tasks_own_sampler_resumes_its_order_or_is_named(reseeded, tmp_path):
    """make_sampler is the task's data order; a sampler whose state travels in the checkpoint
    (written and read by the task's own save_state/restore_state) resumes exactly in a new
    process, one without state restarts its order - the comparison names the first update
    whose examples differ (resumed in this process: a reseeded sampler restarts the same in
    any process, and the new process is the clean twin's to prove)."""
    from workbook.notebooks import resume
    from workbook.training.loop import TrainConfig

    options = {"sampler_reseeded": True} if reseeded else {}
    spec = resume.recipe(TASK, options, TrainConfig(UpdateShape(4, 2), updates=12),
                         40)  # 5 updates per pass: the resume after 7 is inside pass 2
    reference, ref_weights = resume.run_recipe(spec, 12, tmp_path / "ref", checkpoint_at=(7,))
    assert reference[5]["ids"] != reference[0]["ids"]  # the order changes every pass
    assert sorted(p.name for p in (tmp_path / "ref" / "ckpt-000007").iterdir()) == [
        "manifest.json", "meta.json", "state.pt", "training_state.pt"]
    checkpoint = tmp_path / "ref" / "ckpt-000007"
    resumed, weights = (resume.run_recipe(spec, 12, start_from=checkpoint) if reseeded else
                        resume.resume_in_new_process(checkpoint, 12, tmp_path / "resumed", spec))
    table, verdict = resume.compare(reference, resumed, ref_weights, weights)
    if reseeded:
        assert not verdict["exact"] and verdict["examples_differ_from"] == 8
    else:
        assert verdict["exact"] and verdict["examples_differ_from"] is None, table


@pytest.mark.parametrize("planted", [False, True])
def test_the_tasks_own_train_step_gives_one_gradient_for_any_split(planted):
    """1 x N = 2 x N/2 = N x 1 through the task's own step (a recording optimizer takes the
    gradient at its one step); a step that back-propagates each micro-batch's mean is named."""
    from workbook.notebooks.accounting import normalisation_check

    task = load_task(TASK, step_mean_per_micro_batch=planted)
    items = prepare(task).train[:16]
    check = normalisation_check(task, items, (16, 2, 1))
    own = check[check.normalisation == "the task's train_step"]
    assert len(own) == 3 and own.max_relative_deviation.iloc[0] == 0
    assert own.within_tolerance.all() != planted, own


def test_notebook_07_fails_a_lost_optimizer_state_with_the_cause_in_its_cases(tmp_path,
                                                                           monkeypatch):
    """The resumed process's error comes back with its cause (one new process); 07's cases
    turn it into their rows (the same resume in this process: a failed case is a row, not a
    crash), and the planted faults are all caught."""
    from workbook import WorkbookError
    from workbook.notebooks import resume
    from workbook.training.loop import TrainConfig

    spec = resume.recipe(TASK, {"ckpt_without_optimizer": True},
                         TrainConfig(UpdateShape(4, 2), updates=8), 40)
    in_new_process = resume.resume_in_new_process

    def in_this_process(checkpoint, to_step, out, spec, faults=(), save_at=0):
        assert not faults and not save_at
        return resume.run_recipe(spec, to_step, start_from=checkpoint)

    monkeypatch.setattr(resume, "resume_in_new_process", in_this_process)
    cases, details = resume.check_cases(spec, 8, 7, 5, tmp_path)
    assert list(cases.case) == ["mid-epoch", "epoch boundary"] and not cases.exact.any()
    assert cases.error.str.contains("did not bring back the optimizer state").all()
    with pytest.raises(WorkbookError, match="the resumed process failed: .*did not bring back "
                       "the optimizer state"):
        in_new_process(tmp_path / "ckpt-000007", 8, tmp_path / "resumed", spec)
    faults = resume.planted_faults(spec, 8, 7, tmp_path, details["reference"],
                                   details["weights"])
    assert faults.caught.all()


def test_a_sampler_that_cannot_serve_the_loop_is_a_clear_error():
    import dataclasses

    from workbook import WorkbookError
    from workbook.training.loop import Position, TrainConfig, train

    task = load_task(TASK)
    items = prepare(task).train[:16]
    cfg = TrainConfig(UpdateShape(4, 1), updates=2)
    beyond = dataclasses.replace(task, make_sampler=lambda n, seed: range(n + 3))
    with pytest.raises(WorkbookError, match=r"indices outside 0..15"):
        train(beyond, items, cfg)

    class NoLoad:
        def __init__(self, n, seed):
            self.n = n

        def __iter__(self):
            return iter(range(self.n))

        def state_dict(self):
            return {}

    half = dataclasses.replace(task, make_sampler=NoLoad)
    with pytest.raises(WorkbookError, match="no load_state_dict"):
        train(half, items, cfg, start=Position(1, 0, {}))


def test_a_save_state_that_raises_is_named_and_leaves_no_checkpoint(tmp_path):
    import dataclasses

    from workbook import WorkbookError
    from workbook.training.checkpoint import save_checkpoint

    def broken(folder, objects):
        raise OSError("planted: the user's save failed")
    task = dataclasses.replace(load_task(TASK), save_state=broken)
    model = task.build_model()
    with pytest.raises(WorkbookError, match="the task's save_state failed: .*planted"):
        save_checkpoint(tmp_path / "ckpt", model, own=task.save_state)
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its temporary folder


def test_a_train_step_that_steps_per_micro_batch_is_named():
    import dataclasses

    from workbook import WorkbookError
    from workbook.notebooks.accounting import normalisation_check

    def every_micro_batch(model, optimizer, micro_batches):
        for batch in micro_batches:
            optimizer.zero_grad()
            (model(batch["features"]) - batch["labels"]).pow(2).sum().backward()
            optimizer.step()

    task = dataclasses.replace(load_task(TASK), train_step=every_micro_batch)
    with pytest.raises(WorkbookError, match=r"called optimizer.step\(\) 2 times for one update"):
        normalisation_check(task, prepare(task).train[:8], (8, 4))


def _own(step):
    import dataclasses

    return dataclasses.replace(load_task(TASK), train_step=step)


def test_the_loop_runs_the_tasks_own_train_step_and_records_what_it_returns():
    """02, 06 and 07 train through `train`: with a train_step the update is the task's own, the
    loss it returns is the one recorded, and the norm is read by an optimizer hook."""
    import dataclasses

    from examples.regression import train_step
    from workbook.training.loop import TrainConfig, train

    calls = []

    def counted(model, optimizer, micro_batches):
        calls.append(len(micro_batches))
        return train_step(model, optimizer, micro_batches)

    task = _own(counted)
    items = prepare(task).train[:36]  # whole updates of 4 x 3
    # grad_clip 0: the task's step does not clip (with its own step, clipping is the task's)
    cfg = TrainConfig(UpdateShape(4, 3), updates=5, lr=1e-2, grad_clip=0.0)
    own = train(task, items, cfg)
    assert calls == [3, 3, 3, 3, 3]
    assert all(math.isfinite(r.loss) and r.grad_norm > 0 and r.targets == 12 for r in own.steps)
    # the task's step normalises as the workbook does: same updates, same losses
    mine = train(task, items, dataclasses.replace(cfg, own_step=False))
    assert calls == [3] * 5, "own_step=False runs the workbook's update"
    for a, b in zip(own.steps, mine.steps, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


@pytest.mark.parametrize("step, message", [
    (lambda model, optimizer, mbs: optimizer.step(), "returned NoneType, not the update's loss"),
    (lambda model, optimizer, mbs: 1 / 0, "the task's train_step failed: division by zero"),
    (lambda model, optimizer, mbs: 0.0, r"called optimizer.step\(\) 0 times"),
])
def test_a_train_step_the_loop_cannot_use_is_named(step, message):
    from workbook import WorkbookError
    from workbook.training.loop import TrainConfig, train

    task = _own(step)
    with pytest.raises(WorkbookError, match=message):
        train(task, prepare(task).train[:16], TrainConfig(UpdateShape(4, 2), updates=2))


def test_fp16_with_the_tasks_own_step_is_refused_before_training():
    from workbook import WorkbookError
    from workbook.training.devices import check_precision

    task = load_task(TASK)  # brings its own train_step
    with pytest.raises(WorkbookError, match="GradScaler cannot reach inside it"):
        check_precision("fp16", torch.device("cuda", 0), task)
    check_precision("bf16", torch.device("cpu"), task)


def test_fp16_is_refused_only_where_the_tasks_step_runs(monkeypatch):
    """Training through the task's step in fp16 is refused before any model is built; the
    prediction and the phase gates size the workbook's update, whose fp16 stays allowed."""
    from workbook import WorkbookError
    from workbook.training.devices import check_precision
    from workbook.training.loop import TrainConfig, train

    task = load_task(TASK)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    built = []
    monkeypatch.setattr(task, "build_model", lambda: built.append(1))
    cfg = TrainConfig(UpdateShape(4, 1, precision="fp16"), updates=1, device="cuda")
    with pytest.raises(WorkbookError, match="GradScaler cannot reach inside it"):
        train(task, prepare(task).train[:8], cfg)
    assert built == [], "refused before the model was built"
    check_precision("fp16", torch.device("cuda", 0))  # build_stepper's check: no task, allowed
