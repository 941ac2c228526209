"""from_torch: a plain Dataset, collate_fn, model and criterion as a Task - the criterion's mean
turned into (sum, count), padding copies and ignored targets weighing nothing, groups from the
user's function, and what cannot be mapped refused with the piece named."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import workbook as wb
from workbook.base.errors import WorkbookError
from workbook.notebooks.inspection import inspect_task


class Pairs(Dataset):
    def __init__(self, n=40, regression=False):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x.sum(1, keepdim=True) if regression else (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _model():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 2))


def _batch(task, ids):
    return task.collate([task.encode({"id": i}) for i in ids])


def test_a_mean_criterion_becomes_the_sum_over_targets_with_their_count():
    data = Pairs()
    task = wb.adapters.from_torch(data, _model, nn.CrossEntropyLoss(), name="pairs")
    assert task.model_inputs == ("inputs",) and task.label_names == ["0", "1"]
    batch = _batch(task, range(6))
    logits = torch.randn(6, 2)
    total, count = task.loss(logits, batch)
    assert int(count) == 6
    assert math.isclose(float(total) / 6, float(nn.functional.cross_entropy(logits, batch[
        "labels"])), rel_tol=1e-6)
    batch["labels"][4:] = -100  # padding copies of an evaluation's last batch
    total2, count2 = task.loss(logits, batch)
    assert int(count2) == 4 and math.isclose(float(total2), float(nn.functional.cross_entropy(
        logits[:4], batch["labels"][:4], reduction="sum")), rel_tol=1e-6)


def test_a_weighted_criterion_divides_by_the_targets_weights():
    data = Pairs()
    weight = torch.tensor([1.0, 3.0])
    task = wb.adapters.from_torch(data, _model, nn.CrossEntropyLoss(weight=weight), name="w")
    batch, logits = _batch(task, range(8)), torch.randn(8, 2)
    total, count = task.loss(logits, batch)
    expected = nn.functional.cross_entropy(logits, batch["labels"], weight=weight)
    assert math.isclose(float(total / count), float(expected), rel_tol=1e-6)


def test_regression_ignores_nan_targets_and_runs_on_fake_tensors():
    data = Pairs(regression=True)
    task = wb.adapters.from_torch(data, lambda: nn.Linear(3, 1), nn.MSELoss(), name="reg",
                                  kind="regression")
    batch = _batch(task, range(5))
    batch["labels"][3:] = float("nan")
    out = torch.randn(5, 1)
    total, count = task.loss(out, batch)
    assert int(count) == 3 and math.isclose(
        float(total), float(((out[:3] - batch["labels"][:3]) ** 2).sum()), rel_tol=1e-6)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fake:  # the rental is sized on fake tensors: no data-dependent shape
        task.loss(fake.from_tensor(out), {k: fake.from_tensor(v) for k, v in batch.items()})


def test_groups_come_from_the_users_function_and_keep_near_duplicates_in_one_split():
    from examples.torch_dataset import make_task

    task = make_task(sources=24)
    ins = inspect_task(task)
    assert ins.verdict == "pass", ins.flag_table()
    splits = {}
    for ex in task.load_examples():
        splits.setdefault(ex["group"], set()).add(task.split(ex))
    assert len(splits) == 24 and all(len(s) == 1 for s in splits.values())


@pytest.mark.parametrize("build, match", [
    (lambda: wb.adapters.from_torch([1, 2], _model, nn.CrossEntropyLoss(), name="x"),
     "dataset item 0 is a int"),
    (lambda: wb.adapters.from_torch(iter([]), _model, nn.CrossEntropyLoss(), name="x"),
     "not a map-style Dataset"),
    (lambda: wb.adapters.from_torch(Pairs(), _model, nn.Identity(), name="x"),
     "has no `reduction`"),
    (lambda: wb.adapters.from_torch(Pairs(), _model, nn.CrossEntropyLoss(), name="x",
                                    kind="generation"), "needs decode"),
    (lambda: wb.adapters.from_torch(Pairs(), _model, nn.CrossEntropyLoss(), name="x",
                                    kind="detection"), "not 'detection'"),
    (lambda: wb.adapters.from_torch({"training": Pairs()}, _model, nn.CrossEntropyLoss(),
                                    name="x"), "'training' is not a split"),
    (lambda: wb.adapters.from_torch([{"x": torch.ones(2)}], _model, nn.CrossEntropyLoss(),
                                    name="x"), "has no 'labels'"),
    (lambda: wb.adapters.from_torch(Pairs(), _model, nn.CrossEntropyLoss(), name="x",
                                    fields=("a", "b", "c")), "has 2 elements"),
])
def test_what_cannot_be_mapped_is_refused_naming_the_piece(build, match):
    with pytest.raises(WorkbookError, match=match):
        build()


# --- from_hf: a Trainer's pieces

def _hf(**options):
    pytest.importorskip("transformers")
    from examples.hf_trainer import make_task

    return make_task(conversations=120, **options)


def test_a_trainer_setup_keeps_the_hf_convention_and_the_collators_own_labels():
    task = _hf()
    assert (task.kind, task.label_shift, task.padding_side) == ("generation", 1, "right")
    assert task.model_inputs == ("input_ids", "attention_mask") and task.lr == 1e-2
    examples = task.load_examples()
    assert {task.split(ex) for ex in examples} == {"train", "validation"}
    one = task.encode(examples[0])
    assert torch.equal(one["labels"], one["input_ids"])  # the collator's labels, one row
    batch = task.collate([task.encode(ex) for ex in examples[:4]])
    padded = batch["attention_mask"] == 0
    assert padded.any() and (batch["labels"][padded] == -100).all()
    copy = {**task.encode(examples[1]), "labels": torch.full_like(one["labels"], -100)}
    with_copy = task.collate([task.encode(examples[0]), copy])  # evaluation's padding copy
    assert (with_copy["labels"][1] == -100).all() and (with_copy["labels"][0] != -100).any()
    assert inspect_task(task).verdict == "pass"


def test_a_collator_that_leaves_pad_ids_in_the_labels_is_named_by_01():
    flags = {f.check for f in inspect_task(_hf(pad_in_labels=True)).flags}
    assert "loss on padding" in flags


def test_what_from_hf_cannot_map_is_refused_naming_the_piece():
    transformers = pytest.importorskip("transformers")
    task = _hf()
    rows = [task.encode(ex) for ex in task.load_examples()[:2]]
    config = transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=8)
    with pytest.raises(WorkbookError, match="not BertModel"):
        wb.adapters.from_hf(lambda: transformers.BertModel(config), rows, rows, task.collate,
                            None, name="x")
    llama = task.build_model.build
    with pytest.raises(WorkbookError, match="not dicts of token ids"):
        wb.adapters.from_hf(llama, ["a b"], ["a"], task.collate, None, name="x")
    with pytest.raises(WorkbookError, match="returns no labels"):
        wb.adapters.from_hf(llama, [{"input_ids": [1, 2]}], [{"input_ids": [1]}],
                            lambda rows: {"input_ids": torch.tensor([[1, 2]])}, None, name="x")


def test_a_sequence_classifier_reads_its_label_names_from_the_config_and_passes_01():
    pytest.importorskip("transformers")
    from examples.hf_trainer import make_classifier

    task = make_classifier(examples=200)
    assert (task.kind, task.label_names[0]) == ("classification", "cooking")
    batch = task.collate([task.encode(ex) for ex in task.load_examples()[:3]])
    assert batch["labels"].shape == (3,) and task.decode([0, 4]) == "cooking, weather"
    assert inspect_task(task).verdict == "pass"


def test_a_completion_only_collator_is_checked_against_the_response_template():
    pytest.importorskip("transformers")
    from examples.hf_trainer import make_sft

    clean = make_sft(conversations=120)
    assert not clean.prompt_in_loss
    one = clean.encode(clean.load_examples()[0])
    assert int(one["prompt_mask"].sum()) == 4 and not (one["labels"][one["prompt_mask"]]
                                                      != -100).any()
    assert inspect_task(clean).verdict == "pass"
    flags = {f.check for f in inspect_task(make_sft(conversations=120,
                                                    prompt_in_labels=True)).flags}
    assert "loss on prompt" in flags


def test_the_prompt_of_a_chat_row_comes_from_the_chat_template():
    pytest.importorskip("transformers")
    from examples.hf_trainer import tokenizer_from
    from workbook.contract.adapters.hf import _prompts

    tokenizer = tokenizer_from(["user: assistant: repeat: x x"])
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} "
                               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    messages = [{"role": "user", "content": "repeat: x"},
                {"role": "assistant", "content": "x x"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    row = {"input_ids": ids, "messages": messages}
    assert _prompts(tokenizer, None, row)(row) == 4  # user: repeat: x assistant:
    assert _prompts(tokenizer, "assistant:", row)(row) == 4
    assert _prompts(tokenizer, None, {"input_ids": ids}) is None  # no messages: no segmentation
