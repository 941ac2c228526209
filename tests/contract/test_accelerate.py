"""from_accelerate on a loop written as transformers' run_clm_no_trainer.py writes it
(examples/accelerate_no_trainer.py): the prepared optimizer and scheduler accepted as they are,
one optimizer step per update the pilot shapes (the accelerator's accumulation set per update),
the scheduler stepped as the script steps it, gather_for_metrics honoured, fixed-length blocks
never shortened, and `loss.backward()` named with `accelerator.backward(loss)` as the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbook.base.errors import WorkbookError
from workbook.contract.data import prepare
from workbook.notebooks.accounting import normalisation_check, own_split_cause
from workbook.training.evaluation import evaluation_sums
from workbook.training.loop import StepWatch, TrainConfig, UpdateShape, build_stepper, train
from workbook.training.workload import shaped_batch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def _task(**planted):
    from examples.accelerate_no_trainer import make_task

    return make_task(120, **planted)


@pytest.fixture(scope="module")
def clean():
    return _task()


@pytest.fixture(scope="module")
def items(clean):
    data = prepare(clean, limits={"train": 16, "validation": 5})
    return {"train": data.train, "validation": data.validation}


def _check(task, items):
    check = normalisation_check(task, items[:8], (8, 2, 1))
    check["case"] = "equal split"
    own = check[check.normalisation == "the task's train_step"]
    return own, own_split_cause(task, items[:8], check)


# --- (a) the step watch on any optimizer wrapper ---------------------------------------------

class Bare:
    """A wrapper with neither torch's hooks nor a wrapped optimizer: its own step."""

    def __init__(self, params):
        self.param_groups = [{"params": list(params)}]
        self.calls = 0

    def step(self):
        self.calls += 1


