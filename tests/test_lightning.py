"""from_lightning: a LightningModule and LightningDataModule run as Trainer.fit runs them, each
planted bug of examples/lightning_module.py named by the check its notebook runs, the clean
module passing every one, and what cannot be mapped refused with the piece named."""

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import workbook as wb  # noqa: E402
from workbook import WorkbookError  # noqa: E402
from workbook import accounting as acc  # noqa: E402
from workbook.data import prepare  # noqa: E402
from workbook.loop import UpdateShape, train  # noqa: E402
from workbook.task import load_task  # noqa: E402

TASK = "examples.lightning_module:task"


def _items(**options):
    task = load_task(TASK, conversations=60, **options)
    prepared = prepare(task)
    return task, prepared.train, prepared.validation


def test_the_module_runs_as_trainer_fit_with_its_lr_schedule_and_the_pilots_lr():
    task, items, _ = _items()
    assert task.lr == 3e-3 and task.kind == "generation" and task.model_inputs == ("input_ids",)
    model = task.build_model()
    opt = task.optimizer(model, 1e-3)  # the study's lr: every configured rate scaled
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(1e-3)
    steps = train(task, items, UpdateShape(2, 2).train_config(updates=6, lr=1e-3)).steps
    assert len(steps) == 6 and all(torch.isfinite(torch.tensor(s.loss)) for s in steps)
    assert [round(s.lr / 1e-3, 3) for s in steps[:5]] == [0.2, 0.4, 0.6, 0.8, 1.0]


def test_training_step_mean_is_exact_on_packed_blocks_and_named_on_padded_examples():
    task, items, _ = _items()
    own = acc.normalisation_check(task, items[:8], (8, 2, 1))
    own = own[own.normalisation == "the task's train_step"]
    assert own.within_tolerance.all(), own
    assert acc.step_loss_check(task, items[:8]).agree.all()
    task, items, _ = _items(padded_training=True)
    own = acc.normalisation_check(task, items[:8], (8, 2, 1))
    own = own[own.normalisation == "the task's train_step"]
    assert not own.within_tolerance.iloc[1:].any(), own


def test_validation_step_logs_become_sums_and_counting_padding_is_named():
    task, _, val = _items()
    clean = acc.evaluation_check(task, val[:10])
    assert acc.evaluation_findings(clean) == [], clean
    task, _, val = _items(val_counts_padding=True)
    assert acc.evaluation_findings(acc.evaluation_check(task, val[:10]))


def test_the_checkpoint_hooks_round_trip_and_dropping_the_optimizer_state_is_named(tmp_path):
    from workbook.resume import recipe, run_recipe

    cfg = UpdateShape(2, 2).train_config(updates=4)
    spec = recipe(TASK, {"conversations": 60}, cfg)
    reference, weights = run_recipe(spec, 4, tmp_path / "clean", checkpoint_at=(2,))
    saved = torch.load(tmp_path / "clean" / "ckpt-000002" / "lightning.ckpt", weights_only=True)
    assert saved["vocab_size"] == 259 and saved["lr_schedulers"][0]["updates"] == 2
    resumed, again = run_recipe(spec, 4, start_from=tmp_path / "clean" / "ckpt-000002")
    assert resumed == reference[2:] and all(torch.equal(weights[k], again[k]) for k in weights)
    spec = recipe(TASK, {"conversations": 60, "drop_optimizer_state": True}, cfg)
    run_recipe(spec, 4, tmp_path / "dropped", checkpoint_at=(2,))
    with pytest.raises(WorkbookError, match="optimizer"):
        run_recipe(spec, 4, start_from=tmp_path / "dropped" / "ckpt-000002")


class _Data(pl.LightningDataModule):
    def __init__(self, loader=None):
        super().__init__()
        self.loader = loader

    def train_dataloader(self):
        return self.loader or DataLoader([(torch.ones(3), torch.tensor(1))] * 4, batch_size=2)

    val_dataloader = train_dataloader


