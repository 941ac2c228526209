import dataclasses

import torch

from workbook.overfit import overfit
from workbook.samples.models import TinyDecoder


def test_generation_sample_memorises_its_subset(gen_task):
    res = overfit(gen_task, examples=4, updates=80)
    assert res.verdict == "pass", res.checks
    assert res.reproduction.greedy_exact.all() and res.figures["exact_examples"] == 4


def test_classification_sample_memorises_its_subset(cls_task):
    res = overfit(cls_task, examples=8, updates=60)
    assert res.verdict == "pass", res.checks
    assert (res.reproduction.target == res.reproduction.predicted).all()


def _failed(res):
    return set(res.checks.loc[~res.checks.passed, "check"])


def test_badly_scaled_initialisation_is_flagged(gen_task):
    def loud_model():
        model = TinyDecoder(259)
        with torch.no_grad():
            model.head.weight.mul_(200)
        return model
    res = overfit(dataclasses.replace(gen_task, build_model=loud_model), examples=4, updates=5)
    assert "initial loss near ln(outputs)" in _failed(res) and res.verdict == "fail"


def test_non_finite_loss_is_flagged(cls_task):
    def nan_loss(logits, batch):
        loss, n = cls_task.loss(logits, batch)
        return loss * float("nan"), n
    res = overfit(dataclasses.replace(cls_task, loss=nan_loss), examples=4, updates=3)
    assert "loss finite at every step" in _failed(res)


def test_a_loop_that_cannot_learn_fails(gen_task):
    frozen = dataclasses.replace(gen_task, build_optimizer=lambda model, lr: torch.optim.SGD(
        model.parameters(), lr=0.0))
    res = overfit(frozen, examples=4, updates=5)
    assert {"final loss below threshold", "exact target ids reproduced"} <= _failed(res)
