"""from_trainer on an LLM fine-tune written as the TRL and PEFT docs write it
(examples/trl_sft.py: SFTTrainer with assistant_only_loss and a LoraConfig on a tiny Llama):
the clean setup raises nothing in 01-03, each planted bug is named by its cause, the trainer
factory's bad returns are refused, and the LoRA model is sized with its frozen base."""

import dataclasses

import pytest
import torch

import workbook as wb
from workbook.base.errors import WorkbookError
from workbook.contract import fine_tuning
from workbook.contract.data import collate_items, encode_examples, prepare
from workbook.notebooks.gates import GateRun
from workbook.notebooks.gates.settings import GateSettings
from workbook.notebooks.inspection import inspect_task
from workbook.notebooks.overfit import overfit
from workbook.training.loop import TrainConfig, UpdateShape
from workbook.training.predict import Plan, predict

pytest.importorskip("trl")
pytest.importorskip("peft")

CHATS = 60  # 48 train and 12 eval conversations, 3 assistant turns each


def _task(**planted):
    from examples.trl_sft import make_task

    return make_task(CHATS, **planted)


@pytest.fixture(scope="module")
def clean():
    return _task()


@pytest.fixture(scope="module")
def clean_items(clean):
    data = prepare(clean, limits={"train": 40, "validation": 12})
    return {s: encode_examples(clean, data.raw[s]) for s in ("train", "validation")}


def test_every_assistant_turn_is_a_target_and_no_system_or_user_token(clean, clean_items):
    item = clean_items["train"][0]
    prompt, labels = item.tensors["prompt_mask"], item.tensors["labels"]
    targets = labels != -100
    assert not (targets & prompt).any()
    # three assistant turns: three separate runs of targets, each ending on <eot>
    starts = int((targets[1:] & ~targets[:-1]).sum()) + int(targets[0])
    assert starts == 3
    eot = clean.decode_input([int(i) for i in item.tensors["input_ids"][targets]]).split()
    assert eot.count("<eot>") == 3
    assert inspect_task(clean).verdict == "pass"


def test_system_and_user_tokens_in_the_loss_are_named_by_01():
    flags = {f.check: f for f in inspect_task(_task(all_tokens_in_loss=True)).flags}
    assert any("prompt" in check for check in flags), sorted(flags)


def test_target_modules_that_match_nothing_are_named_by_01():
    flags = {f.check: f for f in inspect_task(_task(foreign_targets=True)).flags}
    assert set(flags) == {"adapter targets match no module"}
    flag = flags["adapter targets match no module"]
    assert "['query', 'value']" in flag.message and "q_proj" in flag.fix


def test_a_lora_fine_tune_starts_from_its_base_and_memorises_in_02(clean):
    res = overfit(clean, examples=4, updates=120, lr=3e-2)
    initial = res.checks.set_index("check").filter(like="initial", axis=0).iloc[0]
    assert "the base's own loss (adapters off)" in initial.name and initial.passed
    assert res.figures["initial_loss_rule"] == "the base's own loss (adapters off)"


def test_a_full_fine_tune_of_a_pretrained_base_is_not_judged_against_ln_outputs(clean_items,
                                                                                  tmp_path):
    task = _task(lora=False)
    assert task.pretrained and not fine_tuning.adapted(task.build_model())
    res = overfit(task, examples=4, updates=60, lr=1e-3)
    initial = res.checks.iloc[0]
    assert initial.passed and "pretrained base" in initial.detail
    report = GateRun(task, GateSettings(UpdateShape(2, 1), eval_batch=8, input_updates=1),
                     clean_items["train"], clean_items["validation"],
                     tmp_path).run(training_only=True)  # the row read: a training phase
    row = {r.phase: r for r in report.rows}["forward + loss"]
    assert row.verdict == "pass" and "not judged" in row.detail


def test_adapters_that_change_the_base_before_training_are_named_by_03(clean_items, tmp_path):
    task = _task(init_adapters=False)
    report = GateRun(task, GateSettings(UpdateShape(2, 1), eval_batch=8, input_updates=1),
                     clean_items["train"], clean_items["validation"],
                     tmp_path).run(training_only=True)  # the row read: a training phase
    row = {r.phase: r for r in report.rows}["forward + loss"]
    assert row.verdict == "fail" and "LoRA's B must start at zero" in row.detail, row.detail


def test_03_passes_the_clean_lora_fine_tune_and_says_why_a_waits(clean, clean_items, tmp_path):
    report = GateRun(clean, GateSettings(UpdateShape(2, 1), eval_batch=8, input_updates=1),
                     clean_items["train"], clean_items["validation"], tmp_path).run()
    rows = {r.phase: r for r in report.rows}
    assert all(r.verdict in ("pass", "warn") for r in report.rows), report.table()[
        ["phase", "verdict", "detail"]]
    first = rows["update (first)"].detail
    assert "14 LoRA A tensors wait for their B" in first, first
    assert "wait" not in rows["update (later)"].detail  # A is judged once B has moved


