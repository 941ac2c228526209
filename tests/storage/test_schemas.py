"""The schemas of the files the workbook reads back, bounded JSON parsing, the tensor checks,
safe links in exported pages and time limits: each check with a clean twin that must pass.
No training; the whole file takes a few seconds."""

import json

import pytest
import torch

from workbook import WorkbookError
from workbook.commands.report import SAFE_URL, safe_links, safe_url
from workbook.storage import schemas
from workbook.training.replica import ReplicaSpec


def test_json_is_parsed_bounded_in_depth_integer_length_and_size(tmp_path, monkeypatch):
    assert schemas.parse_json(b'{"a": [[1, 2], {"b": "[[[[["}]}', "f", "x") == \
        {"a": [[1, 2], {"b": "[[[[["}]}, "brackets inside strings do not count"
    assert schemas.json_depth(b'"\\"[[[" [[]]') == 2
    with pytest.raises(WorkbookError, match="nests arrays or objects 65 deep"):
        schemas.parse_json(b"[" * 65 + b"]" * 65, "f", "x")
    schemas.parse_json(b"[" * 64 + b"]" * 64, "f", "x")  # clean twin: at the limit
    with pytest.raises(WorkbookError, match="an integer of 41 digits"):
        schemas.parse_json(b"[" + b"9" * 41 + b"]", "f", "x")
    assert schemas.parse_json(b"-" + b"9" * 40, "f", "x") == -int("9" * 40)
    monkeypatch.setattr(schemas, "MAX_JSON_BYTES", 10)
    with pytest.raises(WorkbookError, match="holds 11 bytes, more than the 10"):
        schemas.parse_json(b'"123456789"', "f", "x")
    with pytest.raises(WorkbookError, match="f is not valid JSON, so the x cannot be read"):
        schemas.parse_json(b"{", "f", "x")


def test_a_failed_check_names_the_file_the_field_and_what_was_expected():
    with pytest.raises(WorkbookError) as info:
        schemas.check(schemas.TrialParams, {"lr": "0.1", "seed": -1, "x": 1}, "ledger.sqlite",
                      "trial's parameters", "start anew")
    text = str(info.value)
    assert "trial's parameters ledger.sqlite is not a trial's parameters this workbook wrote" \
        in text
    assert "field 'lr' should be a valid number (got '0.1')" in text
    assert "field 'seed' should be greater than or equal to 0 (got -1)" in text
    assert "field 'x' is not a field of this file" in text and info.value.fix == "start anew"
    assert schemas.check(schemas.TrialParams, {"lr": 1, "seed": 0}, "f", "x").lr == 1.0


@pytest.mark.parametrize("change, field", [
    ({"updates": 0}, "config.updates"), ({"lr": float("inf")}, "config.lr"),
    ({"grad_clip": -1.0}, "config.grad_clip"), ({"seed": 2**32}, "config.seed"),
    ({"drop_partial": "no"}, "config.drop_partial"), ({"shape": {"precision": "fp8"}},
                                                      "config.shape.precision"),
])
def test_a_recipe_of_values_that_cannot_train_is_refused_by_field(change, field):
    from dataclasses import asdict

    from workbook.notebooks.resume import check_recipe
    from workbook.training.loop import TrainConfig

    spec = {"task": "t:t", "task_options": {}, "train_limit": 0, "config": asdict(TrainConfig())}
    assert check_recipe(spec)["config"] == asdict(TrainConfig()), "clean twin"
    with pytest.raises(WorkbookError, match=f"field '{field}'"):
        check_recipe({**spec, "config": {**spec["config"], **change}})


def test_random_states_of_another_length_are_refused_before_any_generator_is_set():
    from workbook.training.checkpoint import rng_state, set_rng_state

    state = rng_state()
    set_rng_state(state)  # clean twin
    before = torch.get_rng_state()
    broken = {**state, "torch": state["torch"].float()}
    with pytest.raises(WorkbookError, match="torch's state must be a torch.uint8 tensor"):
        set_rng_state(broken)
    broken = {**state, "python": [3, state["python"][1][:100], None]}
    with pytest.raises(WorkbookError, match="Python's state must be a torch.int64 tensor"):
        set_rng_state(broken)
    assert torch.equal(torch.get_rng_state(), before), "nothing was set"


def test_optimizer_state_is_checked_against_the_optimizer_it_loads_into():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert schemas.optimizer_mismatch(state, optimizer) is None, "clean twin"
    other = torch.optim.AdamW(torch.nn.Linear(3, 4).parameters())
    assert "state[0]['exp_avg'] has shape (2, 3), its parameter's has (4, 3)" == \
        schemas.optimizer_mismatch(state, other)
    two = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}])
    assert "it has 1 parameter group(s), the optimizer 2" == \
        schemas.optimizer_mismatch(state, two)
    state["state"][1]["exp_avg"] = state["state"][1]["exp_avg"].double()
    assert "is stored as float64, its parameter's is float32" in \
        schemas.optimizer_mismatch(state, optimizer)


