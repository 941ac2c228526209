"""from_trainer on a reward model written as the TRL and PEFT docs write it
(examples/trl_reward.py: RewardTrainer over AutoModelForSequenceClassification(num_labels=1) on
the tiny pretrained Llama, LoRA with task_type="SEQ_CLS", chosen / rejected conversations): a
pair is one example of the "ranking" kind scored in one doubled forward, the loss is TRL's own,
the clean setup raises nothing and each planted bug is named by 01."""

import math

import pytest
import torch

from workbook.base.errors import WorkbookError
from workbook.contract.adapters.reward import RewardPair
from workbook.contract.data import collate_items, encode_examples, prepare
from workbook.notebooks.inspection import inspect_task

pytest.importorskip("trl")
pytest.importorskip("peft")

PAIRS = 40  # conversations: 3 pairs each, split 8 / 2 by conversation


def _task(**planted):
    from examples.trl_reward import make_task

    return make_task(PAIRS, **planted)


def _flags(**planted):
    return inspect_task(_task(**planted), probe_size=4).flags


def _named(check, **planted):
    flags = [f for f in _flags(**planted) if f.check == check]
    assert len(flags) == 1, [f.check for f in _flags(**planted)]
    return flags[0]


@pytest.fixture(scope="module")
def clean():
    return _task()


@pytest.fixture(scope="module")
def clean_items(clean):
    data = prepare(clean, limits={"train": 24, "validation": 8})
    return encode_examples(clean, data.raw["train"])


def test_a_pair_is_scored_in_one_forward_of_both_answers_with_trls_loss(clean, clean_items):
    from examples.trl_reward import make_trainer_factory

    assert clean.kind == "ranking" and clean.label_names == ["chosen", "rejected"]
    batch = collate_items(clean, clean_items[:3]).tensors
    assert batch["labels"].tolist() == [0, 0, 0]
    trainer = make_trainer_factory(PAIRS)()
    model, rows = RewardPair(trainer.model).eval(), []
    trainer.model.register_forward_hook(lambda m, a, kw, out: rows.append(
        len(kw["input_ids"])), with_kwargs=True)
    with torch.no_grad():
        scores = clean.forward(model, batch)
        loss, count = clean.loss(scores, batch)
        inputs = trainer.data_collator([{f"{a}_ids": it.tensors[f"{a}_input_ids"].tolist()
                                         for a in ("chosen", "rejected")}
                                        for it in clean_items[:3]])
        trl = trainer.compute_loss(trainer.model, inputs)
    assert scores.shape == (3, 2) and rows[0] == 6  # chosen and rejected: one forward of 2 x 3
    assert float(loss / count) == pytest.approx(float(trl), abs=1e-6)
    assert float(loss / count) == pytest.approx(math.log(2), abs=0.1)
    metrics = clean.metrics(scores, batch)
    assert set(metrics) == {"accuracy", "margin"} and metrics["accuracy"][1] == 3


def test_center_rewards_coefficient_is_trls_loss():
    import workbook as wb
    from examples.trl_reward import make_trainer_factory

    make = make_trainer_factory(PAIRS, lora=False)

    def centred():
        trainer = make()
        trainer.args.center_rewards_coefficient = 0.5
        return trainer

    task = wb.adapters.from_trainer(centred, name="x")
    items = encode_examples(task, prepare(task, limits={"train": 4, "validation": 2}).raw[
        "train"])
    batch = collate_items(task, items).tensors
    trainer = centred()
    with torch.no_grad():
        loss, count = task.loss(RewardPair(trainer.model).eval()(
            **{k: batch[k] for k in task.model_inputs}), batch)
        trl = trainer.compute_loss(trainer.model.eval(), trainer.data_collator(
            [{f"{a}_ids": it.tensors[f"{a}_input_ids"].tolist() for a in ("chosen", "rejected")}
             for it in items]))
    assert float(loss / count) == pytest.approx(float(trl), abs=1e-6)


@pytest.mark.twin
def test_the_clean_reward_model_raises_nothing_in_01(clean):
    ins = inspect_task(clean, probe_size=4)
    assert ins.flags == [] and ins.figures["num_outputs"] == 2


@pytest.mark.twin
@pytest.mark.parametrize("setup", [{"lora": False}, {"head": "saved"}, {"head_std": 5.0},
                                   {"no_pad_token": True}])
def test_a_full_fine_tune_a_saved_head_a_wider_head_and_eos_padding_raise_nothing(setup):
    ins = inspect_task(_task(**setup), probe_size=4)
    assert ins.flags == []
    if setup == {"lora": False}:  # no adapters: 01 states the fresh head's ln 2
        assert ins.figures["expected_initial_loss"] == pytest.approx(math.log(2), abs=1e-4)


@pytest.mark.planted
def test_pairs_that_prefer_an_answer_to_itself_are_named():
    flag = _named("pair without preference", same_answer=True)
    assert "rejected answer equal to the chosen one" in flag.message and flag.count == 32


@pytest.mark.planted
def test_pairs_identical_only_once_truncated_are_named_by_re_tokenizing():
    flag = _named("pair without preference", truncated=True)
    assert "re-tokenized without truncation" in flag.message and flag.count == 96


