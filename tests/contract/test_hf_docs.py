"""from_hf on a Trainer setup as the Hugging Face docs write it (examples/hf_docs.py): an eval set
padded with label -100 rows, a collator reading f["label"], compute_metrics as the evaluation,
the Trainer's schedule, callbacks and checkpoints - each item with a planted bug the pilot names
and its clean twin."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import workbook as wb
from workbook.base.errors import WorkbookError
from workbook.contract.data import prepare
from workbook.notebooks.inspection import inspect_task
from workbook.training import checkpoint as ckpt
from workbook.training.evaluation import evaluate
from workbook.training.loop import TrainConfig, UpdateShape, build_stepper, train

pytest.importorskip("transformers")
pytest.importorskip("datasets")

EXAMPLES = 200  # 161 train rows, 39 eval rows padded with 9 rows of label -100 to 48


def _pieces(**options):
    from examples.hf_docs import trainer_pieces

    return trainer_pieces(examples=EXAMPLES, **options)


def _task(p, **changes):
    kw = {"name": "hf-docs", "group_column": "author", "compute_metrics": p["compute_metrics"],
          "callbacks": p["callbacks"], **changes}
    return wb.adapters.from_hf(p["model_init"], p["train_dataset"], p["eval_dataset"],
                               p["data_collator"], p["processing_class"], p["args"], **kw)


@pytest.fixture(scope="module")
def clean():
    p = _pieces()
    return p, _task(p)


# --- 1. eval rows with label -100 are padding ---------------------------------------------------
def test_padding_rows_are_no_examples_and_are_counted(clean):
    p, task = clean
    examples = task.load_examples()
    padding = sum(1 for label in p["eval_dataset"]["label"] if label == -100)
    assert padding == 9 and task.framework.padding_rows == {"validation": 9}
    assert len(examples) == EXAMPLES and all(not ex["label"].startswith("<") for ex in examples)
    assert any("9 rows of the eval dataset have label -100" in n for n in task.framework.notes)


def test_a_label_id_out_of_range_is_named_by_01_not_a_crash():
    from datasets import Dataset

    p = _pieces()
    rows = p["eval_dataset"].to_dict()
    rows["label"][0] = 7  # five classes: 0..4
    p["eval_dataset"] = Dataset.from_dict(rows)
    task = _task(p)
    examples = task.load_examples()
    assert examples[len(p["train_dataset"])]["label"] == "<7?>"
    flags = {f.check: f for f in inspect_task(task).flags}
    assert "label ids out of range" in flags and "validation-0" in flags[
        "label ids out of range"].examples


def test_a_label_that_is_no_class_id_names_the_adapters_step():
    p = _pieces()
    p["eval_dataset"] = [dict(r, label=None if i == 3 else r["label"])
                         for i, r in enumerate(p["eval_dataset"])]
    task = _task(p)
    with pytest.raises(WorkbookError, match=r"from_hf: reading the eval dataset's labels "
                                            r"failed at row 3: TypeError") as err:
        task.load_examples()
    assert "load_examples" not in str(err.value)


# --- 2. the collator receives the rows as the dataset holds them --------------------------------
class Recording:
    def __init__(self, inner):
        self.inner, self.keys = inner, set()

    def __call__(self, features):
        self.keys.update(k for f in features for k in f)
        return self.inner(features)


def test_a_custom_collator_reads_label_and_the_pilot_gets_labels_after_it():
    p = _pieces(collator="custom")
    p["data_collator"] = Recording(p["data_collator"])
    task = _task(p)
    examples = task.load_examples()
    batch = task.collate([task.encode(ex) for ex in examples[:4]])
    assert p["data_collator"].keys == {"input_ids", "attention_mask", "label"}  # no text
    assert batch["labels"].tolist() == [p["train_dataset"][i]["label"] for i in range(4)]
    assert inspect_task(task).verdict == "pass"


def test_a_collator_that_drops_the_attention_mask_is_named_by_01():
    flags = {f.check for f in inspect_task(_task(_pieces(collator_drops_mask=True))).flags}
    assert "padding changes outputs" in flags


# --- 3. compute_metrics is the evaluation, exactly ----------------------------------------------
def _whole_split(task, p, model):
    """What Trainer.evaluate hands compute_metrics: every row of the eval set, padding too."""
    from transformers import EvalPrediction

    rows = list(p["eval_dataset"])
    batch = p["data_collator"]([{k: r[k] for k in ("input_ids", "attention_mask", "label")}
                                for r in rows])
    with torch.no_grad():
        logits = model.eval()(input_ids=batch["input_ids"],
                              attention_mask=batch["attention_mask"]).logits
    return p["compute_metrics"](EvalPrediction(predictions=logits.numpy(),
                                               label_ids=np.array([r["label"] for r in rows])))


@pytest.mark.parametrize("eval_batch", [5, 16])
def test_compute_metrics_through_the_sums_equals_the_trainers_on_the_whole_split(eval_batch):
    p = _pieces(f1=True)  # macro F1: no per-batch mean gives it
    task = _task(p)
    data = prepare(task)
    torch.manual_seed(0)
    model = task.build_model()
    cfg = TrainConfig(shape=UpdateShape(micro_batch=8, accumulation=1), updates=6, lr=3e-3,
                      device="cpu")
    trained = train(task, data.train, cfg, model=model).model
    record = evaluate(task, trained, data.validation, eval_batch, torch.device("cpu"))
    expected = _whole_split(task, p, trained)
    assert record.examples == 39
    assert math.isclose(record.metrics["accuracy"], expected["accuracy"], rel_tol=1e-9)
    assert math.isclose(record.metrics["f1"], expected["f1"], rel_tol=1e-9)
    again = evaluate(task, trained, data.validation, 7, torch.device("cpu"))  # a fresh split
    assert math.isclose(again.metrics["f1"], expected["f1"], rel_tol=1e-9)


def test_04s_evaluation_check_passes_the_clean_compute_metrics(clean):
    from workbook.notebooks.accounting.own_code_checks import evaluation_check, evaluation_findings

    _, task = clean
    data = prepare(task)
    table = evaluation_check(task, data.validation[:21])
    assert set(table.metric) == {"accuracy", "n_examples"} and table.ok.all(), \
        table.to_dict("records")
    assert evaluation_findings(table) == []


def test_a_compute_metrics_that_counts_the_padding_rows_is_named():
    task = _task(_pieces(metrics_count_padding=True))
    with pytest.raises(WorkbookError, match=r"compute_metrics counts the eval dataset's 9 "
                                            r"padding rows.*accuracy is 0\.8125 with them and 1 "
                                            r"without"):
        task.load_examples()


# --- 4. the Trainer's schedule ------------------------------------------------------------------
# both schedules are stepped with no optimizer step between: only their rates are compared
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_the_trainers_cosine_schedule_with_warmup(clean):
    from transformers import get_cosine_schedule_with_warmup

    p, task = clean
    own = 2 * math.ceil(len(p["train_dataset"]) / 16)  # 2 epochs of 16 rows: 22 updates
    for updates, total in ((20, own), (40, 40)):  # a longer run stretches it to its updates
        cfg = TrainConfig(shape=UpdateShape(micro_batch=4, accumulation=1), updates=updates,
                          lr=1e-3, device="cpu")
        stepper = build_stepper(task, cfg)
        warmup = math.ceil(total * 0.1)
        reference = get_cosine_schedule_with_warmup(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), warmup, total)
        rates = [reference.get_last_lr()[0]]
        for _ in range(total):
            reference.step()
            rates.append(reference.get_last_lr()[0])
        seen = []
        for _ in range(updates):
            seen.append(stepper.optimizer.param_groups[0]["lr"])
            stepper.scheduler.step()
        # the Trainer's first update runs at lr 0 and moves nothing: the warm-up counts from 1
        wanted = [rates[k + 1] if k < warmup else rates[k] for k in range(updates)]
        assert seen[0] > 0 and max(seen) == pytest.approx(1e-3)
        assert seen == pytest.approx(wanted, rel=1e-9) and min(seen) > 0
        assert stepper.optimizer.param_groups[0]["initial_lr"] == 1e-3  # 03's gate reads it


def test_a_schedule_that_follows_a_metric_is_refused_naming_the_piece():
    p = _pieces()
    p["args"].lr_scheduler_type = "reduce_lr_on_plateau"
    with pytest.raises(WorkbookError, match="reduce_lr_on_plateau"):
        _task(p)


# --- 5. callbacks and checkpoints ---------------------------------------------------------------
def _run_and_save(p, task, tmp_path, updates=3):
    data = prepare(task)
    cfg = TrainConfig(shape=UpdateShape(micro_batch=4, accumulation=1), updates=updates,
                      lr=1e-3, device="cpu")
    result = train(task, data.train, cfg, stepper=(stepper := build_stepper(task, cfg)))
    assert len(result.steps) == updates
    path = ckpt.save_checkpoint(tmp_path / "ckpt", stepper.model, stepper.optimizer,
                                stepper.scheduler, counters={"step": updates},
                                own=task.save_state)
    return cfg, stepper, path


def test_callbacks_are_called_as_the_trainer_calls_them_and_the_checkpoint_resumes(tmp_path):
    p = _pieces()
    task = _task(p)
    cfg, stepper, path = _run_and_save(p, task, tmp_path)
    callback = p["callbacks"][0]
    assert callback.events == [("on_train_begin", 0), ("on_step_end", 1), ("on_step_end", 2),
                               ("on_step_end", 3), ("on_save", 3)]
    assert {f.name for f in path.iterdir()} >= {"model.safetensors", "config.json",
                                                "optimizer.pt", "scheduler.pt",
                                                "trainer_state.json"}
    assert json.loads((path / "trainer_state.json").read_text())["global_step"] == 3
    record = Path(stepper.scheduler.hooks.args.output_dir) / "checkpoint-3" / "record.json"
    assert json.loads(record.read_text())["global_step"] == 3
    assert not Path(p["args"].output_dir).exists()  # never the campaign's output_dir
    fresh = build_stepper(task, cfg)
    ckpt.load_checkpoint(path, fresh.model, fresh.optimizer, fresh.scheduler,
                         own=task.restore_state)  # every part checked against its digest
    assert fresh.scheduler.state.global_step == 3
    assert fresh.optimizer.param_groups[0]["lr"] == stepper.optimizer.param_groups[0]["lr"]


def test_a_callback_that_raises_is_named(tmp_path):
    p = _pieces(callback_raises=True)
    with pytest.raises(WorkbookError, match=r"from_hf: the callback SaveRecordCallback\.on_save "
                                            r"raised KeyError: 'tokenizer' \(at global_step 2"):
        _run_and_save(p, _task(p), tmp_path, updates=2)


def test_save_only_model_checkpoints_cannot_resume_and_say_why(tmp_path):
    p = _pieces(save_only_model=True)
    task = _task(p)
    cfg, _, path = _run_and_save(p, task, tmp_path, updates=2)
    fresh = build_stepper(task, cfg)
    with pytest.raises(WorkbookError, match=r"no optimizer\.pt, scheduler\.pt "
                                            r"\(save_only_model=True"):
        ckpt.load_checkpoint(path, fresh.model, fresh.optimizer, fresh.scheduler,
                             own=task.restore_state)
    ckpt.load_checkpoint(path, fresh.model, own=task.restore_state)  # model only: fine


# --- the clean task as a whole ------------------------------------------------------------------
def test_the_docs_task_passes_01(clean):
    _, task = clean
    ins = inspect_task(task)
    assert ins.verdict == "pass"
    # 01 shows what the adapter left out: the eval set's padding rows, said once
    said = [n.message for n in ins.notes if n.check == "what the adapter mapped"]
    assert len([m for m in said if "have label -100 (padding)" in m]) == 1, said


def test_a_compute_metrics_that_raises_or_returns_no_numbers_is_named():
    p = _pieces()

    def broken(eval_pred):
        raise ZeroDivisionError("division by zero")
    with pytest.raises(WorkbookError, match=r"from_hf: compute_metrics raised "
                                            r"ZeroDivisionError: division by zero"):
        _task(p, compute_metrics=broken).load_examples()  # the padding probe calls it
    task = _task(p, compute_metrics=lambda eval_pred: {"accuracy": "high"})
    with pytest.raises(WorkbookError, match="compute_metrics returned .* not a dict of numbers"):
        task.load_examples()


def test_callbacks_without_training_arguments_are_refused():
    p = _pieces()
    p["args"] = type("Args", (), {"learning_rate": 1e-3})()
    with pytest.raises(WorkbookError, match="callbacks need the TrainingArguments"):
        _task(p)
