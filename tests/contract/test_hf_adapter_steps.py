"""`HFAdapter`'s steps called one by one (adapters/hf.py), on the tiny models and datasets of
the from_hf tests: `tensors` and `encode` of a row, `collate` (the user's collator, a padding
copy weighing nothing), `load_stream` (one row of each split in turn, read lazily), a pass's
padding rows put on the task, `eval_step` (compute_metrics of the split so far) and `decode`."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from workbook.contract.adapters.hf import HFAdapter  # noqa: E402
from workbook.contract.adapters.hf_metrics import ROW  # noqa: E402
from workbook.contract.metric_reduction import GATHERED  # noqa: E402


@pytest.fixture(scope="module")
def lm():
    """A tiny Llama, its tokenized conversations and DataCollatorForLanguageModeling."""
    from examples.hf_trainer import trainer_pieces

    return trainer_pieces(conversations=60)


@pytest.fixture(scope="module")
def docs():
    """The docs' classifier: an eval set padded with 9 rows of label -100, compute_metrics
    with accuracy and macro F1 (a metric no per-batch mean gives)."""
    from examples.hf_docs import trainer_pieces

    return trainer_pieces(examples=200, f1=True)


def _adapter(p, train=None, evaluation=None, **options):
    return HFAdapter(p["model_init"], p["train_dataset"] if train is None else train,
                     p["eval_dataset"] if evaluation is None else evaluation,
                     p["data_collator"], p["processing_class"], p["args"], name="steps",
                     **options)


def test_tensors_keep_the_columns_the_trainer_keeps_the_label_as_labels(docs):
    row = docs["train_dataset"][0]
    one = _adapter(docs).tensors(row)
    assert {"text", "author", "label"}.isdisjoint(one) and {"input_ids", "labels"} <= set(one)
    assert one["labels"].item() == row["label"] and one["input_ids"].tolist() == row["input_ids"]


def test_collate_is_the_users_collator_with_a_padding_copy_weighing_nothing(lm):
    adapter = _adapter(lm)
    rows = lm["train_dataset"]
    i, j = 0, next(k for k in range(len(rows)) if len(rows[k]["input_ids"]) !=
                   len(rows[0]["input_ids"]))
    encoded = [adapter.encode({"split": "train", "index": k}) for k in (i, j)]
    assert torch.equal(encoded[0]["labels"], encoded[0]["input_ids"])  # the collator's, alone
    batch = adapter.collate(encoded)
    theirs = lm["data_collator"]([{k: rows[n][k] for k in ("input_ids", "attention_mask")}
                                  for n in (i, j)])
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(batch[key], theirs[key]), key
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()  # padding: no target
    assert batch[ROW].tolist() == [i, j]  # which train rows (split offset 0)
    copy = {**encoded[1], "labels": torch.full_like(encoded[1]["labels"], -100)}
    with_copy = adapter.collate([encoded[0], copy])  # evaluation's padding copy of a row
    assert (with_copy["labels"][1] == -100).all()
    assert torch.equal(with_copy["labels"][0], batch["labels"][0])


class Counted:
    """A re-iterable of rows that counts the rows handed out."""

    def __init__(self, rows):
        self.rows, self.read = rows, 0

    def __iter__(self):
        for row in self.rows:
            self.read += 1
            yield row


def test_load_stream_reads_one_row_of_each_split_in_turn_and_no_more(lm):
    rows = {s: list(lm[f"{s}_dataset"]) for s in ("train", "eval")}
    train, evaluation = Counted(rows["train"]), Counted(rows["eval"])
    adapter = _adapter(lm, train, evaluation)
    assert adapter.streamed == ["train", "validation"]
    assert (train.read, evaluation.read) == (1, 1)  # the first row of each, read once
    stream = adapter.load_stream()
    first = [next(stream) for _ in range(4)]
    assert [ex["split"] for ex in first] == ["train", "validation"] * 2
    assert (train.read, evaluation.read) == (3, 3)
    assert first[2]["row"] == rows["train"][1]  # each example carries its row
    indexed = _adapter(lm).encode({"split": "train", "index": 1})
    streamed = adapter.encode(first[2])
    assert streamed.keys() == indexed.keys()
    assert all(torch.equal(streamed[k], indexed[k]) for k in streamed)


def test_a_whole_pass_counts_the_padding_rows_and_puts_them_on_the_task(docs):
    adapter = _adapter(docs, group_column="author")
    examples = adapter.load_examples()
    assert len(examples) == 200 and {ex["split"] for ex in examples} == {"train", "validation"}
    assert all(ex["label"] in adapter.label_names for ex in examples)
    assert any("9 rows of the eval dataset have label -100" in n for n in adapter.notes)
    task = adapter.task()
    assert task.framework.padding_rows == {} and task.framework.notes is adapter.notes
    task.load_examples()
    assert task.framework.padding_rows == {"validation": 9}


def test_eval_step_gives_compute_metrics_of_the_whole_split_as_batch_sums(docs):
    from examples.hf_docs import accuracy_and_f1

    adapter = _adapter(docs, compute_metrics=docs["compute_metrics"])
    task = adapter.task()
    torch.manual_seed(0)
    model = task.build_model()
    evaluation = [ex for ex in adapter.load_examples() if ex["split"] == "validation"][:20]
    encoded = [adapter.encode(ex) for ex in evaluation]
    copy = {**encoded[0], "labels": torch.tensor(-100)}  # a padding copy: never counted
    sums: dict[str, list[float]] = {}
    for part in (encoded[:7], [*encoded[7:], copy]):
        for name, (total, count) in adapter.eval_step(model, adapter.collate(part)).items():
            sums.setdefault(name, [0.0, 0.0])
            sums[name][0] += total
            sums[name][1] += count
    whole = adapter.collate(encoded)
    with torch.no_grad():
        logits = model.eval()(input_ids=whole["input_ids"],
                              attention_mask=whole["attention_mask"]).logits
    expected = accuracy_and_f1(np.argmax(logits.numpy(), 1), whole["labels"].numpy(),
                               len(adapter.label_names))
    assert sums["n_examples"] == [20 * 20, 20]  # 20 rows: the copy left out
    assert sums["f1"][0] / sums["f1"][1] == pytest.approx(expected["f1"])
    assert sums["accuracy"][0] / sums["accuracy"][1] == pytest.approx(expected["accuracy"])
    # declared on the task, one place for every framework (never an attribute of the step)
    assert task.framework.metric_reductions == dict.fromkeys(sums, GATHERED)
    assert not hasattr(task.eval_step, "metric_reductions")


def test_decode_gives_text_or_class_names(lm, docs):
    adapter = _adapter(lm)
    ids = lm["train_dataset"][0]["input_ids"][:5]
    assert adapter.decode([*ids, -100]) == lm["processing_class"].decode(ids)
    classifier = _adapter(docs)
    assert classifier.decode([0, 4]) == ", ".join(classifier.label_names[i] for i in (0, 4))
    assert classifier.decode([99]) == "<99?>"