def test_a_lora_a_that_never_moves_is_still_named(clean, clean_items, tmp_path):
    def frozen_a():
        model = clean.build_model()
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.register_hook(lambda g: torch.zeros_like(g))
        return model
    task = dataclasses.replace(clean, build_model=frozen_a)
    report = GateRun(task, GateSettings(UpdateShape(2, 1), eval_batch=8, input_updates=1),
                     clean_items["train"], clean_items["validation"],
                     tmp_path).run(training_only=True)  # the row read: a training phase
    later = {r.phase: r for r in report.rows}["update (later)"]
    assert later.verdict == "fail" and "lora_A" in later.detail


def test_a_template_without_generation_markers_is_refused_in_trls_words():
    with pytest.raises(WorkbookError, match=r"building the trainer raised ValueError: .*"
                                            r"generation %\}. markers") as err:
        _task(no_generation_markers=True)
    assert "no notebook could run" in err.value.fix


def test_packed_conversations_are_checked_for_leakage_as_given_to_the_trainer():
    clean = _task(packing="bfd")  # packing drops the group column: checked before it
    assert clean.framework.groups_before_packing == {"column": "conversation", "crossing": [],
                                           "groups": {"train": 48, "validation": 12}}
    assert "leakage check ran on the rows given to the trainer" in " ".join(
        clean.framework.notes)
    leaky = _task(packing="bfd", eval_overlap=5)
    flags = {f.check: f for f in inspect_task(leaky, probe_size=4).flags}
    assert flags["group crosses splits"].count == 5  # (packed rows of copies: duplicates too)
    assert "before packing" in flags["group crosses splits"].message
    assert set(flags) <= {"group crosses splits", "duplicate input crosses splits"}


def test_a_group_column_the_given_rows_lack_is_refused():
    from examples.trl_sft import make_trainer_factory

    with pytest.raises(WorkbookError, match="given to the trainer has no 'dialogue' column"):
        wb.adapters.from_trainer(make_trainer_factory(CHATS, packing="bfd"), name="x",
                                 group_column="dialogue")
    with pytest.raises(WorkbookError, match="prepared train rows have no 'dialogue'"):
        wb.adapters.from_trainer(make_trainer_factory(CHATS), name="x",
                                 group_column="dialogue")


@pytest.mark.parametrize("factory, words", [
    (lambda: object(), "not a transformers Trainer"),
    ("make_trainer", "takes a function that builds the trainer"),
])
def test_a_factory_that_returns_something_else_is_refused(factory, words):
    with pytest.raises(WorkbookError, match=words):
        wb.adapters.from_trainer(factory, name="x")


def test_a_factory_that_trains_on_construction_is_refused():
    from examples.trl_sft import make_trainer_factory

    make = make_trainer_factory(CHATS)

    def trained():
        trainer = make()
        trainer.state.global_step = 3  # as after trainer.train() stopped at max_steps=3
        return trainer
    with pytest.raises(WorkbookError, match=r"has trained \(3 updates\)"):
        wb.adapters.from_trainer(trained, name="x")


def test_a_lora_model_is_sized_with_its_frozen_base(clean, clean_items):
    model = clean.build_model()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fine_tuning.adapted(model) and trainable < everything / 2  # a frozen base

    def whole():  # the same model fine-tuned whole: every parameter trains
        full = clean.build_model()
        for p in full.parameters():
            p.requires_grad_(True)
        return full
    import pandas as pd

    from workbook.training.fake_phases import fake_phases
    from workbook.training.workload import sized_batches

    plan = Plan(UpdateShape(2, 1), 64)
    train, val = clean_items["train"], clean_items["validation"]
    sized = {"lora": predict(clean, train, val, plan).set_index("phase").loc["update (first)"]}
    # the whole fine-tune's bytes by category, from the fake run `predict` reads them from
    # (its calibration against a real run, which only the LoRA model needs here, not made)
    full = dataclasses.replace(clean, build_model=whole)
    rows = fake_phases(full, TrainConfig(plan.shape, device="cpu"),
                       *sized_batches(full, train, val, plan), plan.label())
    sized["whole"] = pd.DataFrame(rows).set_index("phase").loc["update (first)"]
    lora = sized["lora"]
    assert lora.predicted_peak_bytes > 0  # predicted: the frozen base takes no hook
    assert lora.parameter_bytes == sized["whole"].parameter_bytes == everything
    assert lora.gradient_bytes == trainable  # the base holds no gradient
    # whole: every parameter the forward uses (modules_to_save leaves the head's original idle)
    assert sized["whole"].gradient_bytes > 2 * trainable
    # the optimizer's state at its peak - two Adam moments and the step's temporaries - of the
    # trainable tensors only: two moments of them, far below the whole model's
    assert 2 * trainable <= lora.optstate_bytes < 0.6 * sized["whole"].optstate_bytes


