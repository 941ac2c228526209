"""The user's own training DataLoader with random augmentation in its workers
(tests/augmented_task.py's pipeline, examples/image_folder.py's idiom): its workers' seeds are
drawn per pass from its generator, so 07's count-and-skip resume - which opens the resumed pass
first in a new process - augments as the uninterrupted run did; without the pilot seeding the
generator per pass it does not."""


from workbook import TrainConfig, UpdateShape
from workbook.contract import pipeline
from workbook.notebooks.resume import compare, recipe, run_recipe

TASK = "tests.augmented_task:make_pipeline_task"


def resumed_exactly(tmp_path) -> bool:
    cfg = TrainConfig(UpdateShape(2, 2), lr=3e-3, pipeline=True)
    spec = recipe(TASK, {}, cfg, train_limit=8)  # 2 updates a pass: the resume at 3 is in pass 1
    reference, weights = run_recipe(spec, 4, tmp_path, checkpoint_at=(3,))
    resumed, w = run_recipe(spec, 4, start_from=tmp_path / "ckpt-000003")
    return compare(reference, resumed, weights, w)[1]["exact"]


def test_a_worker_loaders_augmentation_is_a_function_of_the_pass(tmp_path):
    assert resumed_exactly(tmp_path)


def test_without_seeding_its_generator_per_pass_the_resume_augments_differently(
        tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "reseed_workers", lambda *args: None)
    assert not resumed_exactly(tmp_path)
