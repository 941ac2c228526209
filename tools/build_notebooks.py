import nbformat as nbf
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

def nb(cells):
    n = new_notebook(cells=cells)
    n.metadata["kernelspec"] = {"name": "workbook", "display_name": "Python (workbook)", "language": "python"}
    n.metadata["language_info"] = {"name": "python"}
    return n

def params(src):
    c = new_code_cell(src); c.metadata["tags"] = ["parameters"]; return c

md = new_markdown_cell; code = new_code_cell

nb01 = nb([
md("""# 01 - Inspect examples: what does the loss really receive?

Before any GPU is rented, look at the tensors exactly as the loss function gets them. Two mistakes
cost the most and stay invisible in a loss curve:

- **the loss is computed over the wrong positions** - padding, or the instruction part of a
  prompt/response pair when only the response should be learned;
- **the class-id mapping is shifted** - the loss is finite and falls, but the model learns a
  different task.

This notebook encodes and collates the task's examples, shows which positions count, audits the
label ids against the raw labels, and checks that train / validation / test are separated by the
task's *group key* (conversation, patient, source document, period), so that nothing leaks.
Any finding is a **flag**; a flag fails the verdict."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory, e.g. {"max_length": 64}
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # inspection runs on the CPU; kept for a uniform interface
seed = 0
show_examples = 4  # examples rendered position by position
probe_size = 8  # examples used to probe the loss function"""),
code("""import workbook as wb

p = wb.params.check(globals(), "01_inspect_examples")
t = wb.load_task(p["task"], **p["task_options"])
out = wb.runs.notebook_dir(p["out_dir"], "01_inspect_examples")
print(f"task {t.name!r} ({t.kind}), group key {t.group_key!r}; writing to {out}")"""),
md("""## Splits, by group
Every example belongs to a group; a group lives in exactly one split. The audit below counts the
examples and groups per split and flags any group, or any identical input, found in two splits."""),
code("""ins = wb.inspection.inspect_task(t, probe_size=p["probe_size"])
ins.split_table"""),
md("""## Examples as the loss receives them
For a sequence task every position shows the *target* it is trained to predict. Green positions
contribute to the loss; grey ones are the prompt (excluded unless the task says otherwise);
struck-through ones are padding. A red box would mark a position that counts although it should
not. For a classification task the table shows the decoded input and its label id and class."""),
code("""wb.inspection.example_display(t, ins.items["train"][: p["show_examples"]])"""),
md("""The same, as numbers, for the first example: input id and token, label id and target token,
attention mask, and whether the position counts."""),
code("""wb.inspection.batch_view(t, ins.items["train"][:1]).head(24)"""),
md("""Browse any training example (in JupyterLab this is a slider; a headless run keeps the static
view above)."""),
code("""# NBVAL_IGNORE_OUTPUT
wb.inspection.browser(t, ins.items["train"]);"""),
md("""## Loss coverage
What share of the real (non-padding) positions contributes, how many targets each example gives,
examples that contribute nothing (often after truncation), and targets that fall on padding or on
an excluded prompt. `expected_initial_loss` is ln(number of outputs): an untrained model should
start near it (notebook 02 checks this)."""),
code("""ins.figure_table()"""),
code("""wb.plots.coverage_histogram(ins.coverage, save=out / "coverage.png")"""),
md("""## Labels and classes
Each encoded label id is decoded back and compared with the raw label; ids the model cannot output
are flagged. For classification the class histogram per split shows whether a rare class reaches
every split."""),
code("""ins.classes if ins.classes is not None else "no classes: this is a sequence task\""""),
code("""if ins.classes is not None:
    display(wb.plots.class_histogram(ins.classes, save=out / "classes.png"))"""),
md("""## Flags and verdict
Each flag names what was found, how often, a few example ids and the fix."""),
code("""ins.flag_table()"""),
code("""wb.inspection.save(ins, out)
print(f"verdict: {ins.verdict} ({len(ins.flags)} flags)")"""),
])

nb02 = nb([
md("""# 02 - Overfit a tiny subset

Take a handful of training examples and train on them until they are memorised. This proves the
**mechanics**, not generalisation: the loop learns, the values stay finite, and the trained model
gives back the exact target ids. If this fails on eight examples, a long rental will not fix it.

The checks:
- the loss of the untrained model is near ln(number of outputs), the loss of a model that spreads
  its probability evenly - far off means a wrong scale, a wrong target or a wrong normalisation;
- the loss (and gradient norm) is finite at every update;
- the final loss on the subset is below a threshold;
- the argmax at every contributing position equals the target id. With teacher forcing this is
  the same as greedy decoding reproducing the whole response; for the generation sample greedy
  decoding is run too and shown."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # "cpu", "cuda" or "auto"
seed = 0
examples = 8  # size of the subset to memorise
updates = 150  # optimizer updates (the whole subset is one micro-batch)
lr = 3e-3  # learning rate for the overfit run only
loss_threshold = 0.05  # final loss on the subset must fall below this
init_tolerance = 0.25  # allowed relative gap between initial loss and ln(outputs)"""),
code("""import workbook as wb

p = wb.params.check(globals(), "02_overfit")
t = wb.load_task(p["task"], **p["task_options"])
out = wb.runs.notebook_dir(p["out_dir"], "02_overfit")
print(f"task {t.name!r} ({t.kind}); writing to {out}")"""),
code("""# NBVAL_IGNORE_OUTPUT
res = wb.overfit.overfit(t, examples=p["examples"], updates=p["updates"], lr=p["lr"],
                         loss_threshold=p["loss_threshold"], init_tolerance=p["init_tolerance"],
                         seed=p["seed"], device=p["device"], progress=True)
res.checks"""),
md("""The verdict checks (their measured values are in the table above):"""),
code("""res.checks[["check", "expected", "passed"]]"""),
md("""What the trained model gives back for each example of the subset:"""),
code("""res.reproduction"""),
code("""wb.plots.loss_curve(res.steps, threshold=p["loss_threshold"],
                    expected_initial=res.figures["expected_initial_loss"],
                    title=f"overfitting {res.figures['examples']} examples", save=out / "loss.png")"""),
code("""wb.overfit.save(res, out, t)
print(f"verdict: {res.verdict}")"""),
])
nbf.write(nb01, "/work/main/notebooks/01_inspect_examples.ipynb")
nbf.write(nb02, "/work/main/notebooks/02_overfit.ipynb")
