"""Notebook 03's gates: the samples pass every gate; each planted bug fails the right one."""

import dataclasses
import os
import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from workbook.notebooks.gates import GateRun
from workbook.notebooks.gates.settings import INPUT_BOUND_FLOOR_S, PHASES, GateSettings, input_bound
from workbook.samples import generation
from workbook.samples.models import TinyDecoder, TrigramClassifier
from workbook.training.loop import UpdateShape

SMALL = GateSettings(UpdateShape(2, 2), eval_batch=8, input_updates=2)
# the gates judged on their logic: a data wait under 30 s is not input-bound, so a busy machine
# (a make test beside other jobs) cannot turn the data gate into a warning; the tests of the
# input-bound warning itself use SMALL
CALM = dataclasses.replace(SMALL, input_bound_floor_s=30.0)


def gates(task, items, tmp_path, settings=CALM, n_train=200, **hooks):
    report = GateRun(task, settings, items["train"][:n_train], items["validation"][:40],
                     tmp_path / "gates", **hooks).run()
    return report, {r.phase: r for r in report.rows}


@pytest.mark.parametrize("fixture", ["gen", "cls"])
def test_samples_pass_every_gate_without_false_alarm(fixture, request, tmp_path):
    task = request.getfixturevalue(f"{fixture}_task")
    report, rows = gates(task, request.getfixturevalue(f"{fixture}_items"), tmp_path)
    assert [r.phase for r in report.rows] == list(PHASES)
    assert all(r.verdict == "pass" for r in report.rows), report.table()[["phase", "detail"]]
    assert rows["update (first)"].peak_allocated_bytes > rows["forward + loss"].baseline_bytes
    assert rows["resume"].detail.endswith("max |diff| = 0")
    for r in report.rows:  # allocated and reserved are kept apart; CPU has no reserved counter
        assert r.peak_reserved_bytes is None and r.counter == "cpu-profiler"


def test_nan_in_forward_fails_forward_and_names_the_module(gen_task, gen_items, tmp_path):
    class NaNDecoder(TinyDecoder):
        def __init__(self):
            super().__init__(259)
            self.norm.register_forward_hook(lambda m, i, o: o * float("nan"))
    task = dataclasses.replace(gen_task, build_model=NaNDecoder)
    _, rows = gates(task, gen_items, tmp_path)
    assert rows["forward + loss"].verdict == "fail"
    assert "NaN" in rows["forward + loss"].detail and "'norm'" in rows["forward + loss"].detail
    assert rows["backward"].detail.startswith("not run")


def test_a_forward_that_raises_is_a_failing_row_not_a_crash(gen_task, gen_items, tmp_path):
    def broken(**_):
        raise ValueError("shape mismatch in my model")
    task = dataclasses.replace(gen_task, build_model=lambda: _Raiser(broken))
    report, rows = gates(task, gen_items, tmp_path)
    assert "ValueError: shape mismatch" in rows["forward + loss"].detail
    assert report.verdict == "fail"


