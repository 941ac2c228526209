"""from_lightning: a LightningModule and LightningDataModule run as Trainer.fit runs them, each
planted bug of examples/lightning_module.py named by the check its notebook runs, the clean
module passing every one, and what cannot be mapped refused with the piece named."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import workbook as wb  # noqa: E402
from workbook import WorkbookError  # noqa: E402
from workbook.contract.data import prepare  # noqa: E402
from workbook.contract.task import load_task  # noqa: E402
from workbook.notebooks import accounting as acc  # noqa: E402
from workbook.training.loop import TrainConfig, UpdateShape, train  # noqa: E402

from .test_adapters import Readings  # noqa: E402

TASK = "examples.lightning_module:task"
DOCS = "examples.lightning_docs:task"  # Lightning as its documentation writes it


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
    steps = train(task, items, TrainConfig(UpdateShape(2, 2), updates=6, lr=1e-3)).steps
    assert len(steps) == 6 and all(torch.isfinite(torch.tensor(s.loss)) for s in steps)
    assert [round(s.lr / 1e-3, 3) for s in steps[:5]] == [0.2, 0.4, 0.6, 0.8, 1.0]


def test_the_trainers_gradient_clip_val_is_the_tasks_clipping():
    from examples.lightning_module import LitLanguageModel, TextDataModule, tok

    assert load_task(TASK, conversations=60).grad_clip is None  # Lightning's default: none
    clipped = wb.adapters.from_lightning(
        LitLanguageModel, TextDataModule(conversations=60), name="clipped", kind="generation",
        fields=("input_ids", "labels"), decode=tok.decode, gradient_clip_val=0.5)
    assert clipped.grad_clip == 0.5


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
    from workbook.notebooks.resume import recipe, run_recipe

    cfg = TrainConfig(UpdateShape(2, 2), updates=4)
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
    from workbook.commands import params
    from workbook.notebooks.accounting import run

    result = run(params.of("04_batch_accounting", small=True, task=TASK,
                           task_options={"conversations": 60}))
    assert result.findings == [] and len(result.warnings) == 1, result.warnings
    assert "final partial micro-batch" in result.warnings[0]
    # the planted padded_training still fails on equal splits: see the normalisation test above


@pytest.mark.slow  # about 5 minutes each on 2 cores: the whole pilot, as the README runs it
@pytest.mark.timeout(1200)  # beside another test on 2 cores it ran past the default 300 s
@pytest.mark.parametrize("task", [TASK, DOCS, "examples.hf_trainer:task"])
def test_each_framework_example_passes_all_nine_notebooks(task, tmp_path):
    from workbook.commands.pilot import run_pilot

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
    from workbook.training.loop import pass_order

    own = task.make_sampler(6, 7)
    assert own.seed == 7 and pass_order(own, 6, 7, 0)[0] == [0, 2, 4, 1, 3, 5]
    assert task.make_sampler(4, 7) is None  # a subset: the pilot's own order
    assert wb.adapters.from_lightning(_Module, _Data(), name="x",
                                      criterion=nn.CrossEntropyLoss()).make_sampler is None
    batches = DataLoader(data, batch_sampler=[[0, 1], [2, 3, 4]])
    with pytest.raises(WorkbookError, match="batches with its own list"):
        wb.adapters.from_lightning(_Module, _Data(loader=batches), name="x",
                                   criterion=nn.CrossEntropyLoss())


# --- Lightning as its documentation writes it (examples/lightning_docs.py) -----------------


def _docs(**options):
    task = load_task(DOCS, rows=200, **options)
    prepared = prepare(task)
    return task, prepared.train, prepared.validation


def test_the_docs_module_trains_on_one_cycle_over_the_runs_updates_and_reports_epoch_metrics():
    from workbook.training.evaluation import evaluate

    task, items, val = _docs(macro_f1=True)
    assert task.model_inputs == ("x",) and task.lr == pytest.approx(1e-2 / 25)  # initial_lr
    cfg = TrainConfig(UpdateShape(8, 2), updates=12, lr=1e-2 / 25, eval_every=6, eval_batch=16)
    result = train(task, items, cfg, val_items=val)
    lrs = [s.lr for s in result.steps]
    assert len(lrs) == 12 and max(lrs) == pytest.approx(1e-2, rel=0.05)  # the cycle's peak
    assert lrs[0] < 1e-3 and lrs[-1] < 1e-3  # up, then down within the pilot's 12 updates
    assert "12 here" in task.framework.campaign_differs_in["estimated_stepping_batches"]
    model = result.model
    record = evaluate(task, model, val, 16, torch.device("cpu"))  # 40 rows: last batch padded
    model.eval()
    with torch.no_grad():
        batch = task.collate([it.tensors for it in val])
        preds = model(batch["x"]).argmax(-1)
    from examples.lightning_docs import macro_f1

    assert record.metrics["val_acc"] == pytest.approx(float((preds == batch["labels"]).float()
                                                            .mean()))
    assert record.metrics["val_f1"] == pytest.approx(float(macro_f1(preds, batch["labels"], 3)))
    assert record.metrics["val_weighted_loss"] == pytest.approx(record.loss, rel=1e-5)
    again = evaluate(task, model, val[:32], 8, torch.device("cpu"))  # whole batches only
    assert again.metrics["val_f1"] == pytest.approx(float(macro_f1(preds[:32],
                                                                   batch["labels"][:32], 3)))


def test_01_says_which_trainer_values_the_campaign_will_give_otherwise():
    from workbook.notebooks.inspection import inspect_task

    task, _, _ = _docs()
    ins = inspect_task(task)
    assert ins.flags == []
    (note,) = [n for n in ins.notes if n.check == "the campaign will differ in"]
    assert note.message.startswith("the task's code reads estimated_stepping_batches (the "
                                   "updates of the pilot's run")
    plain = inspect_task(load_task("tests.own_task:task"))  # no stand-in: no such note
    assert all(n.check != "the campaign will differ in" for n in plain.notes)


def test_the_docs_modules_planted_bugs_are_named_and_the_clean_one_passes():
    task, items, val = _docs()
    assert acc.evaluation_findings(acc.evaluation_check(task, val[:21])) == []
    own = acc.normalisation_check(task, items[:8], (8, 2, 1))
    assert own[own.normalisation == "the task's train_step"].within_tolerance.all()
    assert acc.step_loss_check(task, items[:8]).agree.all()
    task, items, val = _docs(weighted_mean_step=True)
    own = acc.normalisation_check(task, items[:8], (8, 2, 1))
    assert not own[own.normalisation == "the task's train_step"].within_tolerance.iloc[1:].any()
    assert not acc.step_loss_check(task, items[:8]).agree.any()
    task, items, val = _docs(val_mean_of_batch_means=True)
    found = acc.evaluation_findings(acc.evaluation_check(task, val[:21]))
    assert any("'val_acc' changes with the evaluation batch" in f for f in found), found


def _rows(n=10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(3, generator=g), torch.tensor(i % 2), torch.tensor(0.5 + i / n))
            for i in range(n)]


def _weighted(items):
    xs, ys, ws = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys), torch.stack(ws)


class _Recorder(pl.LightningModule):
    """Asserts the batch's structure in its steps and records what the trainer said."""

    def __init__(self, structure="tuple", reads=()):
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.structure, self.reads = structure, reads
        self.seen, self.calls, self.outputs = [], [], []

    def forward(self, x):
        return self.layer(x)

    def _unpack(self, batch):
        if self.structure == "tuple":
            assert isinstance(batch, tuple) and len(batch) == 3, batch
            x, y, w = batch
        else:
            assert isinstance(batch, dict) and list(batch) == ["inputs", "labels", "w"]
            assert list(batch["inputs"]) == ["x"]
            x, y, w = batch["inputs"]["x"], batch["labels"], batch["w"]
        assert y.dtype == torch.long and w.is_floating_point() and x.shape[1:] == (3,)
        return x, y, w

    def training_step(self, batch, batch_idx):
        x, y, w = self._unpack(batch)
        t = self.trainer
        self.seen.append(("train", batch_idx, t.global_step, t.current_epoch, t.training,
                          t.validating))
        return (nn.functional.cross_entropy(self(x), y, reduction="none") * w).mean()

    def on_validation_model_eval(self):
        self.calls.append("model_eval")
        super().on_validation_model_eval()

    def on_validation_model_train(self):
        self.calls.append("model_train")
        super().on_validation_model_train()

    def on_validation_epoch_start(self):
        self.calls.append("epoch_start")

    def validation_step(self, batch, batch_idx):
        x, y, w = self._unpack(batch)
        self.calls.append(f"step {batch_idx} {'eval' if not self.training else 'train'}")
        assert self.trainer.validating and not self.trainer.training
        self.outputs.append(y)

    def on_validation_epoch_end(self):
        self.calls.append("epoch_end")
        rows = torch.cat(self.outputs)
        # whole-epoch values no per-batch mean gives: the rows seen, the largest label
        self.log("val_rows", float(len(rows)))
        self.log("val_top", float(rows.max()))
        self.outputs.clear()

    def configure_optimizers(self):
        t = self.trainer
        self.seen.append(("configure", {name: getattr(t, name) for name in (
            "estimated_stepping_batches", "max_steps", "max_epochs", "accumulate_grad_batches",
            "num_training_batches", "num_devices", "world_size", "is_global_zero",
            "global_rank", "local_rank", "logger", "loggers", "precision", "sanity_checking",
            "testing", "predicting", "training", "validating", "num_val_batches",
            "gradient_clip_val", *self.reads)}
            | {"datamodule": t.datamodule, "module": t.lightning_module, "dir": t.log_dir,
               "model": t.model}))
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _RowsData(pl.LightningDataModule):
    def __init__(self, items, collate=_weighted):
        super().__init__()
        self.items, self.collate = items, collate

    def train_dataloader(self):
        return DataLoader(self.items, batch_size=2, collate_fn=self.collate)

    val_dataloader = train_dataloader


