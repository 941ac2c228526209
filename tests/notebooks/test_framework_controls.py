"""The framework examples' clean controls raise nothing and their planted bugs are named, judged
by the library calls the notebooks make: 09's evaluation rule reduces each metric as its
framework does (counts summed, compute_metrics on gathered outputs, sync_dist's mean of ranks
named), 03's update gates run inside a schedule sized for a campaign; the mode and schedule
bugs of examples/lightning_docs.py named by the adapter as 04 runs the module, and their clean
twins silent."""

import copy

import pytest
import torch

pytest.importorskip("lightning")

from workbook import WorkbookError  # noqa: E402
from workbook.contract.data import prepare  # noqa: E402
from workbook.contract.metric_reduction import (  # noqa: E402
    GATHERED,
    MEAN,
    OWN,
    ROWS,
    SUM,
    reduced,
)
from workbook.contract.task import load_task  # noqa: E402
from workbook.notebooks import accounting as acc  # noqa: E402
from workbook.notebooks.gates import run_gates  # noqa: E402
from workbook.notebooks.gates.settings import GateSettings  # noqa: E402
from workbook.notebooks.parallel.rank_rules import _eval_row  # noqa: E402
from workbook.training.evaluation import evaluation_sums  # noqa: E402
from workbook.training.loop import TrainConfig, UpdateShape, train  # noqa: E402
from workbook.training.replica import rank_evaluation  # noqa: E402

LIGHTNING_DOCS = "examples.lightning_docs:task"
HF_DOCS = "examples.hf_docs:task"


def test_each_reduction_combines_the_ranks_values_as_its_framework_does():
    ranks = [(32 * 32, 32), (31 * 31, 31)]  # a count logged at the epoch's end: 32 and 31
    assert reduced(SUM, ranks) == 63
    assert reduced(ROWS, ranks) == pytest.approx((32 * 32 + 31 * 31) / 63)
    assert reduced(MEAN, [(1.0, 2), (3.0, 1)]) == pytest.approx((0.5 + 3.0) / 2)
    assert reduced(GATHERED, ranks) is None  # the framework's own value: one process's


def _launch_evaluation(spec: str, examples: int = 63, **options) -> tuple[dict, dict]:
    """09's evaluation without processes: each shard and the whole split evaluated as its
    rank would (`rank_evaluation`), the adapter's declared reductions beside each rank's sums."""
    task = load_task(spec, **options)
    items = prepare(task).validation[:examples]
    torch.manual_seed(0)
    model = task.build_model()
    cpu = torch.device("cpu")
    ranks = []
    for rank in range(2):  # a fresh copy per process: one rank's epoch is not another's
        ranks.append(rank_evaluation(task, copy.deepcopy(model), items[rank::2], 8, cpu))
    single, _ = evaluation_sums(task, copy.deepcopy(model), items, 8, cpu)
    ev = {"ranks": ranks, "single": single}
    return _eval_row({"evaluation": ev}, 1e-5), ranks[0]["reductions"]


def test_lightning_counts_are_summed_over_ranks_and_its_clean_control_passes_09():
    row, how = _launch_evaluation(LIGHTNING_DOCS)
    assert how["val_n"] == SUM and how["val_acc"] == OWN and how["val_loss"] == ROWS
    assert row["verdict"] == "pass", row["measured"]


def test_an_f1_averaged_over_ranks_with_sync_dist_is_named_in_09():
    row, how = _launch_evaluation(LIGHTNING_DOCS, macro_f1=True)
    assert how["val_f1"] == MEAN
    assert row["verdict"] == "fail"
    assert "val_f1" in row["measured"] and "sync_dist=True" in row["measured"]
    assert "val_n" not in row["measured"]  # the count is right


EPOCH_METRIC = "tests.lightning_epoch_metric:task"


def test_an_epoch_end_metric_from_each_ranks_own_state_is_named_as_what_the_code_does():
    """A macro-F1 computed in on_validation_epoch_end from the rank's own confusion matrix and
    logged without sync_dist: said as that, with each rank's value and the fix for it."""
    row, how = _launch_evaluation(EPOCH_METRIC)
    assert how["val_macro_f1"] == OWN and row["verdict"] == "fail"
    said = row["measured"]
    assert ("val_macro_f1 is computed in on_validation_epoch_end from each rank's own "
            "accumulated state and logged without sync_dist: every rank logs its own shard's "
            "value (rank 0 ") in said
    assert "self.all_gather" in said and "torchmetrics Metric" in said
    assert "Lightning's epoch mean of a step log" not in said


def test_the_same_f1_as_a_torchmetrics_metric_passes_and_a_step_log_keeps_its_words():
    row, how = _launch_evaluation(EPOCH_METRIC, sync="torchmetrics")
    assert how["val_macro_f1"] == GATHERED and row["verdict"] == "pass", row["measured"]
    row, how = _launch_evaluation(EPOCH_METRIC, sync="step")  # each batch's F1, sync_dist
    assert how["val_macro_f1"] == ROWS and row["verdict"] == "fail"
    assert "(Lightning's epoch mean of a step log, sync_dist=True)" in row["measured"]
    assert "on_validation_epoch_end" not in row["measured"]