class _Raiser(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.lin = fn, torch.nn.Linear(1, 1)

    def forward(self, **kw):
        return self.fn(**kw)


def test_layer_left_out_of_the_optimizer_fails_the_update(gen_task, gen_items, tmp_path):
    def forgetful(model, lr):
        params = list(model.parameters())
        return torch.optim.AdamW(params[:-2], lr=lr)  # the output head is forgotten
    _, rows = gates(dataclasses.replace(gen_task, build_optimizer=forgetful), gen_items,
                    tmp_path)
    assert rows["backward"].verdict == "pass"
    assert rows["update (first)"].verdict == "fail"
    assert "not in the optimizer" in rows["update (first)"].detail


def test_dropout_left_on_in_evaluation_fails_validation(cls_task, cls_items, tmp_path):
    class AlwaysDropout(TrigramClassifier):
        def forward(self, input_ids, attention_mask):
            return F.dropout(super().forward(input_ids, attention_mask), 0.5, training=True)
    task = dataclasses.replace(cls_task, build_model=partial(AlwaysDropout, 259, 5))
    _, rows = gates(task, cls_items, tmp_path)
    assert rows["validation"].verdict == "fail" and "dropout" in rows["validation"].detail


def test_batch_norm_in_training_behaviour_fails_validation(cls_task, cls_items, tmp_path):
    class StuckBatchNorm(TrigramClassifier):
        def __init__(self):
            super().__init__(259, 5)
            self.bn = torch.nn.BatchNorm1d(5)

        def train(self, mode=True):  # the bug: eval() never reaches the batch norm
            super().train(mode)
            self.bn.train()
            return self

        def forward(self, input_ids, attention_mask):
            return self.bn(super().forward(input_ids, attention_mask))
    task = dataclasses.replace(cls_task, build_model=StuckBatchNorm)
    _, rows = gates(task, cls_items, tmp_path)
    assert rows["validation"].verdict == "fail"
    assert "batch-norm" in rows["validation"].detail


def test_companion_dependence_names_only_causes_the_model_can_have(cls_task, cls_items,
                                                                  tmp_path):
    class IgnoresMask(TrigramClassifier):  # padding is pooled with the text: no batch norm
        def forward(self, input_ids, attention_mask):
            return super().forward(input_ids, torch.ones_like(attention_mask))
    task = dataclasses.replace(cls_task, build_model=partial(IgnoresMask, 259, 5))
    _, rows = gates(task, cls_items, tmp_path)
    detail = rows["validation"].detail
    assert rows["validation"].verdict == "fail" and "padding reaches the output" in detail
    assert "batch norm" not in detail and "batch-norm" not in detail


def test_checkpoint_without_optimizer_state_fails_resume(gen_task, gen_items, tmp_path):
    from workbook.training.checkpoint import save_checkpoint

    def save_weights_only(path, model, optimizer, *rest, **kw):
        return save_checkpoint(path, model, None, *rest, **kw)
    _, rows = gates(gen_task, gen_items, tmp_path, save=save_weights_only)
    assert rows["checkpoint save"].verdict == "pass"
    assert rows["resume"].verdict == "fail" and "no optimizer state" in rows["resume"].detail


def test_tied_weights_survive_a_checkpoint_and_an_untying_restore_fails_resume(tmp_path):
    from workbook import load_task
    from workbook.contract.data import SPLITS, prepare
    from workbook.training.checkpoint import load_checkpoint, save_checkpoint, tied_groups

    task = load_task("workbook.samples.generation:task", tie_embeddings=True)
    items = prepare(task, SPLITS).items
    model = task.build_model()
    save_checkpoint(tmp_path / "ckpt", model)
    fresh = task.build_model()
    load_checkpoint(tmp_path / "ckpt", fresh)
    assert fresh.head.weight is fresh.embed.weight and tied_groups(fresh) == [
        ("embed.weight", "head.weight")]
    assert torch.equal(fresh.head.weight, model.head.weight)
    _, rows = gates(task, items, tmp_path / "clean")
    assert rows["resume"].verdict == "pass", rows["resume"].detail

    def untying_load(path, model, *rest, **kw):  # the bug: a new Parameter where the tie was
        info = load_checkpoint(path, model, *rest, **kw)
        model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
        return info
    _, rows = gates(task, items, tmp_path / "untied", load=untying_load)
    assert rows["resume"].verdict == "fail"
    assert "embed.weight = head.weight are separate" in rows["resume"].detail


def test_slow_data_loader_warns_on_the_data_gate(cls_task, cls_items, tmp_path):
    def slow_collate(items):
        time.sleep(0.02)
        return cls_task.collate(items)
    report, rows = gates(dataclasses.replace(cls_task, collate=slow_collate), cls_items,
                         tmp_path, settings=SMALL)
    assert rows["data"].verdict == "warn" and "input-bound" in rows["data"].detail
    assert report.verdict == "pass", "a warning does not fail the run"


def test_input_bound_needs_a_median_wait_above_the_floor_not_a_share_alone(tmp_path):
    """examples/regression.py's planted slow `__getitem__` (5 ms per example) is input-bound;
    its clean twin - the same 8-feature MLP, sub-millisecond updates - is not, whatever share
    its tiny data wait takes of them."""
    from workbook import load_task
    from workbook.contract.data import prepare

    def data_gate(**options):
        task = load_task("examples.regression:task", **options)
        data = prepare(task)
        report = GateRun(task, SMALL, data.train[:64], data.validation[:20],
                         tmp_path / ("slow" if options else "clean")).run()
        return {r.phase: r for r in report.rows}["data"], report.pipeline
    slow, timed = data_gate(slow_getitem=True)
    assert len(timed) == 3, "medians over several updates, never one"
    assert slow.verdict == "warn" and "input-bound" in slow.detail
    assert "5 ms floor" in slow.detail and "medians of 3 updates" in slow.detail
    clean, _ = data_gate()
    assert clean.verdict == "pass", clean.detail
    assert "ms per update" in clean.detail and "input-bound" not in clean.detail


def test_a_share_of_a_tiny_update_or_one_slow_update_is_not_input_bound():
    """The judgement on timed updates (seconds): a share with a sub-ms wait is noise, a single
    slow update does not move the median, a long wait that is a small share is fine."""
    import pandas as pd

    def judged(waits_ms, updates_ms):
        timed = pd.DataFrame({"data_s": [w / 1e3 for w in waits_ms],
                              "time_s": [u / 1e3 for u in updates_ms]})
        return input_bound(timed, GateSettings())
    tiny, words = judged([0.21, 0.2, 0.22, 0.2], [0.6, 0.58, 0.61, 0.6])  # 35% of 0.6 ms
    assert not tiny and "under the 5 ms floor per update, so no warning" in words
    assert not judged([0.1, 0.1, 50.0, 0.1], [0.5, 0.5, 50.4, 0.5])[0], "one stall is no finding"
    assert not judged([8.0, 8.0, 8.0], [100.0, 100.0, 100.0])[0], "8% of the update"
    bound, words = judged([40.0, 41.0, 39.0], [43.0, 44.0, 42.0])
    assert bound and "input-bound: above 30% of the update and the 5 ms floor" in words
    assert INPUT_BOUND_FLOOR_S == 0.005
    assert not input_bound(pd.DataFrame(columns=["data_s", "time_s"]), GateSettings())[0]


def test_save_without_space_fails_the_save_gate_with_a_clear_message(gen_task, gen_items,
                                                                    tmp_path, monkeypatch):
    import workbook.training.checkpoint as ckpt

    def full_disk(*args, **kwargs):
        raise OSError(28, os.strerror(28))
    monkeypatch.setattr(ckpt, "save_model", full_disk)
    _, rows = gates(gen_task, gen_items, tmp_path)
    assert rows["checkpoint save"].verdict == "fail"
    assert "No space left on device" in rows["checkpoint save"].detail
    assert rows["resume"].detail.startswith("not run")
    assert not list((tmp_path / "gates").glob(".*partial*")), "no half-written checkpoint left"


def test_stated_device_memory_fails_a_phase_that_does_not_fit(gen_task, gen_items, tmp_path):
    tiny = dataclasses.replace(SMALL, device_memory_gib=0.001)  # about 1 MiB
    report, rows = gates(gen_task, gen_items, tmp_path, settings=tiny)
    assert rows["update (later)"].verdict == "fail" and "GiB" in rows["update (later)"].detail
    assert report.verdict == "fail"


def test_nothing_in_the_run_folder_is_overwritten(gen_task, gen_items, tmp_path):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "export.safetensors").write_text("earlier run")
    _, rows = gates(gen_task, gen_items, tmp_path)
    assert rows["export"].verdict == "fail"
    assert (tmp_path / "gates" / "export.safetensors").read_text() == "earlier run"