def _recorder_task(structure="tuple", reads=(), n=10):
    items = _rows(n)
    if structure == "tuple":
        data, fields = _RowsData(items), ("x", "labels", "w")
    else:
        items = [{"inputs": {"x": x}, "labels": y, "w": w} for x, y, w in items]
        data, fields = _RowsData(items, torch.utils.data.default_collate), None
    modules = []

    def factory():
        modules.append(_Recorder(structure, reads))
        return modules[-1]
    task = wb.adapters.from_lightning(factory, data, name="rec", fields=fields,
                                      criterion=nn.CrossEntropyLoss())
    return task, data, modules


@pytest.mark.parametrize("structure", ["tuple", "dict"])
def test_batches_reach_the_steps_as_the_loader_made_them_and_the_trainer_is_the_pilots(
        structure):
    task, data, modules = _recorder_task(structure)
    assert task.model_inputs == (("x",) if structure == "tuple" else ("inputs.x",))
    items = prepare(task).train
    cfg = TrainConfig(UpdateShape(2, 2), updates=5, lr=0.1)
    result = train(task, items, cfg)
    model = result.model
    assert model is modules[-1] and model._trainer is None  # attached only during the hooks
    configured = model.seen[0][1]
    n = len(items)  # 10: a pass is 3 updates of 2 x 2 (4, 4 and 2 examples)
    assert configured["estimated_stepping_batches"] == configured["max_steps"] == 5
    assert configured["max_epochs"] == 2 and configured["num_training_batches"] == 5
    assert configured["accumulate_grad_batches"] == 2 and configured["num_devices"] == 1
    assert configured["world_size"] == 1 and configured["is_global_zero"]
    assert configured["global_rank"] == configured["local_rank"] == 0
    assert configured["logger"] is None and configured["precision"] == "32-true"
    assert configured["datamodule"] is data and configured["module"] is model
    assert not configured["sanity_checking"] and Path(configured["dir"]).is_dir()
    assert configured["training"] and not any(configured[flag] for flag in (
        "validating", "testing", "predicting"))
    assert configured["loggers"] == [] and configured["num_val_batches"] == [5]
    assert configured["model"] is model and configured["gradient_clip_val"] is None
    steps = [s for s in model.seen if s[0] == "train"]
    assert [s[2] for s in steps] == [r.step - 1 for r in result.steps  # global_step
                                     for _ in range(r.micro_batches)]
    assert [s[3] for s in steps] == [r.epoch for r in result.steps  # current_epoch
                                     for _ in range(r.micro_batches)]
    assert [s[1] for s in steps] == [0, 1, 2, 3, 4, 0, 1, 2, 3]  # batch_idx within the pass
    assert all(s[4] and not s[5] for s in steps) and n == 10  # training, not validating
    assert set(task.framework.campaign_differs_in) >= {"estimated_stepping_batches", "max_epochs",
                                             "num_devices", "logger"}


