"""Notebook 07 names resume bugs from public reports as themselves (examples/token_stream.py's
planted pipelines, each beside its clean twin): an epoch guard as users write it, caught by a
restore in a training loop's order; a state that stops advancing after load_state_dict (a
second resume restarts the stream); a pass that repeats the previous one because the pipeline
moves on only when a pass runs to its end."""

import dataclasses

import numpy as np
import pytest

from workbook.notebooks import resume
from workbook.notebooks.resume.position import pass_orders, repeated_pass, stated_length, where_from

from .test_resume_pipeline import LIMIT, MID, UPDATES, resumes, spec


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "stream.bin"
    np.array(np.arange(20_000) % 251, dtype=np.uint16).tofile(path)
    return str(path)


def loop_order_resume(tmp_path, recipe):
    reference, weights = resume.run_recipe(recipe, UPDATES, tmp_path, checkpoint_at=(MID,))
    resumed, w = resume.run_recipe(recipe, UPDATES, start_from=tmp_path / "ckpt-000005",
                                   loop_order=True)
    task, items, cfg = resume.rebuild(recipe)
    return (resume.compare(reference, resumed, weights, w)[1]["exact"],
            where_from(reference, resumed, MID, pass_orders(task, items, cfg, LIMIT), 2))


def test_an_epoch_guard_as_users_write_it_fails_the_loop_order_only(tmp_path, data_file):
    bug = spec(data_file, "guard_as_written")
    assert resumes(tmp_path / "07-order", bug)["exact"] == [True, True]  # set_epoch, then load
    exact, said = loop_order_resume(tmp_path / "loop", bug)
    assert not exact and "the pass restarted from its beginning on restore (an epoch guard" \
        in said
    assert loop_order_resume(tmp_path / "clean", spec(data_file)) == (True, "")


def test_a_state_that_stops_advancing_after_a_load_is_named_on_the_second_resume(
        tmp_path, data_file):
    got = resumes(tmp_path, spec(data_file, "restart_after_load"))
    assert got["mid"] == "" and got["exact"] == [True, False]
    assert "the pipeline's state did not advance after load_state_dict (the first resume " \
        "was exact" in got["twice"] and "second resume restarts the stream" in got["twice"]


def test_a_pass_that_repeats_the_previous_one_is_named_and_the_clean_twin_is_not(
        tmp_path, data_file):
    def said(bug, folder):
        recipe = spec(data_file, bug)
        reference, _ = resume.run_recipe(recipe, UPDATES, folder)
        task, items, cfg = resume.rebuild(recipe)
        return repeated_pass(reference, pass_orders(task, items, cfg, LIMIT))

    got = said("commit_at_end", tmp_path / "bug")
    assert "pass 1 repeated pass 0" in got and "commits its epoch only when a pass runs to " \
        "its end, so a loop that breaks early" in got
    assert said("", tmp_path / "clean") == ""


@pytest.mark.parametrize("bug, stated", [
    ("skip_by_length", "divided by the pipeline's len() of {length};"),
    ("skip_without_length", "skipped from a pass's start (a stream without a usable __len__"),
])
def test_a_skip_by_a_length_the_stream_does_not_have_is_named_as_itself(
        tmp_path, data_file, bug, stated):
    """huggingface/transformers#26413: the steps done, skipped by len() (a shard count) or
    from a pass's start (no len): the resume lands elsewhere, in either restore order."""
    recipe = spec(data_file, bug)
    reference, _ = resume.run_recipe(recipe, UPDATES, tmp_path, checkpoint_at=(MID,))
    task, items, cfg = resume.rebuild(recipe)
    order, length = pass_orders(task, items, cfg, LIMIT), stated_length(task, cfg)
    for loop_order in (False, True):
        resumed, _ = resume.run_recipe(recipe, UPDATES, start_from=tmp_path / "ckpt-000005",
                                       loop_order=loop_order)
        said = where_from(reference, resumed, MID, order, 2, length=length)
        assert f"the resumed run read from example 40 of pass {int(loop_order)}, the " \
            "uninterrupted run from example 8 of pass 1: the resume skipped by a length the " \
            "stream does not have (40 examples read in all" in said, said
        assert stated.format(length=length) in said and (length is None) == ("without" in bug)
        assert "skip by the examples read in the pass (the checkpoint's position), or give " \
            "the stream a state_dict that holds its position" in said


@pytest.mark.parametrize("bug, fix", [
    ("", ""),
    ("commit_at_end", "the pipeline commits its epoch only when a pass runs to its end"),
    ("restart_after_load", "the pipeline's state did not advance after load_state_dict (the "
                           "first resume was exact"),
    ("state_frozen", "the pipeline's state did not advance after load_state_dict, so a "
                     "second resume restarts from the first"),
    ("guard_as_written", "the pass restarted from its beginning on restore (an epoch guard"),
    ("skip_in_batches", "a skip counted in batches where the checkpoint counts examples"),
    ("skip_by_length", "the resume skipped by a length the stream does not have"),
])
def test_09s_position_rule_gives_the_fix_of_the_cause_and_passes_the_clean_twin(
        data_file, bug, fix):
    from workbook import load_task
    from workbook.notebooks.parallel.pipeline import PIPELINE_RULES, pipeline_rules

    task = load_task("examples.token_stream:task", data_file=data_file, block_size=16,
                     n_layer=1, n_embd=32, pipeline_bug=bug)
    row = pipeline_rules(task, 2, 0, 2, 16)[1]
    assert row["verdict"] == ("fail" if bug else "pass") and fix in row["remediation"], row
    assert row["remediation"] != PIPELINE_RULES[row["rule"]] and "rank 1" in row["measured"] \
        if bug else row["remediation"] == ""