def test_generation_prompt_option_still_passes(gen_items, tmp_path):
    task = generation.make_task(prompt_in_loss=True)
    report, _ = gates(task, gen_items, tmp_path)
    assert report.verdict == "pass"


def test_a_model_that_cannot_be_built_fails_its_gate_and_blocks_the_rest(gen_task, gen_items,
                                                                          tmp_path):
    """The gates are one table run in order: a failure while building the model and optimizer
    is the forward gate's row, and every gate that needs them says why it did not run."""
    def no_optimizer(model, lr):
        raise RuntimeError("planted: the optimizer cannot be built")

    task = dataclasses.replace(gen_task, build_optimizer=no_optimizer)
    _, rows = gates(task, gen_items, tmp_path)
    assert list(rows) == list(PHASES)
    assert "planted: the optimizer cannot be built" in rows["forward + loss"].detail
    for phase in PHASES[2:]:
        assert rows[phase].verdict == "fail"
        assert rows[phase].detail.startswith("not run: "), (phase, rows[phase].detail)


def test_notebook_03_with_a_precision_this_device_cannot_run_fails_its_gates_not_a_crash(
        tmp_path):
    """fp16 on the CPU: the forward gate fails with the reason, the comparison with the
    prediction has no measured bytes (it crashed casting them), and a precision that does not
    exist is refused before any gate runs."""
    from workbook import WorkbookError
    from workbook.commands import params
    from workbook.notebooks import gates as notebook

    p = params.of("03_phase_gates", small=True, precision="fp16", train_limit=100)
    result = notebook.run(p, tmp_path)
    rows = result.report.table().set_index("phase")
    assert "fp16 mixed precision needs CUDA" in rows.loc["forward + loss", "detail"]
    assert result.check.measured_peak_bytes.isna().all()
    assert result.check.note.str.startswith("not predicted: fp16 mixed precision").all()
    assert notebook.save(result, tmp_path) == "fail"
    with pytest.raises(WorkbookError, match="field 'precision' should be .* \\(got 'fp8'\\)"):
        notebook.run(params.of("03_phase_gates", small=True, precision="fp8"), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_batch_norm_regression_mlp_passes_the_initial_loss_on_any_seed_and_a_dead_model_fails(
        tmp_path):
    """Two targets of a batch-norm MLP in training mode missed the 50% band 41% of the time:
    the initial loss is judged over more examples. At lr 1e3 the gradient norm runs away."""
    from workbook.contract.data import prepare
    from workbook.contract.task import load_task

    task = load_task("examples.mlp_dropout:task")
    items = prepare(task).items
    for seed in range(4):
        settings = dataclasses.replace(SMALL, seed=seed)
        run = GateRun(task, settings, items["train"][:64], items["validation"][:16],
                      tmp_path / f"g{seed}")
        rows = {r.phase: r for r in run.run().rows}
        assert rows["forward + loss"].verdict == "pass", rows["forward + loss"].detail
        assert "of 64 examples (eval mode)" in rows["forward + loss"].detail
    typo = load_task("examples.mlp_dropout:task", lr_typo=True)
    run = GateRun(typo, dataclasses.replace(SMALL, lr=typo.lr), items["train"][:64],
                  items["validation"][:16], tmp_path / "typo")
    rows = {r.phase: r for r in run.run().rows}
    assert rows["update (later)"].verdict == "fail"
    assert "the learning rate diverges" in rows["update (later)"].detail


def _adamw_groups(model, decay_all, wd=0.1):
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 or decay_all]
    rest = [p for p in params if p.dim() < 2 and not decay_all]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": rest, "weight_decay": 0.0}], lr=1e-3)


