"""A task carrying state across batches (Task.state): pytorch/examples' word_language_model
LSTM trained by truncated backpropagation through time (examples/word_lm.py) - the state is
passed in and carried per stream, detached, reset each pass, evaluated in order, saved with
checkpoints and resumed exactly; a state left attached and a state left undeclared are named."""

import dataclasses

import pytest
import torch

from workbook import TrainConfig, UpdateShape, WorkbookError, load_task
from workbook.commands.cli import _option
from workbook.contract.data import collate_items, prepare
from workbook.notebooks.inspection import probe_outputs
from workbook.notebooks.resume import compare, planted_faults, recipe, run_recipe
from workbook.training.evaluation import evaluate
from workbook.training.loop import train

WORD_LM = "examples.word_lm:task"


@pytest.fixture(scope="module")
def word_lm():
    task = load_task(WORD_LM, dropout=0.0)
    return task, prepare(task, limits={"train": 48, "validation": 30})


def shape(micro, accumulation):
    return TrainConfig(UpdateShape(micro, accumulation), updates=3, lr=20.0, grad_clip=0.25)


def forgetting(task):
    """The same task with a state that starts from zeros at every batch (nothing carried)."""
    return dataclasses.replace(task, state=dataclasses.replace(
        task.state, detach=lambda h: tuple(torch.zeros_like(t) for t in h)))


def test_the_state_is_carried_per_stream_to_the_next_chunk(word_lm):
    task, data = word_lm
    model = task.build_model()
    received = []
    model.rnn.register_forward_pre_hook(lambda m, args: received.append(args[1][0].clone()))
    result = train(task, data.train, TrainConfig(UpdateShape(4, 1), updates=2, lr=20.0),
                   model=model)
    # a pass is read in order: chunk 0 of the four streams (batchify's columns), then chunk 1
    assert result.steps[0].example_ids == ["train-0-0", "train-0-1", "train-0-2", "train-0-3"]
    assert result.steps[1].example_ids == ["train-16-0", "train-16-1", "train-16-2", "train-16-3"]
    assert torch.count_nonzero(received[0]) == 0  # init_hidden at the start of the pass
    assert torch.count_nonzero(received[1]) == received[1].numel()  # chunk 0's final state
    # a forward outside the loop (a probe of one batch) starts every stream from init_hidden
    batch = collate_items(task, data.train[4:8]).tensors
    task.forward(model, batch)
    assert torch.count_nonzero(received[-1]) == 0


def test_any_split_of_an_update_gives_the_same_training(word_lm):
    task, data = word_lm
    runs = [train(task, data.train, shape(m, a)) for m, a in ((4, 1), (2, 2), (1, 4))]
    first = runs[0].model.state_dict()
    for other in runs[1:]:
        for k, v in other.model.state_dict().items():
            torch.testing.assert_close(v, first[k], rtol=1e-4, atol=1e-5)
    # the state really flowed: the same updates from zeros at every batch train differently
    cold = train(forgetting(task), data.train, shape(4, 1))
    assert cold.steps[0].loss == runs[0].steps[0].loss
    assert cold.steps[2].loss != pytest.approx(runs[0].steps[2].loss, rel=1e-4)


def test_evaluation_carries_the_state_in_order_for_any_batch_size(word_lm):
    task, data = word_lm
    model = train(task, data.train, shape(4, 1)).model
    cpu = torch.device("cpu")
    by = [evaluate(task, model, data.validation, size, cpu).loss for size in (10, 4, 3)]
    assert by[1] == pytest.approx(by[0], rel=1e-5) and by[2] == pytest.approx(by[0], rel=1e-5)
    cold = evaluate(forgetting(task), model, data.validation, 10, cpu).loss
    assert cold != pytest.approx(by[0], rel=1e-4)


def test_a_state_left_attached_is_named_with_the_fix(word_lm):
    _, data = word_lm
    task = load_task(WORD_LM, detach=False)
    with pytest.raises(WorkbookError) as caught:
        train(task, data.train, shape(4, 1))
    assert "still attached to the previous batch's graph" in caught.value.problem
    assert "retain_graph=True" in caught.value.problem  # PyTorch's advice, said to be wrong
    assert "repackage_hidden" in caught.value.fix


def test_a_forward_that_needs_an_undeclared_state_is_named(word_lm):
    _, data = word_lm
    task = load_task(WORD_LM, declare=False)
    model = task.build_model().eval()
    _, flags = probe_outputs(task, model, data.train[:4], data.train)
    assert len(flags) == 1 and "needs `hidden`" in flags[0].message
    assert "CarriedState(init=lambda model, rows: model.init_hidden(rows))" in flags[0].fix
    clean = load_task(WORD_LM)
    outputs, flags = probe_outputs(clean, clean.build_model().eval(), data.train[:4],
                                   data.train)
    assert flags == [] and outputs.logits.shape[-1] == clean.build_model().ntoken


def test_a_resume_brings_the_carried_state_back_exactly(tmp_path):
    spec = recipe(WORD_LM, {"dropout": 0.0}, TrainConfig(UpdateShape(4, 1), lr=20.0),
                  train_limit=24)  # 6 updates a pass: the resume at 4 is mid-pass
    reference, weights = run_recipe(spec, 6, tmp_path, checkpoint_at=(4,))
    resumed, w = run_recipe(spec, 6, start_from=tmp_path / "ckpt-000004")
    _, verdict = compare(reference, resumed, weights, w)
    assert verdict["exact"], verdict
    faults = planted_faults(spec, 6, 4, tmp_path, reference, weights)
    row = faults[faults["planted bug"] == "carried state (Task.state) not restored"]
    assert len(row) == 1 and bool(row["caught"].iloc[0])


def test_true_and_false_options_are_booleans():
    assert _option("declare=false") == ("declare", False)
    assert _option("lora=True") == ("lora", True)
    assert _option("name=falsey") == ("name", "falsey")


def test_fsdp2_refusing_a_recurrent_kernel_is_a_finding_not_a_crash():
    from workbook.notebooks.parallel.fsdp import UNSHARDABLE, unshardable

    raised = ("the 2-process launch failed (exit 1): [rank0]: RuntimeError: "
              "aten.mkldnn_rnn_layer.default got mixed torch.Tensor and DTensor, need to "
              "convert all torch.Tensor to DTensor before calling distributed operators!")
    said = unshardable(raised)
    assert "aten.mkldnn_rnn_layer.default" in said and "train it with DDP" in said
    assert "nn.RNN / LSTM / GRU" in said
    assert UNSHARDABLE.search("the 2-process launch failed: a timeout") is None  # not ours


def test_reading_every_pass_in_order_is_not_a_repeated_pass(word_lm, tmp_path):
    """A TBPTT pass reads the corpus in order every time: 07's check for a pipeline that
    replays the previous pass must not take it for one (it did: a false alarm at full size)."""
    from workbook.notebooks.resume.position import pass_orders, repeated_pass

    task, data = word_lm
    spec = recipe(WORD_LM, {"dropout": 0.0}, TrainConfig(UpdateShape(4, 1), lr=5.0),
                  train_limit=8)  # 2 updates a pass: pass 1 reads pass 0's examples again
    reference, _ = run_recipe(spec, 4, tmp_path)
    assert [r["ids"] for r in reference[2:]] == [r["ids"] for r in reference[:2]]
    cfg = TrainConfig(UpdateShape(4, 1))
    assert pass_orders(task, data.train, cfg) is None
    assert repeated_pass(reference, pass_orders(task, data.train, cfg)) == ""
