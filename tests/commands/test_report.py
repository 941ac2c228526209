"""report.html: one page a person decides from - verdicts first, then the decision, then each
notebook with its figures - in human units, with nothing empty or NaN, and readable offline."""

import json
from html.parser import HTMLParser

import pandas as pd

from workbook.commands.report import human, write_report


class Page(HTMLParser):
    """Headings in order, images, and the text of table cells."""

    def __init__(self):
        super().__init__()
        self.headings, self.images, self.cells, self._in = [], [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("h1", "h2", "h3", "td", "th"):
            self._in = tag
            if tag in ("h1", "h2", "h3"):
                self.headings.append("")
            else:
                self.cells.append("")
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "div" and "overall" in attrs.get("class", ""):
            self.headings.append("BANNER")

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in in ("h1", "h2", "h3"):
            self.headings[-1] += data
        elif self._in in ("td", "th"):
            self.cells[-1] += data


def _run(tmp_path):
    """A small run folder as the pilot leaves it: two notebooks, a figure, gates, a plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gates = tmp_path / "03_phase_gates"
    gates.mkdir()
    pd.DataFrame({"phase": ["data", "backward"], "peak_allocated_bytes": [1450776, 3 * 2**20],
                  "peak_reserved_bytes": [None, None], "time_s": [0.000533, 0.25],
                  "verdict": ["pass", "pass"], "detail": ["", "ok"]}).to_csv(
        gates / "gates.csv", index=False)
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    fig.savefig(gates / "gates.png")
    (gates / "summary.json").write_text(json.dumps(
        {"verdict": "pass", "figures": {"peak_allocated_bytes": 3 * 2**20, "ratio": 0.123456,
                                        "failed": []}}))
    plan = tmp_path / "08_rental_plan"
    plan.mkdir()
    (plan / "conclusion.md").write_text("# Rental decision\n\n**Rent an L4** for **control**.\n")
    (plan / "summary.json").write_text(json.dumps({"verdict": "fail", "figures": {}}))
    pd.DataFrame({"days": [3], "variant": ["control"], "hours": [1.5], "cost": [2.0],
                  "scheduled": [True], "why_not": ["-"]}).to_csv(plan / "plan.csv",
                                                                  index=False)
    return pd.DataFrame([
        {"notebook": "03_phase_gates", "verdict": "pass", "seconds": 11.3,
         "executed": "03_phase_gates.ipynb", "error": ""},
        {"notebook": "08_rental_plan", "verdict": "fail", "seconds": 7.8,
         "executed": "08_rental_plan.ipynb", "error": ""}])


def test_the_report_reads_in_order_with_figures_and_units(tmp_path):
    index = _run(tmp_path)
    page = Page()
    page.feed(write_report(tmp_path, index, "my.task:task").read_text())
    order = [h for h in page.headings if h]
    assert order[:3] == ["Pilot report: my.task:task", "BANNER", "Decision"], order
    assert order.index("Decision") < order.index("03 Phase gates: pass (11.3 s)") < \
        order.index("08 Rental plan: fail (7.8 s)")
    assert any(src.startswith("data:image/png;base64,") for src in page.images), \
        "figures are embedded, so the one file can be mailed"
    text = " ".join(page.cells)
    assert "peak allocated (MiB)" in text and "3.0" in text and "1450776" not in text
    assert "time (ms)" in text or "time (s)" in text
    assert "peak reserved" not in text, "an all-empty column is left out"
    assert "nan" not in text.lower() and "0.1235" in text
    assert "peak allocated in the gates 3.00 MiB" in " ".join(
        page.cells[i] + " " + page.cells[i + 1] for i in range(len(page.cells) - 1))


def test_paths_into_the_run_folder_read_relative_to_it_on_the_page(tmp_path):
    """A run folder outside the repository (under /tmp): an error naming one of its files, and
    the executed notebook's out_dir parameter, read as a reader of the page opens them."""
    import nbformat

    run = tmp_path / "run"
    run.mkdir()
    index = _run(run)
    index.loc[1, ["verdict", "error"]] = ["error", f"WorkbookError: {run}/08_rental_plan/"
                                          "summary.json is not valid JSON"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f'out_dir = "{run}/03_phase_gates"', outputs=[nbformat.v4.new_output(
            "stream", text=f"writing to {run}/03_phase_gates\n")])])
    nbformat.write(notebook, run / "03_phase_gates.ipynb")
    report = write_report(run, index, "my.task:task").read_text()
    assert "WorkbookError: 08_rental_plan/summary.json is not valid JSON" in report
    executed = (run / "03_phase_gates.html").read_text()
    assert "writing to 03_phase_gates" in executed and '"03_phase_gates"' in executed
    assert f"{run}/" not in report + executed