def test_checkpoints_hold_the_adapters_as_the_trainer_writes_them(clean, clean_items, tmp_path):
    from workbook.training.loop import train

    cfg = TrainConfig(UpdateShape(2, 1), updates=2, lr=1e-2)
    done = train(clean, clean_items["train"], cfg)
    objects = {"model": done.model}
    clean.save_state(tmp_path, objects)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert "model.safetensors" not in files  # the base is rebuilt from its own weights
    base = sum(p.numel() * p.element_size() for p in done.model.parameters()
               if not p.requires_grad)
    assert (tmp_path / "adapter_model.safetensors").stat().st_size < base
    fresh = clean.build_model()
    clean.restore_state(tmp_path, {"model": fresh})
    for (name, a), b in zip(done.model.state_dict().items(), fresh.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_a_copy_of_the_model_runs_its_own_modules(clean):
    # TRL patches the base's forward with a closure over the original model: a deepcopy (09
    # copies the model it shards) would still run the original's modules
    import copy

    model = copy.deepcopy(clean.build_model())
    calls = []
    model.base_model.model.model.layers[0].mlp.register_forward_hook(
        lambda *_: calls.append(1))
    model(input_ids=torch.tensor([[5, 6, 7]]))
    assert calls == [1]
    assert "_fused_forward of trl/trainer/utils.py" in clean.framework.notes[0]


def test_building_the_model_again_says_nothing_new(clean, capfd):
    # a notebook builds the model many times: TRL's deprecation warnings and the progress
    # bars of its preparation and weight loading were shown once, when the task was made
    import warnings

    import datasets

    datasets.enable_progress_bars()  # examples/accelerate_no_trainer.py turns them off for good
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        clean.build_model()
    _, err = capfd.readouterr()
    assert not [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert "Tokenizing" not in err and "Loading weights" not in err
    assert datasets.is_progress_bar_enabled()  # the user's setting given back


def test_building_the_model_leaves_the_pilots_random_streams_alone(clean):
    # the Trainer calls set_seed(args.seed) when it is built: the pilot's streams are kept
    import random

    import numpy as np

    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    clean.build_model()
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == expected


def test_the_archive_holds_the_adapters_and_reloads_them_onto_the_base(clean_items, tmp_path):
    import pandas as pd

    from workbook.notebooks.resume.archive import reload_archive, write_archive
    from workbook.training.loop import train

    task = _task()
    done = train(task, clean_items["train"], TrainConfig(UpdateShape(2, 1), updates=3, lr=1e-2))
    path = write_archive(tmp_path / "archive", "examples.trl_sft:task", {"count": CHATS},
                         done.model, {}, pd.DataFrame(), ["trained 3 updates"])
    files = {p.name for p in path.iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    reloaded = reload_archive(path, "examples.trl_sft:task", {"count": CHATS})
    assert reloaded["identical"] and reloaded["max_abs_diff"] == 0.0


def test_from_hf_takes_a_factory_that_loads_weights_and_sizes_it(clean_items):
    # from_pretrained refuses the meta device: the probe and the prediction build it for
    # real on the CPU and keep its shapes
    from transformers import AutoModelForCausalLM

    from examples.trl_sft import BASE, make_trainer_factory

    trainer = make_trainer_factory(CHATS, lora=False)()
    task = wb.adapters.from_hf(lambda: AutoModelForCausalLM.from_pretrained(BASE),
                               trainer.train_dataset, trainer.eval_dataset,
                               trainer.data_collator, trainer.processing_class, trainer.args,
                               name="loaded", group_column="conversation")
    assert task.pretrained and task.max_length == 64
    sized = predict(task, clean_items["train"], clean_items["validation"],
                    Plan(UpdateShape(2, 1), 64))
    assert sized.predicted_peak_bytes.notna().any()


def _accounting(loss):
    from workbook.commands import params
    from workbook.notebooks import accounting

    p = params.of("04_batch_accounting", small=True, task="examples.trl_sft:task",
                  task_options={"count": CHATS, "loss": loss})
    return accounting.run(p)


def test_a_compute_loss_that_ignores_num_items_in_batch_is_named_by_04():
    result = _accounting("mean")
    assert len(result.findings) == 1
    finding = result.findings[0]
    assert "OwnLossTrainer.compute_loss ignores num_items_in_batch" in finding
    assert "transformers#37766" in finding and "does not divide it by the accumulation" in finding
    assert result.step_loss.agree.all()  # one micro-batch: the same loss as the model's


def test_a_compute_loss_that_divides_by_num_items_in_batch_passes_04():
    result = _accounting("summed")
    assert result.findings == [] and result.warnings == []
    own = result.check[result.check.normalisation == "the task's train_step"]
    assert len(own) == 6 and own.within_tolerance.all()
    assert "OwnLossTrainer.compute_loss" in " ".join(result.task.framework.notes)


def test_rows_trl_drops_at_truncation_are_counted_by_01(clean):
    assert clean.framework.rows_dropped == {}
    task = _task(long_system=40)  # every fourth chat's system prompt fills max_length=64
    assert {s: d[:2] for s, d in task.framework.rows_dropped.items()} == {"train": (12, 48),
                                                               "validation": (3, 12)}
    flags = [f for f in inspect_task(task, probe_size=4).flags
             if f.check == "rows dropped before training"]
    assert len(flags) == 1 and flags[0].count == 15
    assert "12 of 48 train rows and 3 of 12 validation rows" in flags[0].message
    assert "max_length=64" in flags[0].message and "silently" in flags[0].message


def test_truncation_that_leaves_no_row_is_refused():
    with pytest.raises(WorkbookError, match="dropped every one of the 48 train rows.*"
                       "max_length=4"):
        _task(max_length=4)


def test_an_added_token_whose_row_stays_frozen_is_named_by_01():
    task = _task(new_role_token="frozen")  # "<bot>" added, embeddings resized, LoRA on top
    flags = [f for f in inspect_task(task, probe_size=4).flags
             if f.check == "added tokens not trained"]
    assert len(flags) == 1 and flags[0].count == 48
    assert "'<bot>' (id 911), appears in 48 of 48 examples" in flags[0].message
    assert "rows of the input embedding (`embed_tokens`): each row is the mean" in \
        flags[0].message
    assert "output head" not in flags[0].message  # lm_head trains whole (modules_to_save)
    assert "trainable_token_indices" in flags[0].fix


def test_an_added_token_whose_row_trains_raises_nothing():
    task = _task(new_role_token="trained")  # trainable_token_indices on "<bot>"
    model = task.build_model()
    assert list(fine_tuning.new_token_ids(model)) == [911]
    assert fine_tuning.untrained_rows(model, {911}, {911}) == []
    assert inspect_task(task, probe_size=4).flags == []


def _packed(strategy):
    from examples.trl_sft import make_trainer_factory

    return wb.adapters.from_trainer(make_trainer_factory(CHATS, packing=strategy),
                                    name="trl-sft-packed")


def test_packing_with_per_document_positions_raises_nothing():
    task = _packed("bfd")  # TRL's padding-free collator: one flat row, positions per document
    items = encode_examples(task, prepare(task, limits={"train": 6}).raw["train"])
    batch = collate_items(task, items[:3]).tensors  # one row per packed example, padded
    assert batch["input_ids"].shape[0] == 3 and "cu_seq_lens_q" not in batch
    assert inspect_task(task, probe_size=4).flags == []


def test_packing_that_joins_documents_without_boundaries_is_named_by_01():
    flags = inspect_task(_packed(True), probe_size=4).flags  # "wrapped"
    assert [f.check for f in flags] == ["cross-document attention"]
    assert "packing_strategy='wrapped'" in flags[0].message and "bfd" in flags[0].fix


def test_an_attention_that_ignores_per_document_positions_is_named_by_01():
    from workbook.notebooks.inspection.coverage import packing_audit

    task = _packed("bfd")
    model = task.build_model().eval()
    forward = model.forward
    model.forward = lambda *a, position_ids=None, **k: forward(*a, **k)  # positions dropped
    items = encode_examples(task, prepare(task, limits={"train": 4}).raw["train"])
    flags = packing_audit(task, model, items)
    assert [f.check for f in flags] == ["cross-document attention"]
    assert "ignores the position_ids" in flags[0].message


def test_activation_checkpointing_leaves_a_lora_models_gradients_as_they_were(clean,
                                                                               clean_items):
    """05's checkpointing variant on a PEFT model: the frozen embedding's output needs no
    gradient, and reentrant checkpointing would then train no adapter inside the blocks - the
    pilot checkpoints as transformers does (non-reentrant, input gradients on): the same
    gradient for every trainable tensor."""
    from workbook.training.loop import apply_activation_checkpointing

    batch = collate_items(clean, clean_items["train"][:4]).tensors
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = clean.build_model().eval()
        if checkpointing:
            assert apply_activation_checkpointing(clean, model) > 0
        summed, count = clean.loss(clean.forward(model, batch), batch)
        (summed / count).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert all(g is not None for g in grads[1].values())  # every adapter inside the blocks
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-4, atol=1e-6), name
