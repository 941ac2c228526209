"""Shared fixtures: the two sample tasks, their splits and encoded items (built once)."""

import os

import pytest
import torch

from workbook import load_task
from workbook.base.progress import HEADLESS_ENV
from workbook.contract.data import SPLITS, prepare

torch.set_num_threads(1)
os.environ.setdefault(HEADLESS_ENV, "1")  # kernels started by the tests (nbval) show no widgets

GENERATION = "workbook.samples.generation:task"
CLASSIFICATION = "workbook.samples.classification:task"


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