def test_a_trainer_attribute_the_pilot_does_not_provide_is_named():
    with pytest.raises(WorkbookError, match=r"self\.trainer\.strategy, which the pilot does "
                                            r"not provide") as caught:
        _recorder_task(reads=("strategy",))
    assert "estimated_stepping_batches" in str(caught.value)  # what it does provide


def test_the_validation_epoch_runs_its_hooks_in_lightnings_order_and_its_end_log_is_the_metric():
    from workbook.training.evaluation import evaluate

    task, _, modules = _recorder_task(n=10)
    prepared = prepare(task)
    model = task.build_model()
    model.train()
    val = prepared.validation  # 10 rows: batches of 4, 4 and a padded 2
    record = evaluate(task, model, val, 4, torch.device("cpu"))
    assert model.calls == ["model_eval", "epoch_start", "step 0 eval", "step 1 eval",
                           "step 2 eval", "epoch_end", "model_train"]
    assert record.metrics["val_rows"] == len(val) == 10  # the epoch's value, not a batch mean
    assert record.metrics["val_top"] == 1.0
    assert model.training and model.outputs == []  # the mode it was handed in; outputs cleared
    model.calls.clear()
    again = evaluate(task, model, val[:8], 4, torch.device("cpu"))  # ends on a whole batch
    assert again.metrics["val_rows"] == 8
    assert model.calls == ["model_eval", "epoch_start", "step 0 eval", "step 1 eval"]
    opt = task.optimizer(model, 0.1)
    batch = task.collate([it.tensors for it in val[:2]])
    task.train_step(model, opt, [batch])  # training on ends the open epoch first
    assert model.calls[-2:] == ["epoch_end", "model_train"]


