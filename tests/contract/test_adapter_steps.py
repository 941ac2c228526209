"""Each step of the torch and Lightning adapters called alone: reading the datasets, the batch
structure, the loss, the optimizer and schedule, training, evaluation and checkpoints - so a
broken step fails here by its name, not somewhere inside a notebook."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from workbook import WorkbookError
from workbook.contract.adapters.base import Adapter
from workbook.contract.adapters.torch import TorchAdapter


class _Counted(IterableDataset):
    """A stream that counts the items it was asked for."""

    def __init__(self, n):
        self.n, self.read = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.read += 1
            yield torch.tensor([float(i), 1.0]), torch.tensor(i % 3)


def _items(n=6):
    return [(torch.tensor([float(i), 2.0]), torch.tensor(i % 3)) for i in range(n)]


def _torch(data=None, **kw):
    return TorchAdapter(data if data is not None else _items(), lambda: nn.Linear(2, 3),
                        nn.CrossEntropyLoss(), name="steps", fields=("x", "labels"), **kw)


def test_reading_map_style_data_names_groups_and_classes_per_example():
    adapter = _torch(group_of=lambda j, item: f"g{j // 2}")
    rows = adapter.load_examples()
    assert [r["group"] for r in rows] == ["g0", "g0", "g1", "g1", "g2", "g2"]
    assert [r["label"] for r in rows] == ["0", "1", "2", "0", "1", "2"]
    assert adapter.label_names == ["0", "1", "2"] and adapter.inputs == ("x",)
    assert torch.equal(adapter.encode(rows[4])["x"], torch.tensor([4.0, 2.0]))


def test_reading_a_stream_reads_only_what_is_asked_for_and_refuses_a_changed_structure():
    data = _Counted(1000)
    adapter = _torch(data, label_names=["a", "b", "c"])
    reader = adapter.load_stream()
    first = [next(reader) for _ in range(3)]
    assert [ex["label"] for ex in first] == ["a", "b", "c"] and data.read < 10
    changed = [{"x": torch.ones(2), "labels": torch.tensor(0)},
               {"x": torch.ones(2), "labels": torch.tensor(0), "w": torch.tensor(1.0)}]
    adapter = TorchAdapter(changed, lambda: nn.Linear(2, 3), nn.CrossEntropyLoss(), name="c")
    with pytest.raises(WorkbookError, match="item 1 has the fields .* change structure"):
        list(adapter.read(None, changed))


def test_the_batch_structure_is_the_users_collate_named_by_fields():
    seen = []

    def collate(batch):
        seen.append(type(batch[0]))
        return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
    adapter = _torch(collate_fn=collate)
    batch = adapter.collate([adapter.encode(ex) for ex in adapter.load_examples()[:4]])
    assert seen == [tuple] and set(batch) == {"x", "labels"} and batch["x"].shape == (4, 2)


def test_the_loss_is_a_sum_over_the_targets_that_count_with_their_number():
    adapter = _torch()
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    total, count = adapter.loss(logits, {"labels": torch.tensor([0, 1, -100])})
    assert int(count) == 2
    assert float(total) == pytest.approx(2 * float(nn.functional.cross_entropy(
        logits[:1], torch.tensor([0]))))
    weighted = TorchAdapter(_items(), lambda: nn.Linear(2, 3),
                            nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 1.0])),
                            name="w", fields=("x", "labels"))
    _, count = weighted.loss(logits, {"labels": torch.tensor([0, 1, -100])})
    assert float(count) == 4.0  # a weighted mean divides by the targets' weights


def test_decode_names_classes_and_task_assembles_the_steps():
    adapter = _torch()
    assert adapter.decode([2, 7]) == "2, <7?>"
    task = adapter.task()
    assert isinstance(adapter, Adapter)
    assert task.encode == adapter.encode and task.collate == adapter.collate
    assert task.loss == adapter.loss and task.load_examples == adapter.load_examples


# -- Lightning ----------------------------------------------------------------------------------

pl = pytest.importorskip("lightning.pytorch")


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 3)
        self.hooks, self.extra = [], None

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.hooks.append(("train", batch_idx, self.trainer.global_step))
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), batch_size=len(y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LinearLR(
            opt, 0.5, 1.0, total_iters=4)}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["extra"] = 7

    def on_load_checkpoint(self, checkpoint):
        self.extra = checkpoint["extra"]


class _Data(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_items(8), batch_size=2)

    val_dataloader = train_dataloader


def _lightning():
    from workbook.contract.adapters.lightning import LightningAdapter

    return LightningAdapter(_Module, _Data(), name="steps", fields=("x", "labels"),
                            criterion=nn.CrossEntropyLoss())


def _batch(adapter, n=2):
    return adapter.collate([{"x": x, "labels": y} for x, y in _items(n)])


def test_lightning_reading_and_batch_structure_give_back_the_users_tuple():
    adapter = _lightning()
    assert adapter.loader_batch == 2 and adapter.train_length == 8 and adapter.own_lr == 0.1
    batch = _batch(adapter)
    assert set(batch) == {"x", "labels"}
    given = adapter.users(batch, keep=torch.tensor([True, False]))
    # default_collate makes a list of tuples: the step gets a list, as from the loader
    assert isinstance(given, list) and len(given) == 2 and given[0].shape == (1, 2)


def test_lightning_optimizer_scales_the_modules_rates_and_steps_with_its_hooks():
    adapter = _lightning()
    module = _Module()
    opt = adapter.build_optimizer(module, 0.01)
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(0.01)
    assert adapter.build_scheduler(opt) is not None
    before = module.layer.weight.detach().clone()
    loss = adapter.train_step(module, opt, [_batch(adapter), _batch(adapter)])
    assert loss > 0 and not torch.equal(before, module.layer.weight)
    assert [h[:2] for h in module.hooks] == [("train", 0), ("train", 1)]
    assert adapter.fit.run_of(module, opt).global_step == 1


def test_lightning_validation_reports_logged_sums_weighted_by_batch_size():
    adapter = _lightning()
    task = adapter.task()
    module = _Module()
    assert task.framework.metric_reductions == {}  # filled as the validation runs
    out = task.eval_step(module, _batch(adapter))
    total, count = out["val_loss"]
    assert count == 2 and total > 0
    assert task.framework.metric_reductions == {"val_loss": "rows"}
    assert not hasattr(task.eval_step, "metric_reductions")  # the task declares it, once
    assert module.training  # the modes are back after the validation hooks


def test_lightning_checkpoint_round_trips_through_the_modules_hooks(tmp_path):
    adapter = _lightning()
    module = _Module()
    opt = adapter.build_optimizer(module, 0.1)
    adapter.train_step(module, opt, [_batch(adapter)])
    adapter.save_state(tmp_path, {"model": module, "optimizer": opt})
    other = _Module()
    other_opt = adapter.build_optimizer(other, 0.1)
    adapter.restore_state(tmp_path, {"model": other, "optimizer": other_opt})
    assert other.extra == 7 and torch.equal(other.layer.weight, module.layer.weight)
    assert adapter.fit.run_of(other, other_opt).global_step == 1
    saved = torch.load(tmp_path / "lightning.ckpt", weights_only=True)
    saved["optimizer_states"] = []
    torch.save(saved, tmp_path / "lightning.ckpt")
    with pytest.raises(WorkbookError, match="no optimizer state"):
        adapter.restore_state(tmp_path, {"model": _Module(), "optimizer": other_opt})