def test_weight_decay_on_norms_and_biases_is_named_and_the_conventions_are_silent(gen_task):
    from workbook.contract.task import adamw
    from workbook.notebooks.gates.diagnosis import decay_on_norms

    model = gen_task.build_model()
    own = dataclasses.replace(gen_task, build_optimizer=lambda m, lr: _adamw_groups(m, True))
    said = decay_on_norms(own, model, _adamw_groups(model, True))
    norms = [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    assert said.startswith("note: weight decay 0.1 applies to") and f"{norms[0]}.weight" in said
    assert "a convention, not an error (torchvision's reference recipe decays everything" in said
    assert decay_on_norms(own, model, _adamw_groups(model, False)) is None  # p.dim() >= 2 only
    assert decay_on_norms(own, model, _adamw_groups(model, True, wd=0.0)) is None  # no decay
    # the workbook's own default (PyTorch's AdamW, 0.01 on everything) is no choice of the task
    assert decay_on_norms(gen_task, model, adamw(model, 1e-3)) is None
    # a norm's 2-D parameter (none in torch's norms; a custom one) counts by its module's name
    class WideNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(2, 4))
    wide = WideNorm()
    assert "scale" in decay_on_norms(own, wide, torch.optim.AdamW(wide.parameters(),
                                                                  weight_decay=0.1))


