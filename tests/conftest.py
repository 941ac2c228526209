"""Shared fixtures: the two sample tasks, their splits and encoded items (built once)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from workbook import load_task
from workbook.base.progress import HEADLESS_ENV
from workbook.contract.data import SPLITS, prepare

torch.set_num_threads(1)
os.environ.setdefault(HEADLESS_ENV, "1")  # kernels started by the tests (nbval) show no widgets

# Run folders: the committed notebooks nbval runs, and any pilot a test starts without --out,
# write under a folder of this test process (removed when it ends), not the checkout's runs/,
# which holds the user's own runs (before, every `make test` left nine folders there).
_RUNS: list[str] = []


def pytest_configure(config):
    if "WORKBOOK_RUNS" not in os.environ:
        _RUNS.append(tempfile.mkdtemp(prefix="pilot-tests-"))
        os.environ["WORKBOOK_RUNS"] = str(Path(_RUNS[0]) / "runs")


def pytest_unconfigure(config):
    for folder in _RUNS:
        shutil.rmtree(folder, ignore_errors=True)


GENERATION = "workbook.samples.generation:task"
CLASSIFICATION = "workbook.samples.classification:task"

# The files that take longest (worker-seconds in `pytest --durations=0`, 2026-12-05), heaviest
# first. `make test` hands files to its two workers in the order the items come (--dist loadfile
# --no-loadscope-reorder): these first, then the others by their number of tests, most first
# (xdist's own order), so that the run ends on small files, never on one long file while the
# other worker waits. Only the order depends on this list: a file missing from it runs as well.
HEAVIEST_FIRST = (
    "notebooks/09_data_parallel.ipynb", "tests/blind/test_blind_cases_2.py",
    "tests/blind/test_blind_cases.py", "notebooks/05_memory_variants.ipynb",
    "tests/test_browser.py", "notebooks/08_rental_plan.ipynb",
    "notebooks/07_resume_reload.ipynb", "tests/training/test_predict.py",
    "tests/contract/test_trl_sft.py", "notebooks/06_lr_study.ipynb",
    "tests/training/test_campaign.py", "tests/commands/test_pilot_limits.py",
    "tests/notebooks/test_parallel.py", "tests/notebooks/test_accounting.py",
    "tests/training/test_sharding.py", "tests/blind/test_blind_cases_5.py",
    "tests/test_hostile.py", "tests/notebooks/test_fsdp.py",
    "tests/notebooks/test_resume_causes.py", "tests/commands/test_pilot.py",
    "tests/notebooks/test_rental.py", "tests/notebooks/test_inspection.py",
    "tests/notebooks/test_resume_pipeline.py", "tests/notebooks/test_gates.py",
    "tests/contract/test_own_code.py", "tests/contract/test_regression.py",
    "notebooks/03_phase_gates.ipynb", "tests/notebooks/test_variants.py",
    "tests/test_conventions.py", "tests/commands/test_export.py",
    "tests/blind/test_blind_cases_4.py", "tests/notebooks/test_resume_idioms.py",
    "tests/notebooks/test_study.py")


def pytest_collection_modifyitems(items):
    """Each file's items together, in the order above (see HEAVIEST_FIRST)."""
    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    counts: dict[str, int] = {}
    for item in items:
        counts[file_of(item)] = counts.get(file_of(item), 0) + 1
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: (rank.get(file_of(item), len(rank)), -counts[file_of(item)],
                                 file_of(item)))


@pytest.fixture(scope="session")
def gen_task():
    """The generation sample without its campaign model: the model trained is the one sized
    (a test of a campaign model plants its own)."""
    return load_task(GENERATION, campaign_layers=0)


@pytest.fixture(scope="session")
def cls_task():
    return load_task(CLASSIFICATION)


def _items(task):
    return prepare(task, SPLITS).items


@pytest.fixture(scope="session")
def gen_items(gen_task):
    return _items(gen_task)


@pytest.fixture(scope="session")
def cls_items(cls_task):
    return _items(cls_task)
