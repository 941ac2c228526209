"""The user-shaped example tasks (examples/cnn_batchnorm.py, encoder_lm.py, mlp_dropout.py):
each builds through the public contract, its own train_step, eval_step, checkpoint code and
sampler work, and every planted option changes what it claims to. Cheap: no pilot, no
notebooks."""

import importlib
import math

import pytest
import torch

import workbook as wb
from workbook.contract.data import prepare

MODULES = ("cnn_batchnorm", "encoder_lm", "mlp_dropout")


def module(name):
    return importlib.import_module(f"examples.{name}")


def task_of(name, **options):
    return wb.load_task(f"examples.{name}:task", **options)


_ITEMS = {}


def items_of(name):
    """Training items of the clean task (encoded once per module)."""
    if name not in _ITEMS:
        _ITEMS[name] = prepare(task_of(name), ("train",), {"train": 64}).train
    return _ITEMS[name]


def batch(task, items):
    return task.collate([it.tensors for it in items])


def padded(task, items, size):
    """An evaluation batch as the workbook pads it: copies of the last item whose labels say
    "no target" (-100 or NaN), and example_weight 1 real / 0 copy."""
    last = items[-1].tensors
    labels = last["labels"]
    blank = torch.full_like(labels, math.nan if labels.is_floating_point() else -100)
    copies = [{**last, "labels": blank}] * (size - len(items))
    out = task.collate([it.tensors for it in items] + copies)
    out["example_weight"] = torch.tensor([1.0] * len(items) + [0.0] * len(copies))
    return out


def loss_value(returned):
    return float(returned["loss"] if isinstance(returned, dict) else returned)


class Recorder(torch.optim.SGD):
    """Learning rate 0: step() records the gradients it would apply and counts its calls."""

    def __init__(self, model):
        super().__init__(model.parameters(), lr=0.0)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.steps, self.grads = 0, {}

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.grads = {self.names[id(p)]: p.grad.clone() for g in self.param_groups
                      for p in g["params"] if p.grad is not None}


def held(model):
    """The model in eval behaviour, with the model.train() inside train_step made a no-op (so
    two calls see the same dropout and batch-norm behaviour)."""
    model.eval()
    model.train = lambda mode=True: model
    return model


def step_gradients(name, task, splits, monkeypatch):
    """The gradient the task's train_step applies to one update over the first items, split
    into micro-batches of the given sizes (dropout / batch norm held, clipping off)."""
    monkeypatch.setattr(module(name), "MAX_GRAD_NORM", float("inf"))
    items = items_of(name)
    torch.manual_seed(0)
    model = held(task.build_model())
    recorder = Recorder(model)
    start, micro = 0, []
    for size in splits:
        micro.append(batch(task, items[start:start + size]))
        start += size
    task.train_step(model, recorder, micro)
    assert recorder.steps == 1
    return recorder.grads


def max_relative_gap(a, b):
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in b)


class Step:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"step": self.value}

    def load_state_dict(self, state):
        self.value = state["step"]


def training_objects(name, task, seed=0):
    """Model, optimizer, schedule, sampler (one pass drawn) and step of a short run."""
    torch.manual_seed(seed)
    model = task.build_model()
    optimizer = task.build_optimizer(model, task.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = task.make_sampler(len(items_of(name)), 0)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": None,
            "sampler": sampler, "step": Step()}


def train_a_little(name, task, objects, updates=2):
    items = items_of(name)
    order = list(objects["sampler"])
    for u in range(updates):
        chosen = [items[i] for i in order[8 * u: 8 * u + 8]]
        task.train_step(objects["model"], objects["optimizer"],
                        [batch(task, chosen[:4]), batch(task, chosen[4:])])
        objects["scheduler"].step()
        objects["step"].value += 1