class Holding:
    """A wrapper that is no torch Optimizer but holds one, as `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def step(self):
        self.optimizer.step()


def test_the_step_watch_counts_steps_through_every_kind_of_optimizer_wrapper():
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator()  # an AcceleratedOptimizer reads the state an Accelerator sets
    model = torch.nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    made = [AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 device_placement=False),
            Holding(torch.optim.SGD(model.parameters(), lr=0.1)), Bare(model.parameters()),
            torch.optim.SGD(model.parameters(), lr=0.1)]
    for optimizer in made:
        watch = StepWatch(optimizer)
        optimizer.step()
        watch.remove()
        optimizer.step()  # after remove: not counted
        assert watch.steps == 1, type(optimizer).__name__
        assert watch.norm > 0
    assert "step" not in vars(made[2]) and made[2].calls == 2


# --- the update the pilot shapes --------------------------------------------------------------

@pytest.mark.twin
def test_each_update_steps_the_prepared_optimizer_and_the_script_schedule_once(clean, items):
    from accelerate.optimizer import AcceleratedOptimizer

    cfg = TrainConfig(shape=UpdateShape(micro_batch=2, accumulation=4), updates=3, lr=5e-3)
    result = train(clean, items["train"], cfg)  # 4 micro-batches under the script's 2
    assert isinstance(result.optimizer, AcceleratedOptimizer)
    assert [s.micro_batches for s in result.steps] == [4, 4, 4]
    # the linear schedule sized to the run's 3 updates, stepped once per update (not twice)
    assert [round(s.lr, 6) for s in result.steps] == [0.005, 0.003333, 0.001667]
    assert all(s.grad_norm > 0 for s in result.steps)
    accelerator_steps = clean.train_step.adapter.accelerator.gradient_accumulation_steps
    assert accelerator_steps == 2  # the script's own value given back


def test_the_workbook_own_update_steps_the_script_schedule_too(clean):
    cfg = TrainConfig(shape=UpdateShape(micro_batch=2, accumulation=1), updates=4, lr=5e-3)
    stepper = build_stepper(clean, cfg)
    for p in stepper.model.parameters():
        p.grad = torch.zeros_like(p)
    stepper.step()
    assert stepper.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * 3 / 4)


# --- (b) fixed-length blocks stay one length ---------------------------------------------------

@pytest.mark.twin
def test_fixed_length_blocks_are_never_shortened_for_a_stacking_collate(clean, items):
    batch = shaped_batch(clean, items["train"], 4)
    assert batch.tensors["input_ids"].shape == (4, 32)
    assert bool(batch.tensors["attention_mask"].all())
    longer = shaped_batch(clean, items["train"], 2, 48)  # sized past the data: still equal
    assert longer.tensors["input_ids"].shape == (2, 48)


def test_rows_of_several_lengths_still_get_one_short_row():
    from workbook.contract.task import load_task

    task = load_task("workbook.samples.generation:task")
    data = prepare(task, limits={"train": 16})
    batch = shaped_batch(task, data.train, 2, 24)
    assert not bool(batch.tensors["attention_mask"].all())  # padded, as a campaign's are


# --- (c) loss.backward() under Accelerate ------------------------------------------------------

@pytest.mark.planted
def test_loss_backward_is_named_with_accelerator_backward_as_the_fix(items):
    planted = _task(backward="loss")
    own, cause = _check(planted, items["train"])
    assert not own.within_tolerance.all()
    assert cause is not None and "accelerator.backward(loss)" in cause
    assert "loss.backward()" in cause and "4 times" in cause  # measured: 4 micro-batches of 2


@pytest.mark.twin
def test_the_script_body_gradient_does_not_depend_on_the_split(clean, items):
    own, cause = _check(clean, items["train"])
    assert own.within_tolerance.all(), own
    assert cause is None


# --- evaluation and gather_for_metrics --------------------------------------------------------

@pytest.mark.twin
def test_eval_step_counts_real_rows_whatever_the_eval_batch(clean, items):
    model = clean.build_model().eval()
    val = items["validation"]
    sums = {b: evaluation_sums(clean, model, val, b, torch.device("cpu"))[0]["eval_loss"]
            for b in (2, 5)}  # 5 rows: batches of 2 end with a padding copy
    assert sums[2][1] == sums[5][1] == len(val)
    assert sums[2][0] == pytest.approx(sums[5][0], rel=1e-5)
    loss, count = evaluation_sums(clean, model, val, 5, torch.device("cpu"))[0]["(loss)"]
    assert sums[5][0] / len(val) == pytest.approx(loss / count, rel=1e-5)
    assert "gather_for_metrics" not in vars(clean.train_step.adapter.accelerator)
    # every process's losses gathered: a mean over rows, declared on the task
    assert clean.framework.metric_reductions == {"eval_loss": "rows"}


# --- what is refused -----------------------------------------------------------------------

def test_bad_pieces_are_refused_with_the_piece_named():
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator

    from examples.accelerate_no_trainer import lm_datasets
    from workbook.contract.adapters import from_accelerate

    data = lm_datasets(60)
    loader = DataLoader(data["train"], batch_size=4, collate_fn=default_data_collator)
    model = lambda: GPT2LMHeadModel(GPT2Config(vocab_size=259, n_positions=32, n_embd=16,  # noqa: E731
                                               n_layer=1, n_head=2))
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
    with pytest.raises(WorkbookError, match="not a torch DataLoader"):
        from_accelerate(model, opt, data["train"], lambda *a: None, name="x")
    with pytest.raises(WorkbookError, match="without eval_dataloader"):
        from_accelerate(model, opt, loader, lambda *a: None, name="x", eval_step=lambda *a: 0)
    with pytest.raises(WorkbookError, match="make_optimizer"):
        from_accelerate(model, lambda m: [1], loader, lambda *a: None, name="x")


def test_prepared_loaders_and_a_prepared_optimizer_are_accepted_as_they_are():
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator

    from examples.accelerate_no_trainer import lm_datasets
    from workbook.contract.adapters import from_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=2)
    data = lm_datasets(60)
    loader = accelerator.prepare(DataLoader(data["train"], batch_size=4,
                                            collate_fn=default_data_collator))

    def step(accelerator, model, optimizer, lr_scheduler, batch):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        return loss

    task = from_accelerate(
        lambda: GPT2LMHeadModel(GPT2Config(vocab_size=259, n_positions=32, n_embd=16,
                                           n_layer=1, n_head=2)),
        lambda m: accelerator.prepare(torch.optim.AdamW(m.parameters(), lr=1e-3)),
        loader, step, name="prepared", accelerator=accelerator)
    data = prepare(task, limits={"train": 8})
    cfg = TrainConfig(shape=UpdateShape(micro_batch=2, accumulation=2), updates=2, lr=1e-3)
    steps = train(task, data.train, cfg).steps
    assert [s.micro_batches for s in steps] == [2, 2]


# --- the nine notebooks ---------------------------------------------------------------------

@pytest.mark.slow
def test_the_clean_loop_passes_the_nine_notebooks(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "workbook", "pilot", "--task",
                    "examples.accelerate_no_trainer:task", "--smoke", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=1800)
    index = json.loads((out / "index.json").read_text())
    verdicts = {n["notebook"]: n["verdict"] for n in index["notebooks"]}
    assert set(verdicts.values()) == {"pass"}, verdicts


@pytest.mark.planted
def test_a_body_outside_accelerator_accumulate_is_named(items):
    planted = _task(accumulate=False)
    cfg = TrainConfig(shape=UpdateShape(micro_batch=2, accumulation=2), updates=1, lr=5e-3)
    with pytest.raises(WorkbookError, match=r"never enters accelerator.accumulate\(model\)"):
        train(planted, items["train"], cfg)