def test_hf_compute_metrics_runs_on_gathered_outputs_and_its_clean_control_passes_09():
    row, how = _launch_evaluation(HF_DOCS, f1=True)
    assert set(how) == {"accuracy", "f1", "n_examples"} and set(how.values()) == {GATHERED}
    assert row["verdict"] == "pass", row["measured"]
    assert "n_examples" in row["measured"] and "gathered" in row["measured"]


def test_a_one_cycle_schedule_is_sized_for_a_campaign_so_the_later_update_moves(tmp_path):
    """OneCycleLR over estimated_stepping_batches at max_lr 3e-3 (03's lr 1.2e-4 is its start,
    max_lr / 25): sized for the gates' two updates, the second ran at 1.2e-8 and left the batch
    norm's weight unchanged."""
    task = load_task(LIGHTNING_DOCS, rows=300)
    settings = GateSettings(shape=UpdateShape(2, 2), eval_batch=8, lr=1.2e-4,
                            device_memory_gib=0)
    report = run_gates(task, settings, tmp_path, train_limit=64)
    rows = {r.phase: r for r in report.rows}
    assert rows["update (later)"].verdict == "pass", rows["update (later)"].detail
    # the lr the second update ran at (the third's is 1.28e-4): early in the cycle, rising
    assert "lr 0.000122" in rows["update (later)"].detail


def _train_and_evaluate(**options) -> None:
    """What 04 runs of the task's own code: its eval_step between updates, then a few updates
    with evaluations (the module's and the callbacks' hooks around them)."""
    task = load_task(LIGHTNING_DOCS, rows=300, **options)
    data = prepare(task)
    acc.evaluation_check(task, data.validation[:10])
    cfg = TrainConfig(UpdateShape(2, 2), updates=6, eval_every=3, eval_batch=8, device="cpu")
    train(task, data.train[:40], cfg, val_items=data.validation[:10])


@pytest.mark.parametrize("clean", [{}, {"callback_eval": "validation_end"}])
def test_the_clean_twins_of_the_mode_and_schedule_bugs_raise_nothing(clean):
    _train_and_evaluate(**clean)  # an eval() in on_validation_end: Lightning undoes it


def test_batch_norm_put_in_training_mode_inside_validation_step_is_named():
    with pytest.raises(WorkbookError, match=r"validation_step put BatchNorm1d 'net.1'.* in "
                                            r"training mode \(model.train\(\) inside"):
        _train_and_evaluate(bn_train_in_validation=True)


def test_a_callback_leaving_the_module_in_eval_mode_for_the_updates_is_named():
    with pytest.raises(WorkbookError, match=r"callback EvalModeCallback.on_train_epoch_start put "
                                            r"BatchNorm1d 'net.1', Dropout 'net.3' in eval mode"):
        _train_and_evaluate(callback_eval="train_epoch_start")


def test_a_one_cycle_sized_per_update_but_stepped_per_epoch_is_named():
    with pytest.raises(WorkbookError, match=r"sizes OneCycleLR in updates \(total_steps=6.* "
                                            r"once per epoch.*stays near its start"):
        _train_and_evaluate(epoch_interval=True)


@pytest.mark.parametrize("max_length", [3, 32])
def test_duplicates_made_by_the_tokenizers_truncation_are_named_as_such(max_length):
    from workbook.notebooks.inspection import inspect_task

    flags = [f for f in inspect_task(load_task(HF_DOCS, max_length=max_length)).flags
             if f.check == "duplicate input crosses splits"]
    if max_length == 32:  # the docs' own length cuts posts too, but makes no duplicate
        assert flags == []
        return
    assert len(flags) == 1 and "truncation: max_length 3 cuts" in flags[0].message
    assert "identical only after the cut" in flags[0].message
    assert flags[0].fix.startswith("raise max_length")


def test_an_hf_callbacks_eval_is_undone_before_the_next_update_as_the_trainer_does():
    task = load_task(HF_DOCS, examples=120, callback_eval=True)
    data = prepare(task)
    cfg = TrainConfig(UpdateShape(4, 1), updates=3, device="cpu")
    result = train(task, data.train[:16], cfg)
    assert result.model.training  # on_step_end's model.eval() did not reach the updates


def test_a_lightning_modules_class_names_in_another_order_are_named():
    """A LightningModule naming its classes (for its logged class metrics) in another order
    than the data's ids: 01's class-map check names it; the clean twin raises nothing."""
    from workbook import load_task
    from workbook.notebooks.inspection.data_audits import class_map_audit

    shifted = load_task("examples.lightning_docs:task", shifted_label_names=True)
    [flag] = class_map_audit(shifted, shifted.build_model())
    assert "LitClassifier.label_names numbers 'common' 2 where label_names numbers it 0" \
        in flag.message
    clean = load_task("examples.lightning_docs:task")
    assert class_map_audit(clean, clean.build_model()) == []