def test_human_units_never_show_nan():
    frame = human(pd.DataFrame({"x_bytes": [2**20, None], "why_not": [None, "too long"],
                                "empty": [None, None]}))
    assert list(frame.columns) == ["x (MiB)", "why not"]
    assert frame.astype(str).apply(lambda c: c.str.lower().str.contains("nan")).sum().sum() == 0


class Decision(HTMLParser):
    """The text of the decision section, in order."""

    def __init__(self):
        super().__init__()
        self.depth, self.text = 0, []

    def handle_starttag(self, tag, attrs):
        if self.depth or (tag == "div" and dict(attrs).get("class") == "decision"):
            self.depth += tag == "div"

    def handle_endtag(self, tag):
        if self.depth and tag == "div":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth and data.strip():
            self.text.append(data.strip())


HEADLINE = ("your learning rate diverges: the loss rose from 1.51 to 1.142e+15 within the first "
            "3 updates at lr 1000 (the task's Task.lr); try 0.001 <b>")


def test_a_diverging_learning_rate_leads_the_decision(tmp_path):
    index = _run(tmp_path)
    fit = tmp_path / "02_overfit"
    fit.mkdir()
    (fit / "summary.json").write_text(json.dumps(
        {"verdict": "fail", "figures": {"lr": 1000.0, "lr_from": "task", "lr_diverges": True},
         "failed": ["learning rate does not diverge"], "headline": HEADLINE}))
    index = pd.concat([index.iloc[:1], pd.DataFrame([
        {"notebook": "02_overfit", "verdict": "fail", "seconds": 0.4,
         "executed": "02_overfit.ipynb", "error": ""}]), index.iloc[1:]])
    html = write_report(tmp_path, index, "my.task:task").read_text()
    decision = Decision()
    decision.feed(html)
    assert decision.text[0] == HEADLINE, decision.text
    assert "Rental decision" in decision.text[1:], "08's conclusion follows it"
    assert "<b>" not in html.split('class="decision">')[1].split("</p>")[0], "escaped"


def test_the_decision_exists_for_a_diverging_learning_rate_without_a_plan(tmp_path):
    fit = tmp_path / "02_overfit"
    fit.mkdir()
    (fit / "summary.json").write_text(json.dumps({"verdict": "fail", "figures": {},
                                                  "headline": HEADLINE}))
    (tmp_path / "01_inspect_examples").mkdir()
    (tmp_path / "01_inspect_examples" / "summary.json").write_text("{not json")
    index = pd.DataFrame([{"notebook": s, "verdict": v, "seconds": 0.1, "executed": f"{s}.ipynb",
                           "error": ""} for s, v in [("01_inspect_examples", "pass"),
                                                     ("02_overfit", "fail")]])
    page, decision = Page(), Decision()
    html = write_report(tmp_path, index, "t:task").read_text()
    page.feed(html)
    decision.feed(html)
    assert [h for h in page.headings if h][:3] == ["Pilot report: t:task", "BANNER", "Decision"]
    assert decision.text == [HEADLINE]


def test_no_headline_no_decision_without_a_plan(tmp_path):
    (tmp_path / "02_overfit").mkdir()
    (tmp_path / "02_overfit" / "summary.json").write_text(json.dumps(
        {"verdict": "pass", "figures": {"lr": 0.003, "lr_from": "fallback"}}))
    index = pd.DataFrame([{"notebook": "02_overfit", "verdict": "pass", "seconds": 0.1,
                           "executed": "02_overfit.ipynb", "error": ""}])
    page = Page()
    page.feed(write_report(tmp_path, index, "t:task").read_text())
    assert "Decision" not in page.headings


