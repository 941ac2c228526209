"""Two pipelines in the idioms of public reports, each a clean twin that 07 and 09 pass and a
planted bug they name: a torch IterableDataset sharded by get_worker_info() under torchdata's
StatefulDataLoader(num_workers=2) (examples/worker_shards.py: an __iter__ that drops the
loaded position), and a datasets stream split by split_dataset_by_node and resumed by its own
state_dict (examples/hf_node_split.py: a resume that skips the steps done from a pass's
start, huggingface/transformers#26413)."""

import numpy as np
import pytest

from workbook import load_task
from workbook.notebooks import resume
from workbook.notebooks.parallel.pipeline import pipeline_rules
from workbook.notebooks.resume.position import pass_orders, stated_length, where_from
from workbook.training.loop import TrainConfig, UpdateShape

LIMIT, MID, UPDATES = 32, 5, 7


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "stream.bin"
    np.array(np.arange(20_000) % 251, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.fixture
def pipelines(data_file, tmp_path, monkeypatch):
    from examples import hf_stream

    monkeypatch.setattr(hf_stream, "CACHE_DIR", tmp_path / "cache")
    return {
        "examples.worker_shards:task": ({"data_file": data_file, "block_size": 16,
                                         "n_layer": 1, "n_embd": 32}, "reset_in_iter",
                                        "the pass restarted from its beginning on restore"),
        "examples.hf_node_split:task": ({"rows": 600, "shards": 3, "layers": 1, "width": 32},
                                        "skip_steps", "the resume skipped by a length the "
                                        "stream does not have"),
    }


def said_07(tmp_path, name, options):
    cfg = TrainConfig(UpdateShape(micro_batch=2, accumulation=4), lr=1e-3, seed=0, device="cpu")
    cfg.pipeline = True
    recipe = resume.recipe(name, options, cfg, LIMIT)
    reference, weights = resume.run_recipe(recipe, UPDATES, tmp_path, checkpoint_at=(MID,))
    resumed, w = resume.run_recipe(recipe, UPDATES, start_from=tmp_path / "ckpt-000005")
    task, items, cfg = resume.rebuild(recipe)
    return (resume.compare(reference, resumed, weights, w)[1]["exact"],
            where_from(reference, resumed, MID, pass_orders(task, items, cfg, LIMIT), 2,
                       length=stated_length(task, cfg)))


@pytest.mark.parametrize("name", ["examples.worker_shards:task", "examples.hf_node_split:task"])
def test_the_clean_twin_passes_07_and_09_and_the_planted_bug_is_named_by_both(
        tmp_path, pipelines, name):
    options, bug, words = pipelines[name]
    assert said_07(tmp_path / "clean", name, options) == (True, "")
    exact, said = said_07(tmp_path / "bug", name, {**options, "pipeline_bug": bug})
    assert not exact and words in said, said
    clean = pipeline_rules(load_task(name, **options), 2, 0, 2, 16)
    assert {r["verdict"] for r in clean} == {"pass"}, clean
    row = pipeline_rules(load_task(name, **options, pipeline_bug=bug), 2, 0, 2, 16)[1]
    assert row["verdict"] == "fail" and words in row["remediation"], row