@pytest.mark.planted
def test_pairs_longer_than_max_length_are_counted_as_dropped():
    task = _task(long_answer=True)
    dropped, given, why = task.framework.rows_dropped["train"]
    assert dropped == 9 and given == 96 and "longer than max_length=64" in why
    assert "RewardTrainer drops such pairs" in _named("rows dropped before training",
                                                     long_answer=True).message


@pytest.mark.planted
def test_a_collator_padding_with_another_id_is_named_where_the_score_is_read():
    flag = _named("score read on padding", pad_with_eos=True)
    assert "config.pad_token_id=0" in flag.message and "pads with [5]" in flag.message
    assert "scored at a padding position" in flag.message


@pytest.mark.planted
def test_a_score_head_peft_froze_is_named_by_an_update():
    flag = _named("score head frozen", head="frozen")
    assert "task_type=None" in flag.message and "left the head as initialised" in flag.message
    assert "task_type='SEQ_CLS'" in flag.fix


@pytest.mark.planted
@pytest.mark.parametrize("lora", [True, False])
def test_a_head_started_large_is_named_by_the_first_loss(lora):
    flag = _named("first loss far from ln 2", head_std=20.0, lora=lora)
    assert "with the head zeroed the loss is 0.6931 (confirmed)" in flag.message


def test_the_pairs_handed_to_from_hf_are_refused_toward_from_trainer():
    import workbook as wb
    from examples.trl_reward import make_trainer_factory

    trainer = make_trainer_factory(PAIRS)()
    with pytest.raises(WorkbookError, match=r"tokenized pairs \(chosen_ids, rejected_ids") as e:
        wb.adapters.from_hf(lambda: trainer.model, trainer.train_dataset,
                            trainer.eval_dataset, trainer.data_collator,
                            trainer.processing_class, trainer.args, name="x")
    assert "from_trainer" in e.value.fix


def test_a_margin_column_is_refused_by_name():
    import workbook as wb
    from examples.trl_reward import make_trainer_factory

    make = make_trainer_factory(PAIRS)

    def with_margin():
        trainer = make()
        trainer.train_dataset = trainer.train_dataset.add_column(
            "margin", [1.0] * len(trainer.train_dataset))
        return trainer

    with pytest.raises(WorkbookError, match="'margin' column"):
        wb.adapters.from_trainer(with_margin, name="x")


@pytest.mark.slow  # the nine notebooks on the reward model, about 5 minutes on 2 cores
def test_the_reward_model_passes_the_nine_notebooks_in_smoke(tmp_path):
    import json

    from workbook.commands.pilot import run_pilot

    run, index = run_pilot("examples.trl_reward:task", out=str(tmp_path / "run"), smoke=True,
                           progress=False)
    assert index.verdict.tolist() == ["pass"] * 9, index.error.tolist()
    fit = json.loads((run / "02_overfit" / "summary.json").read_text())["figures"]
    assert fit["pair_accuracy"] == 1.0 and fit["mean_margin"] > 0


def test_the_memory_prediction_sizes_the_doubled_forward(clean, clean_items):
    from workbook.training.loop import UpdateShape
    from workbook.training.predict import Plan, predict

    shapes, build = [], clean.build_model

    def watched():
        model = build()
        model.scorer.register_forward_hook(lambda m, a, kw, out: shapes.append(
            tuple(kw["input_ids"].shape)), with_kwargs=True)
        return model

    clean.build_model = watched
    try:
        sized = predict(clean, clean_items[:8], clean_items[:4], Plan(UpdateShape(2, 1), 0))
    finally:
        clean.build_model = build
    assert "update (first)" in set(sized.phase) and shapes
    assert {s[0] for s in shapes} <= {4, 8} and 4 in {s[0] for s in shapes}  # 2 pairs: 4 rows


def test_a_task_factorys_refusal_keeps_its_problem_and_fix(monkeypatch):
    """A WorkbookError raised by a task function reaches the user as said, not as a repr with
    its line break escaped."""
    import types

    import workbook as wb

    def refusing():
        raise WorkbookError("the trainer's pairs carry a 'margin' column", "drop it")

    monkeypatch.setitem(__import__("sys").modules, "refusing_task",
                        types.SimpleNamespace(task=refusing))
    with pytest.raises(WorkbookError) as e:
        wb.load_task("refusing_task:task")
    assert e.value.fix == "drop it" and "\\n" not in str(e.value)
    assert "'margin' column" in e.value.problem


@pytest.mark.planted
def test_the_score_read_on_padding_is_named_in_bf16_too():
    """In half precision a row's score moves a little with its batch's shape anyway: the rows
    read on their last token give the batch's own noise floor."""
    from examples.trl_reward import make_trainer_factory
    from workbook.contract.adapters.reward import RewardAdapter
    from workbook.contract.adapters.trainer import TrainerAdapter

    for planted, named in (({}, False), ({"pad_with_eos": True}, True)):
        built = TrainerAdapter(make_trainer_factory(PAIRS, lora=False, **planted), name="x")
        adapter = RewardAdapter(built.trainer, built.fresh, built.evaluation(), name="x",
                                group_column=None)
        task = adapter.task()
        items = encode_examples(task, prepare(task, limits={"train": 24, "validation": 8}).raw[
            "train"])
        flags = adapter.score_position(built.trainer.model.to(torch.bfloat16), items)
        assert [f.check for f in flags] == (["score read on padding"] if named else [])