def test_key_figures_read_as_words_and_the_rented_shape_is_said_to_be_predicted(tmp_path):
    index = _run(tmp_path)
    (tmp_path / "03_phase_gates" / "summary.json").write_text(json.dumps(
        {"verdict": "pass", "figures": {
            "plan_fits": None, "states_restored": False, "overlap": True,
            "faults": {"checkpoint by rank 0 only": True, "tied after sharding": None},
            "ran_at": "mb2 x acc1 lendata fp32 on cpu", "plan": "mb16 x acc2 len1024 bf16",
            "models": ["pilot twin (trained here): X, 1.00 M parameters",
                       "campaign model (sized on fake tensors, never allocated here): X, "
                       "6.74 B parameters"]}}))
    page = Page()
    page.feed(write_report(tmp_path, index, "t:task").read_text())
    text = " ".join(page.cells)
    assert "not judged: no device memory given" in text
    assert "states restored no" in " ".join(page.cells[i] + " " + page.cells[i + 1]
                                            for i in range(len(page.cells) - 1))
    assert "checkpoint by rank 0 only: yes; tied after sharding: -" in text
    for word in ("True", "False", "None", "..."):
        assert word not in text, word
    html = (tmp_path / "report.html").read_text()
    decision = html[html.index('id="decision"'):html.index('id="03_phase_gates"')]
    assert "The gates ran mb2 x acc1 lendata fp32 on cpu; the rented shape mb16 x acc2 len1024 " \
        "bf16 was predicted on fake tensors, not run." in decision
    assert "Campaign model (sized on fake tensors" not in decision, "08's conclusion says it"
    (tmp_path / "08_rental_plan" / "summary.json").unlink()  # a run without 08
    page = write_report(tmp_path, index, "t:task").read_text()
    assert "Campaign model (sized on fake tensors, never allocated here)" in page[
        page.index('id="decision"'):page.index('id="03_phase_gates"')]


def test_the_fsdp_rules_and_planted_faults_are_shown_when_09_ran_them(tmp_path):
    folder = tmp_path / "09_data_parallel"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"verdict": "pass", "figures": {}}))
    pd.DataFrame({"rule": ["only rank 0 writes"], "verdict": ["pass"], "measured": ["ok"],
                  "remediation": ["-"]}).to_csv(folder / "rules.csv", index=False)
    index = pd.DataFrame([{"notebook": "09_data_parallel", "verdict": "pass", "seconds": 1.0,
                           "executed": "09_data_parallel.ipynb", "error": ""}])
    page = write_report(tmp_path, index, "t").read_text()
    assert "Rules under FSDP2 sharding" not in page and "09 Data parallel under torchrun" in page
    (folder / "summary.json").write_text(json.dumps({"verdict": "pass", "figures": {"fsdp": {
        "not_run": "FSDP2 not run: under fully_shard the model's operation aten.x <b>"}}}))
    page = write_report(tmp_path, index, "t").read_text()
    assert "FSDP2 not run: under fully_shard the model&#39;s operation aten.x &lt;b&gt;" in page
    pd.DataFrame({"rule": ["every rank writes its shard of the checkpoint"],
                  "verdict": ["pass"], "measured": ["2 shards"], "remediation": ["-"]}).to_csv(
        folder / "fsdp_rules.csv", index=False)
    pd.DataFrame({"planted bug": ["checkpoint saved by rank 0 only under FSDP"],
                  "caught": [True]}).to_csv(folder / "fsdp_planted_faults.csv", index=False)
    page = write_report(tmp_path, index, "t").read_text()
    assert "Rules under FSDP2 sharding" in page and "every rank writes its shard" in page
    assert "checkpoint saved by rank 0 only under FSDP" in page and ">yes<" in page


def test_key_figures_come_in_order_of_importance_with_labels_and_units(tmp_path):
    index = _run(tmp_path)
    (tmp_path / "03_phase_gates" / "summary.json").write_text(json.dumps(
        {"verdict": "pass", "figures": {
            "overheads": "assumed", "peak_allocated_bytes": 3 * 2**20, "plan_fits": True,
            "device_memory_gib": 80.0, "gates": 9, "failed": [],
            "plan_required_bytes": 3 * 2**30}}))
    page = Page()
    page.feed(write_report(tmp_path, index, "t:task").read_text())
    cells = page.cells
    start = cells.index("gates run")
    labels = cells[start:start + 14:2]
    assert labels == ["gates run", "gates failed", "plan fits the rental GPU",
                      "rental GPU memory (GiB)", "plan needs (with headroom)",
                      "peak allocated in the gates", "CUDA overheads"], labels
    values = dict(zip(cells[start::2], cells[start + 1::2], strict=False))
    assert values["plan fits the rental GPU"] == "yes"
    assert values["plan needs (with headroom)"] == "3.00 GiB"
    assert values["gates failed"] == "none"


