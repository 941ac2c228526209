import pytest
import torch

from workbook import TrainConfig, WorkbookError, load_task, train
from workbook.notebooks.accounting import (
    BatchAccount,
    batch_norm_statistics,
    normalisation_check,
    reconcile,
)
from workbook.samples.ghost_batch_norm import GhostBatchNorm
from workbook.training.loop import UpdateShape


def test_the_worked_example():
    account = BatchAccount(UpdateShape(2, 8, replicas=1), examples=3200)
    assert account.examples_per_update == 16
    assert account.updates_per_pass == 200 and account.partial_update() is None
    assert account.budget("epochs", 1)["updates"] == 200
    assert account.budget("updates", 200) == {
        "held": "updates", "updates": 200, "examples": 3200, "epochs": 1.0, "targets": 3200,
        "partial_updates": 0, "examples_per_update": 16}


def test_replicas_multiply_and_partial_batches_are_counted():
    account = BatchAccount(UpdateShape(2, 8, replicas=4), examples=3210)
    assert account.examples_per_update == 64
    assert account.full_updates_per_pass == 50 and account.leftover == 10
    assert account.updates_per_pass == 51
    assert account.partial_update() == {"examples": 10, "micro_batches_per_replica": 2,
                                        "last_micro_batch": 1}
    dropped = BatchAccount(UpdateShape(2, 8, replicas=4), examples=3210, drop_partial=True)
    assert dropped.updates_per_pass == 50 and dropped.examples_per_pass == 3200


def test_budgets_holding_each_quantity():
    account = BatchAccount(UpdateShape(2, 8, replicas=1),
                           examples=100)  # 6 full updates + 4 left over per pass
    assert account.budget("updates", 14)["examples"] == 200 + 0  # two passes exactly
    assert account.budget("updates", 14)["partial_updates"] == 2
    assert account.budget("examples", 50)["updates"] == 4
    by_epochs = account.budget("epochs", 2, targets_per_example=8.5)
    assert by_epochs["updates"] == 14 and by_epochs["targets"] == 1700


@pytest.mark.parametrize("kwargs, words", [
    ({"micro_batch": 0, "accumulation": 8}, r"field 'micro_batch' .* equal to 1 \(got 0\)"),
    ({"micro_batch": 2, "accumulation": -1}, r"field 'accumulation' .* equal to 1 \(got -1\)"),
])
def test_bad_shapes_are_refused(kwargs, words):
    with pytest.raises(WorkbookError, match=words):
        BatchAccount(UpdateShape(**kwargs))
    with pytest.raises(WorkbookError, match="cannot hold"):
        BatchAccount(UpdateShape(2, 2, replicas=1), examples=10).budget("seconds", 3)
    with pytest.raises(WorkbookError, match="needs 32 examples"):
        BatchAccount(UpdateShape(4, 8, replicas=1), examples=10,
                     drop_partial=True).budget("updates", 3)


@pytest.mark.parametrize("drop", [False, True])
def test_reconciliation_with_the_real_loop(cls_task, cls_items, drop):
    items = cls_items["train"][:45]  # 45 = 2 x 16 + 13: a partial update per pass
    cfg = TrainConfig(UpdateShape(4, 4), updates=7, drop_partial=drop, device="cpu")
    steps = train(cls_task, items, cfg).steps
    table = reconcile(BatchAccount(UpdateShape(4, 4, replicas=1), examples=len(items),
                                   drop_partial=drop), steps, items)
    assert table.match.all(), table
    assert table.set_index("counter").loc["partial updates", "loop"] == (0 if drop else 2)


def test_reconciliation_catches_a_miscount(cls_task, cls_items):
    items = cls_items["train"][:45]
    steps = train(cls_task, items, TrainConfig(UpdateShape(4, 4), updates=3, device="cpu")).steps
    steps[1].examples -= 1  # a loop that miscounts one example
    assert not reconcile(BatchAccount(UpdateShape(4, 4, replicas=1), examples=45), steps,
                         items).match.all()


