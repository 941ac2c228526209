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


def test_pad_set_to_eos_masks_every_end_token_and_01_names_it():
    # the clean twin above passes 01: its EOS ends every response and is a target
    task = _hf(pad_is_eos=True)
    assert task.end_token == task.build_model().config.eos_token_id
    flags = {f.check: f for f in inspect_task(task).flags}
    assert set(flags) == {"end token not a target"}
    assert "pad_token == eos_token" in flags["end token not a target"].message


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
    prompt = [True] * 4 + [False] * 2  # user: repeat: x assistant: | x x
    assert _prompts(tokenizer, None, row)(row).tolist() == prompt
    assert _prompts(tokenizer, "assistant:", row)(row).tolist() == prompt
    assert _prompts(tokenizer, None, {"input_ids": ids}) is None  # no messages: no segmentation
    # a template that marks assistant turns: every assistant turn of a multi-turn chat is
    # outside the prompt, not only the last (TRL's assistant_only_loss trains them all)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == "
                               "'assistant' %}{% generation %}{{ m['content'] }} "
                               "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}"
                               "{% endfor %}")
    chat = [*messages, {"role": "user", "content": "repeat: x"},
            {"role": "assistant", "content": "x x"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)
    row = {"input_ids": list(rendered["input_ids"]), "messages": chat}
    assert _prompts(tokenizer, None, row)(row).tolist() == prompt + prompt


# --- from_hf: streaming datasets (datasets.IterableDataset, torch IterableDataset, iterables)

def _hf_pieces(conversations=120):
    pytest.importorskip("datasets")
    from examples.hf_trainer import trainer_pieces

    p = trainer_pieces(conversations)
    p["args"].max_steps = 40  # the Trainer needs it for a train set without a length
    return p


def _from_hf(p, train, evaluation, **options):
    return wb.adapters.from_hf(p["model_init"], train, evaluation, p["data_collator"],
                               p["processing_class"], p["args"], name="stream",
                               group_column="conversation", **options)


def test_from_hf_reads_a_streaming_dataset_lazily_and_never_indexes_it():
    from datasets import IterableDataset

    p = _hf_pieces()
    read = {"train": 0, "eval": 0}

    def rows(dataset, name):
        for row in dataset:
            read[name] += 1
            yield row

    train = IterableDataset.from_generator(rows, gen_kwargs={"dataset": p["train_dataset"],
                                                             "name": "train"})
    evaluation = IterableDataset.from_generator(rows, gen_kwargs={
        "dataset": p["eval_dataset"], "name": "eval"})
    task = _from_hf(p, train, evaluation)
    assert read == {"train": 1, "eval": 1}  # the first row of each: columns and checks
    assert any("train and eval datasets are read as a stream" in n for n in task.framework.notes)
    examples = task.load_examples()
    assert not isinstance(examples, list)
    first = [next(examples) for _ in range(6)]  # one row of each split in turn
    assert [ex["split"] for ex in first] == ["train", "validation"] * 3
    assert read == {"train": 4, "eval": 4}
    examples.close()
    from workbook.contract.data import prepare

    got = prepare(task, limits={"train": 5, "validation": 3})
    assert [len(got.raw[s]) for s in ("train", "validation")] == [5, 3]
    assert read["train"] < 4 + 10 and read["eval"] < 4 + 10  # stopped there
    # the same examples, tensors and batches as the map-style datasets give
    mapped = _from_hf(p, p["train_dataset"], p["eval_dataset"])
    streamed = list(task.load_examples())
    by_id = {ex["id"]: ex for ex in mapped.load_examples()}
    assert sorted(ex["id"] for ex in streamed) == sorted(by_id)
    for ex in streamed[:7]:
        assert ex["group"] == by_id[ex["id"]]["group"]
        one, other = task.encode(ex), mapped.encode(by_id[ex["id"]])
        assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
    assert inspect_task(task).verdict == "pass"


def test_from_hf_takes_a_torch_iterable_dataset_or_any_reiterable_but_not_a_generator():
    p = _hf_pieces()
    train, evaluation = list(p["train_dataset"]), list(p["eval_dataset"])

    class TorchRows(torch.utils.data.IterableDataset):
        def __init__(self, rows):
            self.rows = rows

        def __iter__(self):
            return iter(self.rows)

    class Shards:  # a plain re-iterable: opens its data anew on every iter()
        def __init__(self, rows):
            self.rows = rows

        def __iter__(self):
            yield from self.rows

    for make in (TorchRows, Shards):
        task = _from_hf(p, make(train), make(evaluation))
        assert len(list(task.load_examples())) == len(train) + len(evaluation)
        assert len(list(task.load_examples())) == len(train) + len(evaluation)  # again
    with pytest.raises(WorkbookError, match="can be read once only") as caught:
        _from_hf(p, (row for row in train), Shards(evaluation))
    assert "starts again on every iter()" in caught.value.fix


def test_from_hf_names_a_stream_without_length_or_max_steps_and_rows_that_are_not_dicts():
    p = _hf_pieces()
    p["args"].max_steps = -1
    rows = list(p["train_dataset"])
    with pytest.raises(WorkbookError, match="stream without a length") as caught:
        _from_hf(p, p["train_dataset"].to_iterable_dataset(), p["eval_dataset"])
    assert "max_steps" in caught.value.fix
    p["args"].max_steps = 40

    class Rows:
        def __iter__(self):
            yield rows[0]
            yield rows[1]["input_ids"]  # a bare list of ids, not a row

    task = _from_hf(p, Rows(), p["eval_dataset"])
    with pytest.raises(WorkbookError, match=r"rows of the train dataset are list.*\(row 1\)"):
        list(task.load_examples())


def test_from_hf_names_streamed_rows_without_the_label_column_with_the_fix():
    pytest.importorskip("datasets")
    from examples.hf_docs import trainer_pieces

    p = trainer_pieces(examples=200)
    p["args"].max_steps = 20
    rows = list(p["train_dataset"])

    class Rows:
        def __init__(self, rows):
            self.rows = rows

        def __iter__(self):
            return iter(self.rows)

    def task(train):
        return wb.adapters.from_hf(p["model_init"], train, p["eval_dataset"].to_iterable_dataset(),
                                   p["data_collator"], p["processing_class"], p["args"],
                                   name="x", group_column="author")

    late = Rows(rows[:3] + [{k: v for k, v in rows[3].items() if k != "label"}] + rows[4:])
    with pytest.raises(WorkbookError, match="train dataset's labels failed at row 3") as caught:
        list(task(late).load_examples())
    assert "give every row of the train dataset a 'label' class id" in caught.value.fix
    with pytest.raises(WorkbookError, match="have no label column") as caught:
        task(Rows([{k: v for k, v in r.items() if k != "label"} for r in rows]))
    assert "label_column=" in caught.value.fix


def test_a_streamed_eval_sets_padding_rows_are_counted_and_probed_at_the_end_of_a_pass():
    pytest.importorskip("datasets")
    from examples.hf_docs import trainer_pieces

    for counts in (False, True):
        p = trainer_pieces(examples=200, metrics_count_padding=counts)
        p["args"].max_steps = 20
        task = wb.adapters.from_hf(
            p["model_init"], p["train_dataset"].to_iterable_dataset(),
            p["eval_dataset"].to_iterable_dataset(), p["data_collator"],
            p["processing_class"], p["args"], name="x", group_column="author",
            compute_metrics=p["compute_metrics"])
        first = list(zip(range(10), task.load_examples(), strict=False))
        assert len(first) == 10 and task.framework.padding_rows == {}  # a pass stopped early
        if counts:
            with pytest.raises(WorkbookError, match="counts the eval dataset's 9 padding rows"):
                list(task.load_examples())
        else:
            assert len(list(task.load_examples())) == 200
            assert task.framework.padding_rows == {"validation": 9}


# --- from_torch: an iterable dataset, read lazily

class Readings(torch.utils.data.IterableDataset):
    """Rows [start, end) of a sensor log, written as the PyTorch docs write an IterableDataset:
    each DataLoader worker reads its own share; `reads` counts the items handed out."""

    def __init__(self, start=0, end=100_000, change_at=None):
        super().__init__()
        self.start, self.end, self.change_at, self.reads = start, end, change_at, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, last = self.start, self.end
        if info is not None:  # in a worker process: its own share
            per_worker = int(math.ceil((self.end - self.start) / info.num_workers))
            first = self.start + info.id * per_worker
            last = min(first + per_worker, self.end)
        for i in range(first, last):
            self.reads += 1
            yield self.row(i)

    def row(self, i):
        """Item i: (x, y); (x, y, w) at `change_at`, an item of another structure."""
        x = torch.randn(3, generator=torch.Generator().manual_seed(i))
        y = torch.tensor(int(x[0] > 0))
        return (x, y, torch.tensor(1.0)) if i == self.change_at else (x, y)


def _readings_task(data, **options):
    return wb.adapters.from_torch(data, _model, nn.CrossEntropyLoss(), name="readings",
                                  label_names=["low", "high"], **options)


def test_from_torch_reads_an_iterable_dataset_lazily_and_never_indexes_it():
    from itertools import islice

    from workbook.contract.data import prepare

    data = Readings()
    task = _readings_task(data, group_of=lambda i, item: f"sensor-{i // 10}")
    assert data.reads == 1 and task.model_inputs == ("inputs",)  # the first item: structure
    examples = task.load_examples()
    assert not isinstance(examples, list)
    first = list(islice(examples, 8))
    assert data.reads == 1 + 8 and [ex["id"] for ex in first] == list(range(8))
    assert first[3]["group"] == "sensor-0" and first[3]["label"] in ("low", "high")
    batch = task.collate([task.encode(ex) for ex in first])
    x, y = zip(*islice(iter(data), 8), strict=True)  # the same items, as the stream gives them
    assert torch.equal(batch["inputs"], torch.stack(x)) and torch.equal(batch["labels"],
                                                                        torch.stack(y))
    data = Readings()  # every item its own group
    got = prepare(_readings_task(data), limits={"train": 8, "validation": 2})
    assert len(got.raw["train"]) == 8 and data.reads < 40  # stopped there
    # a split of a dict of splits: one item of each split in turn
    task = _readings_task({"train": Readings(end=20), "validation": Readings(end=3)})
    assert [ex["id"] for ex in islice(task.load_examples(), 5)] == [
        "train-0", "validation-0", "train-1", "validation-1", "train-2"]
    assert [task.split(ex) for ex in task.load_examples()].count("validation") == 3


def test_from_torch_names_what_an_iterable_dataset_cannot_give():
    one_shot = (item for item in Readings(end=10))
    with pytest.raises(WorkbookError, match="can be read once only") as caught:
        _readings_task(one_shot)
    assert "starts again on every iter()" in caught.value.fix
    with pytest.raises(WorkbookError, match="the train dataset .Readings. has no items"):
        _readings_task({"train": Readings(end=0), "validation": Readings()})
    with pytest.raises(WorkbookError, match="label_names"):
        wb.adapters.from_torch(Readings(), _model, nn.CrossEntropyLoss(), name="x")
    task = _readings_task(Readings(end=50, change_at=7))
    with pytest.raises(WorkbookError, match=r"dataset's item 7 has the fields \['input0'"):
        list(task.load_examples())

    class Unreadable(Readings):
        def row(self, i):
            if i == 12:
                raise OSError("shard-0003.bin: Input/output error")
            return super().row(i)

    task = _readings_task(Unreadable(end=50))
    with pytest.raises(WorkbookError, match="reading the dataset failed at item 12: OSError: "
                                            "shard-0003.bin") as caught:
        list(task.load_examples())
    assert "at that item" in caught.value.fix