class _Module(pl.LightningModule):
    def __init__(self, returns="loss", optimizers=1, manual=False):
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.returns, self.count, self.automatic_optimization = returns, optimizers, not manual

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, i):
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        return {"loss": loss} if self.returns == "loss" else {"logits": loss}

    def configure_optimizers(self):
        opts = [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.count)]
        return opts[0] if self.count == 1 else opts


@pytest.mark.parametrize("build, match", [
    (lambda: wb.adapters.from_lightning(lambda: nn.Linear(3, 2), _Data(), name="x"),
     "not a LightningModule"),
    (lambda: wb.adapters.from_lightning(lambda: _Module(optimizers=2), _Data(), name="x"),
     "returns 2 optimizers"),
    (lambda: wb.adapters.from_lightning(lambda: _Module(manual=True), _Data(), name="x"),
     "automatic_optimization = False"),
    (lambda: wb.adapters.from_lightning(_Module, _Data(loader=[1, 2]), name="x"),
     "not one DataLoader"),
])
def test_what_from_lightning_cannot_map_is_refused_naming_the_piece(build, match):
    with pytest.raises(WorkbookError, match=match):
        build()


def test_a_training_step_without_loss_is_refused_with_the_fix():
    task = wb.adapters.from_lightning(lambda: _Module(returns="logits"), _Data(), name="x",
                                      criterion=nn.CrossEntropyLoss())
    model = task.build_model()
    batch = task.collate([task.encode(ex) for ex in task.load_examples()[:2]])
    with pytest.raises(WorkbookError, match="training_step returns a dict without 'loss'"):
        task.train_step(model, task.optimizer(model, 0.1), [batch])


def test_a_mean_step_off_only_on_a_final_partial_micro_batch_is_a_warning_not_a_finding():
    from workbook import params
    from workbook.accounting import run

    result = run(params.of("04_batch_accounting", small=True, task=TASK,
                           task_options={"conversations": 60}))
    assert result.findings == [] and len(result.warnings) == 1, result.warnings
    assert "final partial micro-batch" in result.warnings[0]
    # the planted padded_training still fails on equal splits: see the normalisation test above


@pytest.mark.slow  # about 5 minutes each on 2 cores: the whole pilot, as the README runs it
@pytest.mark.timeout(1200)  # beside another test on 2 cores it ran past the default 300 s
@pytest.mark.parametrize("task", [TASK, "examples.hf_trainer:task"])
def test_each_framework_example_passes_all_nine_notebooks(task, tmp_path):
    from workbook.pilot import run_pilot

    _, index = run_pilot(task, out=str(tmp_path / "run"), smoke=True, progress=False)
    assert index.verdict.tolist() == ["pass"] * 9, index[["notebook", "verdict", "error"]]


class _EvensFirst(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n, self.seed = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter([*range(0, self.n, 2), *range(1, self.n, 2)])


def test_the_train_loaders_own_sampler_orders_the_pass_and_a_batch_sampler_is_refused():
    data = [(torch.ones(3), torch.tensor(i % 2)) for i in range(6)]
    loader = DataLoader(data, batch_size=2, sampler=_EvensFirst(6))
    task = wb.adapters.from_lightning(_Module, _Data(loader=loader), name="x",
                                      criterion=nn.CrossEntropyLoss())
    from workbook.loop import pass_order

    own = task.make_sampler(6, 7)
    assert own.seed == 7 and pass_order(own, 6, 7, 0)[0] == [0, 2, 4, 1, 3, 5]
    assert task.make_sampler(4, 7) is None  # a subset: the pilot's own order
    assert wb.adapters.from_lightning(_Module, _Data(), name="x",
                                      criterion=nn.CrossEntropyLoss()).make_sampler is None
    batches = DataLoader(data, batch_sampler=[[0, 1], [2, 3, 4]])
    with pytest.raises(WorkbookError, match="batches with its own list"):
        wb.adapters.from_lightning(_Module, _Data(loader=batches), name="x",
                                   criterion=nn.CrossEntropyLoss())