def same_state(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("name", MODULES)
def test_builds_through_the_contract(name):
    task = task_of(name)
    assert callable(task.train_step) and callable(task.eval_step)
    assert callable(task.save_state) and callable(task.restore_state)
    assert 0 < task.lr < 0.01
    model = task.build_model()
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    groups = task.build_optimizer(model, task.lr).param_groups
    assert len(groups) == 2 and {g["weight_decay"] for g in groups} != {0.0}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("name", MODULES)
def test_train_step_makes_one_update_with_a_finite_loss(name):
    task, items = task_of(name), items_of(name)
    torch.manual_seed(0)
    model = task.build_model().eval()
    optimizer = task.build_optimizer(model, task.lr)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    returned = task.train_step(model, optimizer, [batch(task, items[:4]), batch(task, items[4:8])])
    assert math.isfinite(loss_value(returned)) and loss_value(returned) > 0
    assert len(steps) == 1 and model.training  # the user's step sets model.train() itself
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", MODULES)
def test_train_step_loss_is_the_task_loss(name):
    task, items = task_of(name), items_of(name)
    torch.manual_seed(0)
    model = held(task.build_model())
    b = batch(task, items[:6])
    with torch.no_grad():
        summed, count = task.loss(task.forward(model, b), b)
    returned = task.train_step(model, Recorder(model), [batch(task, items[:3]),
                                                        batch(task, items[3:6])])
    assert loss_value(returned) == pytest.approx(float(summed) / float(count), rel=1e-5)


@pytest.mark.parametrize("name", MODULES)
def test_train_step_gradient_does_not_depend_on_the_split(name, monkeypatch):
    task = task_of(name)
    whole = step_gradients(name, task, [6], monkeypatch)
    assert max_relative_gap(step_gradients(name, task, [4, 2], monkeypatch), whole) < 1e-4
    assert max_relative_gap(step_gradients(name, task, [2, 2, 2], monkeypatch), whole) < 1e-4


@pytest.mark.parametrize("name", MODULES)
def test_planted_mean_per_micro_batch_changes_the_gradient(name, monkeypatch):
    task = task_of(name, step_mean_per_micro_batch=True)
    whole = step_gradients(name, task, [6], monkeypatch)
    assert max_relative_gap(step_gradients(name, task, [4, 2], monkeypatch), whole) > 0.1


def test_planted_dropped_mask_changes_the_step_loss():
    name = "encoder_lm"
    items = sorted(items_of(name), key=lambda it: len(it.tensors["input_ids"]))
    chosen = items[:3] + items[-3:]  # short and long: left padding in the batch
    for drops, agrees in ((False, True), (True, False)):
        task = task_of(name, step_drops_mask=drops)
        torch.manual_seed(0)
        model = held(task.build_model())
        b = batch(task, chosen)
        assert bool((b["attention_mask"] == 0).any())
        with torch.no_grad():
            summed, count = task.loss(task.forward(model, b), b)
        got = loss_value(task.train_step(model, Recorder(model), [b]))
        assert math.isclose(got, float(summed) / float(count), rel_tol=1e-5) == agrees


@pytest.mark.parametrize("name", MODULES)
def test_eval_step_sums_ignore_the_padding_copies(name):
    task, items = task_of(name), items_of(name)
    torch.manual_seed(0)
    model = task.build_model().eval()
    alone = task.eval_step(model, batch(task, items[:3]))
    with_copies = task.eval_step(model, padded(task, items[:3], 8))
    assert alone.keys() == with_copies.keys() and "loss" in alone
    for key, (total, count) in with_copies.items():
        assert math.isfinite(float(total)) and float(count) > 0
        assert float(count) == float(alone[key][1])
        assert float(total) == pytest.approx(float(alone[key][0]), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("name", MODULES)
def test_planted_eval_counts_padding(name):
    task, items = task_of(name, eval_counts_padding=True), items_of(name)
    torch.manual_seed(0)
    model = task.build_model().eval()
    alone = task.eval_step(model, batch(task, items[:3]))
    with_copies = task.eval_step(model, padded(task, items[:3], 8))
    assert any(float(with_copies[k][1]) > float(alone[k][1]) for k in alone)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("leaves", (False, True))
def test_eval_step_restores_the_mode(name, leaves):
    task, items = task_of(name, eval_leaves_eval_mode=leaves), items_of(name)
    model = task.build_model()
    for mode in (True, False):
        model.train(mode)
        task.eval_step(model, padded(task, items[:3], 4))
        modes = {m.training for m in model.modules()}
        assert modes == ({False} if leaves else {mode})


@pytest.mark.parametrize("name", MODULES)
def test_checkpoint_round_trip_is_exact(name, tmp_path):
    task = task_of(name)
    saved = training_objects(name, task)
    train_a_little(name, task, saved)
    task.save_state(tmp_path, saved)
    for f in tmp_path.iterdir():
        assert f.is_file()
        torch.load(f, weights_only=True)  # plain state, no code to run
    fresh = training_objects(name, task, seed=1)
    task.restore_state(tmp_path, fresh)
    for part in ("model", "optimizer", "scheduler", "step"):
        assert same_state(fresh[part].state_dict(), saved[part].state_dict()), part
    assert list(fresh["sampler"]) == list(saved["sampler"])  # the same next pass


@pytest.mark.parametrize("name", MODULES)
def test_restore_takes_objects_that_are_absent(name, tmp_path):
    task = task_of(name)
    saved = training_objects(name, task)
    task.save_state(tmp_path, {**saved, "scheduler": None, "sampler": None})
    torch.manual_seed(3)
    model = task.build_model()
    task.restore_state(tmp_path, {"model": model, "optimizer": None, "scheduler": None,
                                  "scaler": None, "sampler": None, "step": Step()})
    assert same_state(model.state_dict(), saved["model"].state_dict())


@pytest.mark.parametrize("name", MODULES)
def test_sampler_state_gives_the_same_next_pass(name):
    task = task_of(name)
    sampler = task.make_sampler(50, 7)
    first = list(sampler)
    state = sampler.state_dict()
    second = list(sampler)
    assert sorted(first) == list(range(50)) and first != second
    other = task.make_sampler(50, 7)
    other.load_state_dict(state)
    assert list(other) == second


@pytest.mark.parametrize("name", MODULES)
def test_planted_reseeded_sampler(name, tmp_path):
    task = task_of(name, restore_reseeds_sampler=True)
    saved = training_objects(name, task)
    train_a_little(name, task, saved)
    task.save_state(tmp_path, saved)
    fresh = training_objects(name, task)
    list(fresh["sampler"])  # the restarted run drew its first pass again
    task.restore_state(tmp_path, fresh)
    assert same_state(fresh["model"].state_dict(), saved["model"].state_dict())
    assert list(fresh["sampler"]) != list(saved["sampler"])


@pytest.mark.parametrize("name", MODULES)
def test_planted_checkpoint_without_optimizer(name, tmp_path):
    task = task_of(name, ckpt_without_optimizer=True)
    saved = training_objects(name, task)
    train_a_little(name, task, saved)
    task.save_state(tmp_path, saved)
    fresh = training_objects(name, task)
    task.restore_state(tmp_path, fresh)
    assert same_state(fresh["model"].state_dict(), saved["model"].state_dict())
    assert not fresh["optimizer"].state and saved["optimizer"].state


@pytest.mark.parametrize("name", MODULES)
def test_planted_lr_typo(name):
    clean, typo = task_of(name).lr, task_of(name, lr_typo=True).lr
    assert typo == pytest.approx(clean * 1e6)
