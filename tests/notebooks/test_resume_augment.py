"""Random augmentation in DataLoader workers (tests/augmented_task.py): the data is made equal
between an uninterrupted and a resumed run, between processes and between ranks, so 07 and 09
judge the resume and the loss - and a real resume or normalisation bug on the same augmented
task is still named. Where the data cannot be made equal it is said to differ."""

import pytest
import torch

from workbook import TrainConfig, UpdateShape, load_task
from workbook.contract.data import loader, prepare
from workbook.notebooks.parallel import rank_rules as parallel_rules
from workbook.notebooks.parallel.faults import planted_faults
from workbook.notebooks.parallel.launches import launch
from workbook.notebooks.resume import compare, recipe, run_recipe
from workbook.notebooks.resume.archive import control_items
from workbook.notebooks.resume.position import pass_orders, random_data, where_from
from workbook.training.replica import ReplicaSpec

AUGMENTED = "tests.augmented_task:task"


def workers_spec(workers=2, **options):
    cfg = TrainConfig(UpdateShape(2, 4), lr=3e-3, workers=workers)
    return recipe(AUGMENTED, options, cfg, train_limit=24)  # 3 updates per pass


@pytest.fixture(scope="module")
def augmented():
    task = load_task(AUGMENTED)
    return task, prepare(task, ("train",), {"train": 24}).train


def test_the_augmentation_is_random_and_said_so_only_when_it_is(augmented):
    task, items = augmented
    cfg = TrainConfig(UpdateShape(2, 4), workers=2)
    said = random_data(task, items, cfg)
    assert "the data differs between runs (random augmentation in its 2 DataLoader workers" \
        in said and "seed the workers" in said
    plain = load_task(AUGMENTED, augment=False)
    assert random_data(plain, prepare(plain, ("train",), {"train": 24}).train, cfg) == ""


def test_workers_augment_by_pass_and_example_not_by_worker(augmented):
    """The same micro-batch read by another worker, after others, gives the same tensors;
    another pass gives other ones (the augmentation is still random)."""
    task, items = augmented
    batches = [[0, 1], [2, 3], [4, 5]]
    whole = list(loader(task, items, batches, workers=2, seed=7))
    tail = list(loader(task, items, batches[1:], workers=2, seed=7))  # a mid-pass resume
    for a, b in zip(whole[1:], tail, strict=True):
        assert torch.equal(a.tensors["image"], b.tensors["image"])
    other_pass = list(loader(task, items, batches, workers=2, seed=8))
    assert not all(torch.equal(a.tensors["image"], b.tensors["image"])
                   for a, b in zip(whole, other_pass, strict=True))


def test_an_augmented_run_with_workers_resumes_exactly_and_a_real_bug_is_still_named(tmp_path):
    spec = workers_spec()
    reference, weights = run_recipe(spec, 6, tmp_path, checkpoint_at=(4,))
    resumed, w = run_recipe(spec, 6, start_from=tmp_path / "ckpt-000004")
    _, verdict = compare(reference, resumed, weights, w)
    assert verdict["exact"] and verdict["max_param_diff"] == 0, verdict
    task = load_task(AUGMENTED)
    order = pass_orders(task, prepare(task, ("train",), {"train": 24}).train,
                        TrainConfig.from_dict(spec["config"]))
    for fault in ("sampler", "optimizer"):  # with the data equal, the resume bug shows
        broken, w = run_recipe(spec, 6, start_from=tmp_path / "ckpt-000004", faults=(fault,))
        _, verdict = compare(reference, broken, weights, w)
        assert not verdict["exact"], fault
        said = where_from(reference, broken, 4, order, 2)
        assert ("the pass restarted from its beginning on restore" in said) == \
            (fault == "sampler"), said


def test_control_inputs_are_the_same_tensors_whatever_the_random_state():
    task = load_task(AUGMENTED)
    torch.manual_seed(1)
    first = control_items(task, 4)
    torch.manual_seed(2)
    state = torch.get_rng_state()
    second = control_items(task, 4)
    assert torch.equal(state, torch.get_rng_state()), "the caller's random state is kept"
    assert all(torch.equal(a.tensors["image"], b.tensors["image"])
               for a, b in zip(first, second, strict=True))


def test_09_says_the_data_differs_instead_of_failing_the_normalisation():
    check = {"case": "equal", "split": "1 x 8 + 1 x 8", "examples": 16, "all_reduces": 1,
             "max_relative_deviation": 3e-2, "identical_on_ranks": True,
             "targets_per_rank": [8, 8], "rank_mean_deviation": 0.0}
    checks = [dict(check), {**check, "case": "accumulation"}, {**check, "case": "partial"}]
    rows = parallel_rules._gradient_rows({"gradient_check": checks}, 1e-4)
    assert [r["verdict"] for r in rows[1:]] == ["fail"] * 3  # data equal: the loss is wrong
    assert "all-reduce the target count" in rows[1]["remediation"]
    for c in checks:
        c["data_differs_on_ranks"] = [1]
    rows = parallel_rules._gradient_rows({"gradient_check": checks}, 1e-4)
    assert [r["verdict"] for r in rows[1:]] == ["not applicable"] * 3
    assert rows[1]["measured"].startswith("the data differs between runs: rank(s) [1]")
    assert "seed the per-example randomness" in rows[1]["remediation"]


@pytest.mark.slow  # two launches (50 s): the rule logic is tested above without one
def test_09_on_augmented_data_passes_its_normalisation_rules_and_names_a_rank_mean(tmp_path):
    task = load_task(AUGMENTED)
    items = prepare(task, ("train",), {"train": 32}).train
    spec = ReplicaSpec(AUGMENTED, {}, UpdateShape(2, 2, replicas=2), updates=2, train_limit=32,
                       validation_limit=8, eval_batch=4, check_examples=16)
    result = launch(spec, tmp_path / "run")
    table = parallel_rules.rules(result, items, task=task).set_index("rule")
    for rule in parallel_rules.GRADIENT_RULES.values():
        assert table.verdict[rule] == "pass", table.measured[rule]
    assert all(not c["data_differs_on_ranks"] for c in result["gradient_check"])
    assert table.verdict["evaluation reduced as sums over ranks"] == "pass"
    planted = planted_faults(spec, items, tmp_path, result, ("rank_mean_loss",), task)
    assert planted.caught.tolist() == [True], planted.measured.tolist()