def test_normalisation_check_passes_for_the_loop_and_fails_for_the_planted_bug(gen_task,
                                                                               gen_items):
    items = gen_items["train"][:13]  # different lengths and a final partial micro-batch
    table = normalisation_check(gen_task, items, splits=(13, 2, 1, 4))
    loop = table[~table.normalisation.str.contains("wrong")]
    wrong = table[table.normalisation.str.contains("wrong")]
    assert loop.within_tolerance.all()
    assert set(loop.last_micro_batch) == {13, 1}
    assert not wrong.iloc[1:].within_tolerance.any()


def test_ghost_batch_norm_equals_batch_norm_when_sizes_match():
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    ghost, plain = GhostBatchNorm(3, 8), torch.nn.BatchNorm1d(3)
    torch.testing.assert_close(ghost(x), plain(x))
    torch.testing.assert_close(ghost.running_mean, plain.running_mean)
    ghost.eval()
    plain.eval()
    torch.testing.assert_close(ghost(x), plain(x))


def test_ghost_batch_norm_against_a_reference_by_hand():
    torch.manual_seed(0)
    x = torch.randn(10, 2) * 3 + 1
    ghost = GhostBatchNorm(2, 4, affine=False, momentum=0.5)
    assert ghost.chunk_sizes(10) == [4, 4, 2] and ghost.chunk_sizes(9) == [4, 5]
    out = ghost(x)
    expected, running = [], torch.zeros(2)
    for chunk in x.split([4, 4, 2]):
        mean, var = chunk.mean(0), chunk.var(0, unbiased=False)
        expected.append((chunk - mean) / torch.sqrt(var + ghost.eps))
        running = 0.5 * running + 0.5 * mean
    torch.testing.assert_close(out, torch.cat(expected))
    torch.testing.assert_close(ghost.running_mean, running)
    small = GhostBatchNorm(2, 8, affine=False)(x[:3])  # smaller: one chunk of what there is
    torch.testing.assert_close(small, (x[:3] - x[:3].mean(0)) /
                               torch.sqrt(x[:3].var(0, unbiased=False) + 1e-5))
    with pytest.raises(ValueError, match="at least 2"):
        GhostBatchNorm(2, 1)


def test_batch_norm_sees_the_micro_batch_not_the_effective_batch(cls_items):
    for norm, per_stat in (("batch", 4), ("ghost", 2)):
        task = load_task("workbook.samples.classification:task", batch_norm=norm,
                         virtual_batch=2)
        table = batch_norm_statistics(task, cls_items["train"], UpdateShape(4, 4))
        assert len(table) == 4, "one pass per micro-batch"
        assert set(table.values_per_statistic) == {per_stat}
        assert set(table.effective_batch) == {16}
    plain = load_task("workbook.samples.classification:task")
    assert batch_norm_statistics(plain, cls_items["train"], UpdateShape(4, 4)).empty


def test_a_gradient_zero_in_exact_arithmetic_cannot_fail_but_a_planted_mean_still_does():
    """BERT's attention key bias: softmax ignores a per-query constant, so its gradient is
    rounding noise (about 1e-13); relative to itself that read as 0.5-0.85 on a clean task.
    Judged on the whole update's gradient scale the loop is exact, and a per-micro-batch mean
    over unequal micro-batches (6 + 6 + 4) still fails."""
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from workbook.contract.data import SPLITS, prepare

    task = load_task("examples.hf_families:bert")
    items = prepare(task, SPLITS).items["train"][:16]
    check = normalisation_check(task, items, splits=(16, 2, 1, 6))
    loop = check[check.normalisation.str.endswith("(loop)")]
    wrong = check[check.normalisation.str.endswith("(wrong)")]
    assert loop.within_tolerance.all() and loop.max_relative_deviation.max() < 1e-5
    assert not wrong.within_tolerance.iloc[-1] and wrong.max_relative_deviation.iloc[-1] > 1e-2


