"""from_trainer builds the user's trainer once per process: a fresh model is a copy of the
model that build made (PEFT adapters, DPO's policy beside its reference), the same tensors a
trainer built anew would hold - never a second build with its datasets prepared again."""

import os

import pytest
import torch

from workbook.contract.adapters.preference import PreferencePair
from workbook.contract.adapters.trainer import TrainerAdapter
from workbook.notebooks.inspection import inspect_task

pytest.importorskip("trl")
pytest.importorskip("peft")


def _same(fresh: torch.nn.Module, rebuilt: torch.nn.Module) -> None:
    ours, theirs = fresh.state_dict(), rebuilt.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [p.requires_grad for p in fresh.parameters()] == \
        [p.requires_grad for p in rebuilt.parameters()]


def test_a_fresh_lora_model_is_the_model_a_rebuilt_trainer_holds():
    from examples.trl_sft import make_trainer_factory

    make_trainer = make_trainer_factory(20)
    adapter = TrainerAdapter(make_trainer, name="sft", group_column="conversation")
    fresh = adapter.build_model()
    assert fresh is not adapter.trainer.model
    _same(fresh, make_trainer().model)
    next(fresh.parameters()).data.add_(1.0)  # a trained copy leaves the next one as built
    _same(adapter.build_model(), make_trainer().model)
    with torch.device("meta"):
        shapes = adapter.build_model()
    assert all(p.is_meta for p in shapes.parameters())
    assert [p.shape for p in shapes.parameters()] == [p.shape for p in fresh.parameters()]


def test_a_fresh_dpo_pair_is_the_policy_and_reference_a_rebuilt_trainer_holds():
    from examples.trl_dpo import make_trainer_factory

    for lora in (True, False):  # the reference: the base with adapters off / a frozen copy
        make_trainer = make_trainer_factory(12, lora=lora)
        adapter = TrainerAdapter(make_trainer, name="dpo")
        rebuilt = make_trainer()
        _same(adapter.task().build_model(),
              PreferencePair(rebuilt.model, rebuilt.ref_model, float(rebuilt.beta)))


def test_01_builds_the_users_trainer_once_in_each_process(tmp_path):
    # the task loaded, its model probed and built, 01's scan forked over workers: one build
    import workbook as wb
    from examples.trl_sft import make_trainer_factory

    make_trainer, log = make_trainer_factory(20), tmp_path / "builds"

    def counted():
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return make_trainer()

    task = wb.adapters.from_trainer(counted, name="sft", group_column="conversation")
    assert inspect_task(task, workers=1).verdict == "pass"
    pids = log.read_text().split()
    assert len(pids) == len(set(pids)) == 1, pids
