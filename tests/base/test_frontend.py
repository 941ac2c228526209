"""What a notebook displays is for people: tables in words and units, a headless progress bar
that leaves no stderr block, a last line that says why a notebook passed or failed."""

import json
import re

import numpy as np
import pandas as pd

from workbook.base import frontend
from workbook.notebooks import registry
from workbook.notebooks.registry import verdict_line


def _text(frame: pd.DataFrame) -> str:
    return frame.to_string() + " " + frame.to_html()


def test_a_table_shows_no_nan_dict_json_ansi_or_long_float():
    frame = pd.DataFrame({
        "peak_bytes": [3 * 2**20, None], "ratio": [1 / 3, np.nan],
        "metrics": ['{"accuracy": 0.1307017543859649}', {"accuracy": 0.147076}],
        "exact": [True, False], "note": [None, "\x1b[31mRuntimeError\x1b[0m: boom"],
        "drift": [-0.0000001, 12345.678], "time_s": [0.000533, 0.25]})
    shown = frontend.table(frame)
    text = _text(shown)
    assert "nan" not in text.lower() and "None" not in text
    assert "{" not in text and "\x1b" not in text and "[31m" not in text
    assert "True" not in text and "False" not in text and "yes" in text and "no" in text
    assert "accuracy: 0.1307" in text and "0.3333" in text and "3145728" not in text
    assert "-0.000" not in text
    for number in re.findall(r"\d[\d.,]*", shown.to_string()):
        assert len(number.replace(",", "").replace(".", "").strip("0")) <= 4, number
    assert frontend.table(None) is None  # a table the settings left out (no planted faults)
    assert list(shown.columns) == ["peak (MiB)", "ratio", "metrics", "exact", "note", "drift",
                                   "time (ms)"]


def test_a_wide_table_is_one_table_never_cut_into_parts():
    frame = pd.DataFrame({"candidate": ["control", "checkpointed"],
                          **{f"column_number_{i}": [f"value {i} is long", 1.5]
                             for i in range(25)}})
    shown = frontend.table(frame)
    assert isinstance(shown, pd.DataFrame) and shown.shape == (2, 26)
    assert shown.columns[0] == "candidate"


def test_key_figures_have_labels_and_come_in_order():
    table = registry.figure_table({"targets_per_example_mean": 8.033, "flags": 0,
                                   "contributing_share": 0.3642}, "01_inspect_examples")
    assert list(table.index) == ["flags raised", "share of positions that carry a target",
                                 "targets per example (mean)"]
    assert frontend.figure_word("peak_bytes", 3 * 2**30) == "3.00 GiB"
    assert frontend.figure_word("cases", {"a": True, "b": None}) == "a: yes; b: -"


def test_a_headless_progress_bar_writes_nothing_to_stderr(monkeypatch, capsys):
    from workbook.base import progress

    monkeypatch.setenv(progress.HEADLESS_ENV, "1")
    bar = progress.progress_bar(total=3, initial=0, desc="lr 0.001 seed 0")
    for _ in range(3):
        bar.update(1)
        bar.set_postfix(loss="2.944", refresh=False)
    bar.close()
    quiet = progress.progress_bar(total=3, disable=True)
    quiet.update(1)
    quiet.close()
    out, err = capsys.readouterr()
    assert err == ""
    assert out == "lr 0.001 seed 0: 3 of 3 updates, loss 2.944\n"


def _summary(tmp_path, stem, summary):
    folder = tmp_path / f"20261201-101010-{stem}"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_the_last_line_says_why_a_notebook_passed_or_failed(tmp_path):
    gates = {"gates": 9, "failed": [], "warned": [], "plan": "mb16 x acc2 len1024 bf16",
             "plan_required_bytes": int(3.1 * 2**30), "plan_fits": True,
             "device_memory_gib": 24.0}
    line = verdict_line(_summary(tmp_path, "03_phase_gates", {"verdict": "pass",
                                                              "figures": gates}))
    assert line == ("verdict: pass - 9 of 9 gates passed; the plan mb16 x acc2 len1024 bf16 "
                    "needs 3.10 GiB and fits the 24 GiB rental GPU")
    failed = {**gates, "failed": ["backward"], "plan_fits": False}
    line = verdict_line(_summary(tmp_path, "03_phase_gates_", {"verdict": "fail",
                                                                "figures": failed}))
    assert line.startswith("verdict: fail - 8 of 9 gates passed (failed: backward)")
    assert "does not fit the 24 GiB rental GPU" in line
    sharded = {**gates, "plan_fits": False, "plan_needs_sharding": True,
               "plan_required_bytes": 316 * 2**30, "plan_update_required_bytes": 109 * 2**30,
               "device_memory_gib": 80.0}
    line = verdict_line(_summary(tmp_path, "03_phase_gates__", {"verdict": "pass",
                                                                 "figures": sharded}))
    assert line.endswith("needs 316.00 GiB and fits no single 80 GiB GPU: its first update "
                         "alone needs 109.00 GiB (weights, gradients, optimizer state), so the "
                         "campaign shards it - 08 sizes FSDP2 over several GPUs"), line
    refused = {**gates, "plan_refused": "planned length 256 exceeds the 64 positions"}
    line = verdict_line(_summary(tmp_path, "03_phase_gates___", {"verdict": "fail",
                                                                  "figures": refused}))
    assert line == ("verdict: fail - 9 of 9 gates passed; the plan is refused: planned length "
                    "256 exceeds the 64 positions")
    line = verdict_line(_summary(tmp_path, "02_overfit", {
        "verdict": "fail", "failed": ["final loss below threshold"], "diagnosis": "",
        "figures": {}}))
    assert line == "verdict: fail - failed: final loss below threshold"
    line = verdict_line(_summary(tmp_path, "01_inspect_examples", {
        "verdict": "fail", "flags": ["zero_target_examples"], "figures": {"examples": 10}}))
    assert line == "verdict: fail - 1 flag raised: zero_target_examples"
    fsdp = {"rules": {"every rank writes its shard": "pass"}, "memory_max_abs_error_pct": 0.08}
    ddp = {"verdict": "pass", "rules": {"identical initial parameters": "pass"},
           "figures": {"replicas": 2, "faults_caught": {}, "fsdp": fsdp}}
    line = verdict_line(_summary(tmp_path, "09_data_parallel", ddp))
    assert line.endswith("FSDP2: all 1 rules hold, per-rank memory within 2% of the prediction")
    fsdp["memory_max_abs_error_pct"] = 21.46
    line = verdict_line(_summary(tmp_path, "09_data_parallel_", ddp))
    assert line.endswith("per-rank memory up to 21.5% off the prediction")
    for line in [verdict_line(tmp_path / "nothing")]:
        assert line.startswith("verdict: unknown")


def test_full_text_shows_every_column_of_a_wide_table():
    frame = pd.DataFrame({f"column_{i}": [i] for i in range(44)})  # 08's sheet has 44
    with pd.option_context("display.max_columns", 20, "display.max_colwidth", 50):
        frontend.show_full_text()
        html = frame.to_html() if pd.get_option("display.max_columns") is None else ""
        assert pd.get_option("display.max_colwidth") is None
        assert "column_43" in html and "..." not in frame._repr_html_()