def _rental(run, failed_stem=None):
    """08's folder as a run leaves it (two GPUs priced, one run per variant, a stack with
    CUDA unverified, launch files for the recommended plan) and the index of 03, 08 (and a
    failed notebook)."""
    plan = run / "08_rental_plan"
    plan.mkdir(parents=True)
    (plan / "summary.json").write_text(json.dumps({"verdict": "pass", "figures": {
        "chosen": "control", "recommended_gpu": "H100", "recommended_gpus": 8,
        "recommended_strategy": "FSDP2 full sharding x8", "not_sized": []}}))
    (plan / "conclusion.md").write_text("# Rental decision\n\n**Rent 8 x H100** because.\n")
    rows = [{"candidate": "control", "gpu": g, "fits": True, "gpus": n, "strategy": s,
             "budget_hours": h, "budget_hours_low": h * 0.8, "budget_hours_high": h * 1.3,
             "cost": c, "cost_low": c * 0.8, "cost_high": c * 1.3, "spot_cost": c / 3,
             "gpu_hours": h * n, "currency": "USD", "note": "x" * 300}
            for g, n, s, h, c in (("H100", 8, "FSDP2 full sharding x8", 10.0, 250.0),
                                  ("A100-80GB", 16, "FSDP2 full sharding x16 (2 nodes of 8)",
                                   14.0, 380.0))]
    pd.DataFrame(rows).to_csv(plan / "selection.csv", index=False)
    pd.DataFrame([{"days": d, "priced_on": role, "variant": "control", "candidate": "control",
                   "gpu": g, "gpus": n, "strategy": "FSDP2", "repeats": 3, "hours": 30.0,
                   "hours_low": 24.0, "hours_high": 39.0, "cost": 750.0, "cost_low": 600.0,
                   "cost_high": 975.0, "spot_cost": 250.0, "scheduled": True, "why_not": "-"}
                  for g, n, role in (("H100", 8, "recommended"), ("A100-80GB", 16, "planned on"))
                  for d in (3, 7, 30)]).to_csv(plan / "plan.csv", index=False)
    pd.DataFrame([{"item": "CUDA", "here": "none", "verified": False, "on the rental": "-",
                   "notebook": "03_phase_gates"}]).to_csv(plan / "stack.csv", index=False)
    (plan / "launch" / "recommended").mkdir(parents=True)
    (plan / "launch" / "recommended" / "sky.yaml").write_text("name: x\n")
    (plan / "launch" / "index.json").write_text(json.dumps({
        "entry_point_is_placeholder": True, "not_written": {"slow-L4": "does not fit <b>"},
        "plans": [{"name": "recommended", "files": {"sky": "launch/recommended/sky.yaml"}}]}))
    (run / "03_phase_gates").mkdir()
    (run / "03_phase_gates" / "summary.json").write_text(json.dumps({"verdict": "pass"}))
    index = [("03_phase_gates", "pass"), ("08_rental_plan", "pass")]
    if failed_stem:
        (run / failed_stem).mkdir()
        (run / failed_stem / "summary.json").write_text(json.dumps({"verdict": "error"}))
        index.append((failed_stem, "error"))
    return pd.DataFrame([{"notebook": s, "verdict": v, "seconds": 1.0, "executed": f"{s}.ipynb",
                          "error": ""} for s, v in index])