# --- 03's update gate: a tensor that did not change is tested for its cause before one is named
class _Extra(TinyDecoder):
    """The sample decoder with one more learned tensor of the logits: a bias behind a mask
    (`let` 0: the mask never lets it through) or a scale in its own dtype."""

    def __init__(self, let: float = 1.0, dtype: torch.dtype | None = None):
        super().__init__(259)
        self.register_buffer("let", torch.full((259,), let))
        self.extra = torch.nn.Parameter(torch.zeros(259))
        self.scale = torch.nn.Parameter(torch.ones(259, dtype=dtype)) if dtype else None

    def forward(self, input_ids, attention_mask=None):
        logits = super().forward(input_ids, attention_mask) + self.let * self.extra
        return logits * self.scale.float() if self.scale is not None else logits


def test_a_tensor_no_gradient_reaches_is_named_by_its_zero_gradient_and_the_twin_passes(
        gen_task, gen_items, tmp_path):
    _, rows = gates(dataclasses.replace(gen_task, build_model=partial(_Extra, 0.0)), gen_items,
                    tmp_path / "masked")
    first = rows["update (first)"]
    assert first.verdict == "fail", first.detail
    assert "1 trainable tensor (extra) did not change: their gradient is 0" in first.detail
    assert "no gradient reaches them" in first.detail and "optimizer" not in first.detail
    assert first.remediation == "trace how these tensors reach the loss"
    clean = dataclasses.replace(gen_task, build_model=_Extra, grad_clip=None)
    run = GateRun(clean, CALM, gen_items["train"][:200], gen_items["validation"][:40],
                  tmp_path / "clean")
    rows = {r.phase: r for r in run.run().rows}
    assert all(r.verdict == "pass" for r in rows.values()), [r.detail for r in rows.values()]
    # the gates clip as the task does: here not at all, and the row says so
    assert run.settings.train_config().grad_clip == 0
    assert rows["update (first)"].detail.endswith("no clipping (the task's grad_clip is None)")


def _with_lr0_group(model, lr):
    head = [model.head.weight, model.head.bias]
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    return torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 0.0}], lr=lr)


def test_a_warm_up_from_lr_0_is_read_as_the_schedule_not_as_frozen_tensors(gen_task, gen_items,
                                                                          tmp_path):
    transformers = pytest.importorskip("transformers")

    def warm_up(optimizer):  # every Hugging Face warm-up gives its first update lr 0
        return transformers.get_scheduler("linear", optimizer, num_warmup_steps=4,
                                          num_training_steps=100)
    task = dataclasses.replace(gen_task, build_scheduler=warm_up)
    report, rows = gates(task, gen_items, tmp_path / "warm")
    first, later = rows["update (first)"], rows["update (later)"]
    assert report.verdict == "pass" and first.verdict == "pass", first.detail
    assert first.detail.startswith("0 tensors changed, step counter 1, lr 0,")
    assert "did not change because the learning rate was 0 at this update: the task's " \
           "schedule starts from 0" in first.detail
    assert "the next update runs at lr 0.00025" in first.detail
    assert later.verdict == "pass" and "lr 0.00025" in later.detail
    assert "did not change" not in later.detail
    # the twin: a param group set to lr 0 for good is a fault, named as such
    report, rows = gates(dataclasses.replace(task, build_optimizer=_with_lr0_group), gen_items,
                         tmp_path / "lr0")
    later = rows["update (later)"]
    assert later.verdict == "fail"
    assert "2 trainable tensors (head.weight, head.bias) did not change: their param group " \
           "has lr 0 from the start" in later.detail
    assert later.remediation.startswith("give that param group a learning rate")