def test_deviations_are_judged_on_the_whole_sets_scale_and_empty_shards_are_equal():
    from workbook.training.deviation import max_difference, relative_deviation

    reference = {"weight": torch.tensor([1.0, -2.0]), "key_bias": torch.tensor([1e-13]),
                 "empty_shard": torch.empty(0)}
    noisy = {"weight": torch.tensor([1.0, -2.0]), "key_bias": torch.tensor([-3e-13]),
             "empty_shard": torch.empty(0)}
    assert relative_deviation(noisy, reference) < 1e-12
    doubled = {k: 2 * v for k, v in reference.items()}
    assert relative_deviation(doubled, reference) == pytest.approx(1.0)
    assert max_difference({"empty_shard": torch.empty(0)}, {"empty_shard": torch.empty(0)}) == 0
    assert relative_deviation({}, {}) == 0


def _notebook_04(tmp_path, task, **options):
    from workbook.commands import params
    from workbook.notebooks import accounting as acc

    p = params.of("04_batch_accounting", small=True, task=task, task_options=options)
    tmp_path.mkdir()
    result = acc.run(p, tmp_path)
    return acc.save(result, tmp_path), result


MIXING = "tests.mixing_task:task"  # torchvision's references/classification idiom


def test_mixup_cutmix_in_the_collate_is_held_fixed_and_named_as_the_campaigns_randomness(
        tmp_path):
    """The collate draws a new mixing weight per batch: 04 measured it (the same examples
    collated twice, under the same seed and another), compared every split on one draw and
    names the mixing - the loss and the normalisation are not blamed."""
    verdict, result = _notebook_04(tmp_path / "collate", MIXING, mixing="collate")
    assert verdict == "pass" and result.findings == []
    said = result.warnings[0]
    assert said.startswith("your collate draws new random numbers for every batch it collates")
    assert "not at all under the same seed" in said and "mixup/cutmix" in said
    assert "not a normalisation error" in said
    assert "attention mask" not in " ".join(result.warnings)
    assert result.step_loss.agree.all() and result.reconciled.match.all()


def test_mixup_cutmix_inside_the_step_is_named_as_the_data_differing_not_as_another_loss(
        tmp_path):
    verdict, result = _notebook_04(tmp_path / "step", MIXING, mixing="step")
    assert verdict == "pass" and result.findings == []
    said = result.warnings[0]
    assert said.startswith("your train_step draws new random numbers on every call")
    assert "the model received other inputs than the collated batch's" in said
    assert "mixup/cutmix" in said and "the data differed" in said


def test_the_clean_twin_without_mixing_passes_and_a_mixing_weight_no_seed_reaches_is_said(
        tmp_path):
    assert _notebook_04(tmp_path / "off", MIXING, mixing="")[1].warnings == []
    verdict, result = _notebook_04(tmp_path / "own", MIXING, mixing="collate", unseeded=True)
    assert verdict == "pass" and result.findings == []
    assert "under the same seed too: it draws from a source no seed here reaches" in \
        result.warnings[0]


def test_the_planted_normalisation_and_dropped_mask_are_still_named_beside_the_mixing(tmp_path):
    verdict, result = _notebook_04(tmp_path / "mean", MIXING, mixing="collate",
                                   mean_per_micro_batch=True)
    assert verdict == "fail" and result.draws[0].where == "collate"
    assert "the loss is not divided by the number of micro-batches" in result.findings[0]
    assert "(2 x 4: 4 times, 1 x 8: 8 times)" in result.findings[0]
    verdict, result = _notebook_04(tmp_path / "mask", "examples.encoder_lm:task",
                                   step_drops_mask=True)
    assert verdict == "fail" and result.draws == []  # the step's dropout is held: no draw
    assert "e.g. it drops the attention mask" in result.findings[0]