def test_weights_in_another_dtype_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import save_model

    from workbook.training.checkpoint import load_weights

    model = torch.nn.Linear(2, 2)
    save_model(model.to(torch.bfloat16), str(tmp_path / "w.safetensors"))
    with pytest.raises(WorkbookError, match="stored as bfloat16, the model's is float32"):
        load_weights(torch.nn.Linear(2, 2), tmp_path / "w.safetensors", "checkpoint")
    load_weights(torch.nn.Linear(2, 2).to(torch.bfloat16), tmp_path / "w.safetensors",
                 "checkpoint")  # clean twin


@pytest.mark.parametrize("url, loads, safe", [
    ("https://example.org/a?b=c", False, True), ("http://x", False, True),
    ("mailto:a@b.c", False, True), ("#section", False, True), ("rel/path.html", False, True),
    ("07_resume_reload/", False, True), ("data:image/png;base64,iVBORw0KGgo=", True, True),
    ("javascript:alert(1)", False, False), ("JaVaScRiPt:alert(1)", False, False),
    (" java\tscript:alert(1)", False, False), ("jav&#x61;script:1", False, False),
    ("&#106;avascript:1", False, False), ("vbscript:msgbox", False, False),
    ("data:text/html,<script>", True, False), ("data:image/png;base64,AAAA", False, False),
    ("file:///etc/passwd", False, False), ("data:image/svg+xml;base64,AAAA", True, False),
])
def test_only_web_mail_relative_and_anchor_links_stay_live(url, loads, safe):
    assert safe_url(url, loads) is safe


def test_safe_links_rewrites_attributes_anywhere_in_the_page_and_keeps_the_rest():
    page = ("<p>text javascript: stays text</p><a title='>' href=\"javascript:x\">a</a>"
            "<img src=x onerror=alert(1)><a href='https://x.org'>b</a>"
            '<img src="data:image/png;base64,AAAA">')
    out = safe_links(page)
    assert f'href="{SAFE_URL}"' in out and "onerror" not in out
    assert "<p>text javascript: stays text</p>" in out
    assert "href='https://x.org'" in out and 'src="data:image/png;base64,AAAA"' in out


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-5", "soon"])
def test_a_time_limit_must_be_positive_and_finite(value, capsys):
    from workbook.commands.cli import main

    with pytest.raises(SystemExit) as info:
        main(["pilot", f"--timeout={value}"])
    assert info.value.code == 2
    assert f"argument --timeout: '{value}' is not a" in capsys.readouterr().err


def test_a_pilot_timeout_given_directly_must_be_finite(tmp_path):
    from workbook.commands.pilot import run_pilot

    with pytest.raises(WorkbookError, match="--timeout must be a positive finite number"):
        run_pilot("tests.own_task:task", out=str(tmp_path / "r"), only="01",
                  timeout=float("inf"))
    assert not (tmp_path / "r").exists()


def test_a_summary_of_another_verdict_is_named_and_the_report_still_renders(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"verdict": "great", "figures": {}}))
    with pytest.raises(WorkbookError, match="field 'verdict' should be 'pass', 'fail' or "
                                            "'error'"):
        schemas.read(path, schemas.Summary, "notebook summary")
    from workbook.commands.report import _summary

    assert _summary(tmp_path) is None
    path.write_text(json.dumps({"verdict": "pass", "figures": {"x": 1}, "headline": "h"}))
    assert _summary(tmp_path) == {"verdict": "pass", "figures": {"x": 1}, "headline": "h"}


def test_a_checkpoint_without_the_launch_counters_cannot_resume_a_launch():
    """For replica._restore (a 07 checkpoint given to `workbook ddp --resume-from` was
    KeyError: 'rank_rng')."""
    from workbook.training.checkpoint import rng_state

    seven = {"step": 2, "epoch": 0, "group": 2, "micro_batch_in_group": 0}
    with pytest.raises(WorkbookError, match="field 'counters.world' is missing"):
        schemas.check(schemas.ReplicaCounters, seven, "ckpt/state.pt", "checkpoint state",
                      "resume from a checkpoint of notebook 09's launch", "counters")
    schemas.check(schemas.ReplicaCounters, {**seven, "world": 2, "rank_rng": [rng_state()] * 2},
                  "ckpt/state.pt", "checkpoint state")  # clean twin


def test_launch_settings_of_the_wrong_type_are_named():
    """For replica.ReplicaSpec.from_dict (a --spec with a string lr was a TypeError); its schema
    is derived from its fields."""
    from dataclasses import asdict

    schema = schemas.derived(ReplicaSpec)
    with pytest.raises(WorkbookError, match="field 'lr' should be a valid number"):
        schemas.check(schema, {"task": "a:b", "lr": "0.1"}, "--spec", "launch spec")
    with pytest.raises(WorkbookError, match="field 'collective_timeout_s' should be a finite"):
        schemas.check(schema, {"task": "a:b", "collective_timeout_s": float("inf")},
                      "--spec", "launch spec")
    spec = asdict(ReplicaSpec("a:b"))
    assert schemas.check(schema, spec, "--spec", "launch spec").model_dump() == spec


def test_a_launch_spec_with_a_string_lr_is_refused_naming_the_field():
    from workbook.training.replica import ReplicaSpec

    with pytest.raises(WorkbookError, match="field 'lr' should be a valid number"):
        ReplicaSpec.from_dict({"task": "workbook.samples.generation:task", "lr": "0.1"})
    assert ReplicaSpec.from_dict({"task": "workbook.samples.generation:task", "lr": 0.1}).lr == 0.1