def test_an_update_under_the_float_resolution_is_named_so_not_blamed_on_the_optimizer(
        gen_task, gen_items, tmp_path):
    bf16 = dataclasses.replace(gen_task, build_model=partial(_Extra, 1.0, torch.bfloat16))
    settings = dataclasses.replace(CALM, lr=1e-4)
    _, rows = gates(bf16, gen_items, tmp_path / "bf16", settings=settings)
    first = rows["update (first)"]
    assert first.verdict == "warn", first.detail
    assert "1 trainable tensor (scale) changed by less than their float resolution: the " \
           "update at lr 0.0001, replayed on copies in float64, moves them by at most 0.0001, " \
           "under the bfloat16 spacing 0.0078" in first.detail
    assert "in this dtype they will not train" in first.detail and "optimizer (" not in \
        first.detail
    assert first.remediation.startswith("keep these tensors in float32")
    # in a warm-up whose base lr moves them (torchvision's warm-up of a no-decay group): a note
    def warm_up(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.01 if s == 0 else 1.0)
    warm = dataclasses.replace(bf16, build_scheduler=warm_up)
    _, rows = gates(warm, gen_items, tmp_path / "warm", settings=dataclasses.replace(CALM,
                                                                                    lr=1e-2))
    first = rows["update (first)"]
    assert first.verdict == "pass" and "changed by less than their float resolution" in \
        first.detail and "at the schedule's base lr 0.01 they move" in first.detail
    # the twin: the same scale in float32 moves at lr 1e-4, nothing to say
    _, rows = gates(dataclasses.replace(gen_task, build_model=partial(_Extra, 1.0,
                                                                      torch.float32)),
                    gen_items, tmp_path / "fp32", settings=settings)
    assert rows["update (first)"].verdict == "pass"
    assert "did not change" not in rows["update (first)"].detail
    assert "resolution" not in rows["update (first)"].detail


def test_an_unexplained_unchanged_tensor_is_a_suspicion_with_its_test(gen_task, gen_items,
                                                                       tmp_path):
    def writes_back(model, lr):  # a step hook that puts the head's bias back after each step
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        kept = {}
        optimizer.register_step_pre_hook(lambda *_: kept.update(b=model.head.bias.clone()))
        optimizer.register_step_post_hook(
            lambda *_: model.head.bias.data.copy_(kept["b"]))
        return optimizer
    _, rows = gates(dataclasses.replace(gen_task, build_optimizer=writes_back), gen_items,
                    tmp_path)
    first = rows["update (first)"]
    assert first.verdict == "fail"
    assert "1 trainable tensor (head.bias) did not change, though in the optimizer (param " \
           "group 0, lr 0.001) with a nonzero gradient, and the update replayed on copies " \
           "moves them by up to 0.001: the cause is not confirmed - suspect the step itself" \
           in first.detail, first.detail
    assert "test: step the optimizer on these tensors alone" in first.remediation


def test_torchvisions_no_decay_norm_group_in_a_warm_up_is_under_resolution_not_frozen(tmp_path):
    """torchvision's reference recipe: SGD with momentum, `--norm-weight-decay 0.0` (norm
    weights and biases in a group without decay) and a linear warm-up from 1% of the lr."""
    from workbook import load_task
    from workbook.contract.data import prepare
    from workbook.notebooks.gates.diagnosis import norms_and_biases

    def sgd(model, lr):
        norms = norms_and_biases(model)
        return torch.optim.SGD(
            [{"params": [p for p in model.parameters() if id(p) not in norms],
              "weight_decay": 1e-4},
             {"params": [p for p in model.parameters() if id(p) in norms],
              "weight_decay": 0.0}], lr=lr, momentum=0.9)

    def warm_up(optimizer):
        return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=5)
    task = dataclasses.replace(load_task("examples.cnn_batchnorm:task"), build_optimizer=sgd,
                               build_scheduler=warm_up)
    items = prepare(task).items
    _, rows = gates(task, items, tmp_path, settings=dataclasses.replace(CALM, lr=1e-4),
                    n_train=64)
    first = rows["update (first)"]
    assert first.verdict == "pass", first.detail
    assert "1 trainable tensor (blocks.0.bn.weight) changed by less than their float " \
           "resolution: the update at lr 1e-06" in first.detail
    assert "at the schedule's base lr 0.0001 they move" in first.detail
    assert rows["update (later)"].verdict == "pass"
