"""from_trainer on DPO written as the TRL and PEFT docs write it (examples/trl_dpo.py:
DPOTrainer with a LoraConfig on the tiny pretrained Llama, prompt / chosen / rejected
conversations): a pair is one example of the "preference" kind, the model the policy beside its
reference; the clean setup raises nothing, starts at ln 2 and memorises its pairs, each planted
bug is named, and the reference is sized as what it is."""

import math

import pytest
import torch

from workbook.base.errors import WorkbookError
from workbook.contract.adapters.preference import PreferencePair
from workbook.contract.data import collate_items, encode_examples, prepare
from workbook.notebooks.inspection import inspect_task
from workbook.notebooks.overfit import overfit
from workbook.training.loop import UpdateShape
from workbook.training.predict import Plan, predict

pytest.importorskip("trl")
pytest.importorskip("peft")

PAIRS = 40  # conversations: 3 pairs each, split 8 / 2 by conversation


def _task(**planted):
    from examples.trl_dpo import make_task

    return make_task(PAIRS, **planted)


@pytest.fixture(scope="module")
def clean():
    return _task()


@pytest.fixture(scope="module")
def clean_items(clean):
    data = prepare(clean, limits={"train": 24, "validation": 8})
    return {s: encode_examples(clean, data.raw[s]) for s in ("train", "validation")}


def test_a_pair_is_one_example_scored_by_its_two_answers(clean, clean_items):
    assert clean.kind == "preference" and clean.label_names == ["chosen", "rejected"]
    batch = collate_items(clean, clean_items["train"][:3]).tensors
    assert batch["labels"].tolist() == [0, 0, 0]
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape
    model = clean.build_model()
    assert isinstance(model, PreferencePair) and model.reference is None  # LoRA: the base
    with torch.no_grad():
        scores = clean.forward(model.eval(), batch)
    assert scores.shape == (3, 2)
    assert torch.allclose(scores, torch.zeros(3, 2), atol=1e-6)  # B = 0: policy = reference


def test_the_clean_pairs_raise_nothing_in_01(clean):
    ins = inspect_task(clean, probe_size=4)
    assert ins.flags == [] and ins.figures["num_outputs"] == 2


def test_dpo_starts_at_ln_2_and_memorises_its_pairs_in_02(clean):
    res = overfit(clean, examples=4, updates=150)
    assert res.figures["initial_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert res.figures["exact_examples"] == 4  # the chosen answer wins on every pair
    assert res.figures["final_loss"] < 0.1 and res.checks.passed.all()


def test_pairs_that_prefer_an_answer_to_itself_are_named_by_01():
    flags = [f for f in inspect_task(_task(same_answer=True), probe_size=4).flags
             if f.check == "pair without preference"]
    assert len(flags) == 1 and "rejected answer equal to the chosen one" in flags[0].message
    assert "ln 2" in flags[0].message and flags[0].count > 0


def test_pairs_truncation_makes_identical_are_named_by_01():
    flags = [f for f in inspect_task(_task(shared_opening=True), probe_size=4).flags
             if f.check == "pair without preference"]
    assert len(flags) == 1 and "differ only after max_length=64" in flags[0].message


def test_pairs_trl_drops_for_a_prompt_that_fills_max_length_are_counted():
    task = _task(long_prompt=True)
    assert task.framework.rows_dropped["train"][0] > 0
    assert "rows dropped before training" in {f.check for f in
                                              inspect_task(task, probe_size=4).flags}


def test_a_loss_the_pilot_does_not_compute_is_refused():
    import workbook as wb
    from examples.trl_dpo import make_trainer_factory

    make = make_trainer_factory(PAIRS)

    def ipo():
        trainer = make()
        trainer.loss_types = ["ipo"]
        return trainer

    with pytest.raises(WorkbookError, match=r"loss_type \['ipo'\] is not mapped"):
        wb.adapters.from_trainer(ipo, name="x")

    def weighted():
        trainer = make()
        trainer.ld_alpha = 0.5
        return trainer

    with pytest.raises(WorkbookError, match="ld_alpha is not mapped"):
        wb.adapters.from_trainer(weighted, name="x")


def test_the_reference_is_sized_as_weights_only(clean_items):
    full = _task(lora=False)  # a frozen copy of the base beside the trained one
    model = full.build_model()
    policy = sum(p.numel() * p.element_size() for p in model.policy.parameters())
    assert all(not p.requires_grad for p in model.reference.parameters())
    items = encode_examples(full, prepare(full, limits={"train": 8, "validation": 4}).raw[
        "train"])
    sized = predict(full, items, items[:4], Plan(UpdateShape(2, 1), 0), cpu_exact=True)
    first = sized.set_index("phase").loc["update (first)"]
    assert first.parameter_bytes == 2 * policy  # both copies' weights
    assert first.gradient_bytes == policy  # the policy's gradients only