def closure_resume(tmp_path, **options):
    """pytorch/examples' word_language_model (examples/word_lm.py) resumed mid-pass in this
    process: (the comparison, what 07 says of a resume that read the same examples)."""
    from workbook.notebooks.resume.undeclared import undeclared_state
    from workbook.training.loop import UpdateShape

    cfg = UpdateShape(micro_batch=2, accumulation=1).train_config(lr=5.0, seed=0, device="cpu")
    recipe = resume.recipe("examples.word_lm:task", {"emsize": 16, "nhid": 16, "nlayers": 2,
                                                      "dropout": 0.1, **options}, cfg, 24)
    reference, weights = resume.run_recipe(recipe, UPDATES, tmp_path, checkpoint_at=(MID,))
    resumed, w = resume.run_recipe(recipe, UPDATES, start_from=tmp_path / "ckpt-000005")
    task, items, cfg = resume.rebuild(recipe)
    return resume.compare(reference, resumed, weights, w)[1], undeclared_state(task, items, cfg)


def test_a_hidden_state_kept_in_the_steps_closure_is_named_and_the_declared_twin_is_not(
        tmp_path):
    """The script's train() as the task's train_step, its hidden state in the step's closure
    and undeclared: a resumed process starts it afresh, so the resume reads the same examples
    and is not exact; one update run twice from the same state says why."""
    verdict, said = closure_resume(tmp_path / "closure", closure=True)
    assert verdict["same_examples"] and not verdict["exact"]
    assert said.startswith("the same examples, other parameters: the task's train_step, run "
                           "twice from the same parameters, optimizer and random state on the "
                           "same update, gave loss ") and "the model's forward takes 'hidden'" \
        in said, said
    assert "declare it: state=wb.CarriedState(init=lambda model, rows: model.init_hidden(rows))" \
        in said
    verdict, said = closure_resume(tmp_path / "declared")  # the state declared: carried by 07
    assert verdict["exact"] and said == ""


def test_an_update_that_cannot_be_run_twice_leaves_a_suspicion_with_the_test_to_run(tmp_path):
    import dataclasses

    from workbook.notebooks.resume.undeclared import undeclared_state

    task, items, cfg = resume.rebuild(resume.recipe(
        "examples.word_lm:task", {"emsize": 16, "nhid": 16, "nlayers": 2, "closure": True},
        resume.UpdateShape(2, 1).train_config(lr=5.0, seed=0, device="cpu"), 24))

    def steps_twice(model, optimizer, micro_batches):
        optimizer.step()
        optimizer.step()
        return 0.0

    said = undeclared_state(dataclasses.replace(task, train_step=steps_twice), items, cfg)
    assert "the model's forward takes 'hidden' while the task declares no carried state" in \
        said and "(not confirmed: running one update twice failed, WorkbookError) - test it: " \
        "run the task's train_step twice" in said and "wb.CarriedState(" in said, said


@pytest.mark.parametrize("name", ["examples.mlp_dropout:task",
                                  "workbook.samples.generation:task"])
def test_an_update_that_carries_nothing_raises_nothing(name):
    """Dropout drawn from the same random state, the task's own step (mlp_dropout) or the
    workbook's update (the sample): the same update twice gives the same result."""
    from workbook.notebooks.resume.undeclared import undeclared_state

    cfg = resume.UpdateShape(4, 2).train_config(lr=1e-3, seed=0, device="cpu")
    task, items, cfg = resume.rebuild(resume.recipe(name, {}, cfg, 16))
    assert undeclared_state(task, items, cfg) == ""


def test_a_step_that_is_not_deterministic_is_not_called_a_carried_state():
    """A backward that adds what no seed holds (as CUDA's atomic adds reorder sums): the same
    update twice gives the same loss and other parameters - the kernels, not a state."""
    import os

    import torch

    from workbook.notebooks.resume.undeclared import nondeterministic, undeclared_state

    cfg = resume.UpdateShape(4, 2).train_config(lr=1e-3, seed=0, device="cpu")
    task, items, cfg = resume.rebuild(resume.recipe("examples.mlp_dropout:task", {}, cfg, 16))

    class Jitter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            noise = int.from_bytes(os.urandom(2), "little") / 65536  # no seed reaches it
            return grad * (1 + 1e-3 * noise)

    def step(model, optimizer, micro_batches):
        model.train()
        optimizer.zero_grad()
        total = 0.0
        for mb in micro_batches:
            loss = Jitter.apply(torch.nn.functional.mse_loss(model(mb["x"]), mb["labels"]))
            loss.backward()
            total += loss.item()
        optimizer.step()
        return total / len(micro_batches)

    said = undeclared_state(dataclasses.replace(task, train_step=step), items, cfg)
    assert "gave the same loss" in said and "not deterministic on cpu" in said, said
    assert "CarriedState" not in said
    cuda = nondeterministic(torch.nn.Linear(2, 2), 0.5, 3e-5)
    assert "use_deterministic_algorithms(True)" in cuda and "3e-05" in cuda