def test_the_decision_reads_at_a_glance_and_the_reasoning_is_folded(tmp_path):
    html = write_report(tmp_path, _rental(tmp_path), "t:task").read_text()
    decision = Decision()
    decision.feed(html)
    line = decision.text[0]
    assert line == ("Rent 8 x H100 (FSDP2 full sharding x8) for candidate control: 3 runs of 1 "
                    "variant in 30.0 (24.0-39.0) h, USD 750.00 (600.00-975.00) on demand, USD "
                    "250.00 on spot (interruptions included)."), line
    box = html[html.index('class="decision"'):html.index('id="03_phase_gates"')]
    assert box.index('class="line"') < box.index("<table") < box.index("data:image/png") < \
        box.index("Open risks") < box.index("<details>") < box.index("Rent 8 x H100</strong>")
    assert '<a href="08_rental_plan/launch/recommended/sky.yaml">sky.yaml</a>' in box
    assert "slow-L4: no launch file - does not fit &lt;b&gt;" in box
    assert '<a href="#03_phase_gates">03</a>: CUDA memory counters' in box
    assert "the launch files run train.py, a placeholder" in box
    page = Page()
    page.feed(box)
    assert page.cells[:8] == ["GPUs", "strategy", "priced as", "days", "runs", "hours",
                              "on demand", "on spot"]
    assert page.cells[8:12] == ["8 x H100", "FSDP2", "recommended", "3, 7, 30"], \
        "days that schedule the same runs share a row"
    assert "part 1 of" not in html, "no table is cut into parts"
    assert html.count('<table class="sheet') == html.count('<div class="scroll"><table'
                                                           ' class="sheet')


def test_a_notebook_that_did_not_pass_leads_the_line_and_the_risks(tmp_path):
    html = write_report(tmp_path, _rental(tmp_path, "07_resume_reload"), "t:task").read_text()
    decision = Decision()
    decision.feed(html)
    assert decision.text[0].startswith("Do not rent yet: notebook 07 did not pass"), \
        decision.text[0]
    assert '<a href="#07_resume_reload">07</a>: 07 Resume and reload: error' in html


def test_the_chart_without_prices_plots_gpu_hours_and_an_old_folder_still_reports(tmp_path):
    from workbook.notebooks.rental import glance

    index = _rental(tmp_path)
    sheet = pd.read_csv(tmp_path / "08_rental_plan" / "selection.csv")
    points = glance.chart_points(sheet.assign(cost=None, cost_low=None, cost_high=None,
                                              spot_cost=None),
                                 {"chosen": "control", "recommended_gpu": "H100"})
    assert points[["gpu", "kind", "recommended"]].values.tolist() == [
        ["H100", "FSDP2 full sharding", True], ["A100-80GB", "FSDP2 full sharding", False]]
    assert glance.chart(points).startswith(b"\x89PNG")
    # a plan table from before `priced_on`: the line from the sheet, no plan table, no crash
    pd.DataFrame({"days": [3], "variant": ["control"], "hours": [1.5]}).to_csv(
        tmp_path / "08_rental_plan" / "plan.csv", index=False)
    html = write_report(tmp_path, index, "t:task").read_text()
    assert "Rent 8 x H100 (FSDP2 full sharding x8) for candidate control: one run in 10.0 " \
        "(8.0-13.0) h, USD 250.00 (200.00-325.00) on demand, USD 83.33 on spot." in html
    assert 'class="sheet plans"' not in html


def test_a_study_that_passed_unsettled_is_a_provisional_chip_and_floored_times_are_bars(
        tmp_path):
    """06 passed but its study is provisional: its chip says so in amber, not a plain green
    pass. Every GPU held at the launch floor: the chart shows cost per GPU as bars (a scatter
    of one x says nothing) and the line says there is no speed range."""
    from workbook.notebooks.rental import glance

    index = _rental(tmp_path)
    (tmp_path / "06_lr_study").mkdir()
    (tmp_path / "06_lr_study" / "summary.json").write_text(json.dumps(
        {"verdict": "pass", "figures": {"conclusive": False}}))
    index = pd.concat([index, pd.DataFrame([{"notebook": "06_lr_study", "verdict": "pass",
                                             "seconds": 1.0, "executed": "06_lr_study.ipynb",
                                             "error": ""}])])
    html = write_report(tmp_path, index, "t:task").read_text()
    assert "06 pass, provisional</a>" in html and "03 pass</a>" in html
    sheet = pd.read_csv(tmp_path / "08_rental_plan" / "selection.csv")
    flat = sheet.assign(budget_hours=0.09, budget_hours_low=0.09, budget_hours_high=0.09,
                        time_floored=True)
    points = glance.chart_points(flat, {"chosen": "control", "recommended_gpu": "H100"})
    png = glance.chart(points)
    height = int.from_bytes(png[20:24], "big")  # the PNG header's height: bars are short
    assert png.startswith(b"\x89PNG") and height < 200, height
    assert "no speed range and the GPUs differ only in price" in glance.floored(flat)
    assert glance.floored(sheet) == ""