def test_a_one_cycle_schedule_on_the_estimate_holds_its_last_rate_past_a_short_configuration():
    from workbook.training.loop import build_stepper

    task, _, _ = _docs()
    stepper = build_stepper(task, TrainConfig(UpdateShape(4, 1), updates=1, lr=task.lr))
    for _ in range(2):  # 03's gates: two updates on a configuration of one
        stepper.optimizer.step()
        stepper.scheduler.step()
    assert stepper.scheduler.held == 1


# --- a datamodule over an iterable (streaming) dataset

class _WeightedStream(Readings):
    """(x, y, w) rows [start, end) of test_adapters' docs-style IterableDataset (each
    DataLoader worker reads its own share; `reads` counts the items handed out); (x, y) at
    `change_at`."""

    def row(self, i):
        x = torch.randn(3, generator=torch.Generator().manual_seed(i))
        row = (x, torch.tensor(int(x[0] > 0)), torch.tensor(0.5 + i % 3 / 2))
        return row[:2] if i == self.change_at else row


class _StreamData(pl.LightningDataModule):
    def __init__(self, train_set, val_set=None):
        super().__init__()
        self.train_set, self.val_set = train_set, val_set or _WeightedStream(0, 40)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=2, collate_fn=_weighted)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=2, collate_fn=_weighted)


def _stream_task(data):
    return wb.adapters.from_lightning(lambda: _Recorder("tuple"), data, name="stream",
                                      fields=("x", "labels", "w"), label_names=["neg", "pos"],
                                      criterion=nn.CrossEntropyLoss())


def test_a_datamodule_over_an_iterable_dataset_is_read_lazily_and_never_indexed():
    from itertools import islice

    data = _StreamData(_WeightedStream())
    task = _stream_task(data)
    assert data.train_set.reads <= 4 and task.model_inputs == ("x",)  # the structure's items
    first = list(islice(task.load_examples(), 8))  # one item of each split in turn
    assert [ex["split"] for ex in first] == ["train", "validation"] * 4
    assert data.train_set.reads <= 4 + 4 and data.val_set.reads <= 2 + 4
    batch = task.collate([task.encode(ex) for ex in first])
    assert list(batch) == ["x", "labels", "w"] and batch["x"].shape == (8, 3)
    data.train_set.reads = 0
    prepared = prepare(task, limits={"train": 8, "validation": 4})
    assert len(prepared.train) == 8 and data.train_set.reads < 40  # stopped there
    result = train(task, prepared.train, TrainConfig(UpdateShape(2, 2), updates=2, lr=0.1))
    assert len(result.steps) == 2 and torch.isfinite(torch.tensor(
        [s.loss for s in result.steps])).all()
    assert [s[:2] for s in result.model.seen if s[0] == "train"] == [
        ("train", 0), ("train", 1), ("train", 2), ("train", 3)]  # the module's own steps
    model = result.model
    val = task.collate([it.tensors for it in prepared.validation])
    assert "val_rows" in task.eval_step(model, val)  # the validation loop's hooks ran


def test_what_an_iterable_datamodule_cannot_give_is_named():
    with pytest.raises(WorkbookError, match="can be read once only") as caught:
        _stream_task(_StreamData(row for row in _WeightedStream(0, 10)))
    assert "starts again on every iter()" in caught.value.fix
    with pytest.raises(WorkbookError, match="the validation dataset .* has no items"):
        _stream_task(_StreamData(_WeightedStream(0, 10), _WeightedStream(0, 0)))
    task = _stream_task(_StreamData(_WeightedStream(0, 10, change_at=5)))
    with pytest.raises(WorkbookError, match="train dataset's item 5 is a tuple of another "
                                            "structure"):
        list(task.load_examples())
