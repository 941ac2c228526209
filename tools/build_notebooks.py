"""The notebooks' source: `python tools/build_notebooks.py` writes notebooks/NN_*.ipynb
without outputs; then execute them (see README) so the committed copies carry outputs."""

import sys
from pathlib import Path

import nbformat as nbf
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def nb(cells):
    n = new_notebook(cells=cells)
    n.metadata["kernelspec"] = {"name": "workbook", "display_name": "Python (workbook)",
                                "language": "python"}
    n.metadata["language_info"] = {"name": "python"}
    return n


def params(src):
    """The papermill parameters cell: plain literals only."""
    c = new_code_cell(src)
    c.metadata["tags"] = ["parameters"]
    return c


md = new_markdown_cell
code = new_code_cell

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
init_tolerance = 0.5  # allowed relative gap between initial loss and ln(outputs)"""),
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

nb03 = nb([
md("""# 03 - Phase gates: every operation of the campaign, one row each

Sizing a rental from the weights alone is the classic mistake. The first optimizer update
allocates the optimizer state, so it can need more than the steps before it; evaluation at
longer sequences can make the largest peak; saving or exporting a checkpoint needs memory, disk
and time too. So the pilot passes **every phase** through a gate and keeps one row per phase:
the inputs (micro-batch, sequence length, precision, eval batch, device), the memory counters,
the measured time and a verdict with the remediation when it fails.

| phase | checks |
|---|---|
| data | ids, targets, lengths, masks, dtypes and shapes; the longest input; data-wait share |
| forward + loss | dimensions, a finite loss near its untrained value (the module that made a NaN) |
| backward | every trainable parameter gets a finite gradient |
| update (first), update (later) | the targeted parameters change, frozen ones do not, the step counter advances, the LR is as scheduled |
| validation | eval mode really on (two passes agree, a batch's companions do not matter), no gradients, each example predicted once |
| checkpoint save, export | time, size, memory while saving |
| resume | a fresh model and optimizer loaded from the checkpoint hold the same state, and the next update equals the uninterrupted run's |

**Memory counters.** On CUDA the caching allocator keeps two counters: *allocated* (bytes in
live tensors) and *reserved* (bytes it holds from the driver, allocated ones included). They are
separate columns and are never added: reserved already contains allocated. Peaks are reset and
the device synchronised around each phase. On the CPU there is no allocator cache; the
*live-tensor peak* is rebuilt from PyTorch's profiler allocation events, and the process
resident-set high-water mark (RSS) is recorded beside it as a **different quantity** (it also
holds the interpreter, libraries and freed-but-kept pages), never as a proxy.

**Prediction.** The same phases run again on *fake tensors* (shapes, no storage) under
PyTorch's `MemTracker`, which predicts each phase's peak and its breakdown (parameters,
gradients, optimizer state, activations, temporaries) for a configuration far larger than this
machine - micro-batch 16 at length 4096 on a laptop."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory (e.g. {"context": 4096})
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # "cpu", "cuda" or "auto"
seed = 0
micro_batch = 2  # the gates run at these pilot settings
accumulation = 8
eval_batch = 16
length = 0  # positions per training sequence (0: the data's longest; longer ones are tiled)
precision = "fp32"  # "fp32", "bf16" or "fp16" (CUDA)
activation_checkpointing = False
lr = 1e-3
device_memory_gib = 0.0  # the rental GPU's memory; 0: no limit stated
headroom = 0.2  # share kept free on top of every peak
input_bound_threshold = 0.3  # data-wait share of an update above which the data gate warns
train_limit = 0  # use only the first N training examples (0: all)
plan_micro_batch = 16  # the configuration to size for the rental (predicted, not run)
plan_accumulation = 2
plan_length = 1024  # positions per sequence (0: the data's longest)
plan_eval_batch = 32
plan_precision = "bf16"
plan_activation_checkpointing = False
cuda_context_gib = 1.0  # assumed CUDA context + library workspaces when no GPU measured it
allocator_cache_share = 0.1  # assumed reserved/allocated - 1 when no GPU measured it"""),
code("""import workbook as wb

p = wb.params.check(globals(), "03_phase_gates")
t = wb.load_task(p["task"], **p["task_options"])
out = wb.runs.notebook_dir(p["out_dir"], "03_phase_gates")
settings = wb.gates.GateSettings.from_params(p)
print(f"task {t.name!r}; writing to {out}")"""),
md("""## The gates
The full table (times, counters and details vary from run to run):"""),
code("""# NBVAL_IGNORE_OUTPUT
report = wb.gates.run_gates(t, settings, out, train_limit=p["train_limit"] or None)
report.table()[["phase", "counter", "baseline_bytes", "peak_allocated_bytes",
                "peak_reserved_bytes", "rss_peak_bytes", "time_s", "verdict", "detail"]]"""),
md("""Inputs and verdict per phase (memory in MiB; on the CPU `peak_reserved` stays empty, since
there is no allocator cache to report):"""),
code("""# NBVAL_IGNORE_OUTPUT
wb.gates.display_table(report)"""),
code("""report.table()[["phase", "verdict", "remediation"]]"""),
code("""wb.plots.gate_memory(report.table(), save=out / "gates.png")"""),
md("""### Input pipeline
Per update, the share of time spent waiting for data rather than computing. The data gate warns
above the threshold and names the usual causes: data not next to the process, expensive online
preprocessing, a synchronisation that blocks prefetching."""),
code("""# NBVAL_IGNORE_OUTPUT
report.pipeline"""),
md("""## Prediction against measurement, at the pilot settings
The fake-tensor prediction of each training phase beside the measured live-tensor peak."""),
code("""# NBVAL_IGNORE_OUTPUT
measured_plan = wb.predict.predict(t, report.train_items, report.val_items, settings.plan(),
                                   device=str(wb.loop.resolve_device(p["device"])))
check = wb.predict.compare(measured_plan, report.table())
check"""),
md("""## Sizing the rental configuration, without allocating it
The planned configuration is predicted on fake tensors. The breakdown is taken at each phase's
peak. For the device, the prediction is not enough: the CUDA caching allocator keeps a cache
(reserved minus allocated) and the CUDA context and libraries (cuBLAS, cuDNN workspaces) take
memory outside the allocator. With a GPU at hand both are measured; otherwise the stated
assumptions are used, and the table says so."""),
code("""plan = wb.predict.Plan.from_params(p)
planned = wb.predict.predict(t, report.train_items, report.val_items, plan,
                             device=str(wb.loop.resolve_device(p["device"])))
planned.assign(**{c.replace("_bytes", "_mib"): (planned[c] / 2**20).round(2)
                  for c in planned.columns if c.endswith("_bytes")}).filter(regex="phase|_mib")"""),
code("""overheads = wb.predict.Overheads.of(wb.loop.resolve_device(p["device"]), report.table(),
                                   p["cuda_context_gib"], p["allocator_cache_share"])
fit = wb.predict.fit_table(planned, p["device_memory_gib"], p["headroom"], overheads)
fit"""),
md("""The rule of thumb "4 x model size" (weights, gradients, two Adam states) against the
prediction: it sees no activations and no temporaries."""),
code("""rule = wb.predict.model_size_rule(t.build_model())
planned[["phase", "predicted_peak_bytes"]].assign(
    four_x_model_bytes=rule,
    rule_error_pct=(100 * (rule - planned.predicted_peak_bytes) / planned.predicted_peak_bytes)
    .round(1))"""),
code("""fits = None if not p["device_memory_gib"] else bool(fit.fits.all())
wb.runs.save_table(fit, out, "plan_fit")
verdict = wb.gates.save(report, out, t, {
    "prediction_max_abs_error_pct": float(check.error_pct.abs().max()),
    "plan": plan.label(), "plan_peak_bytes": int(planned.predicted_peak_bytes.max()),
    "plan_required_bytes": int(fit.required_bytes.max()), "plan_fits": fits,
    "overheads": "measured" if overheads.measured else "assumed"}, fits=fits)
print(f"verdict: {verdict}")"""),
])

nb04 = nb([
md("""# 04 - Batch accounting: how many examples one update sees

A **micro-batch** is processed in one forward/backward pass. **Accumulation** adds the gradients
of several passes before one optimizer update. **Data replicas** (data parallelism) each process
their own micro-batches, so they multiply the examples of an update; model parallelism splits one
model over devices and does not. On one GPU with micro-batch 2 and accumulation 8, an update
sees 16 examples; 3,200 examples in one pass without partial batches make 200 updates. These
sums predict neither duration nor quality.

Holding the number of updates fixed while changing the batch changes how many examples are
learned; holding epochs fixed changes the number of updates. Choose what a comparison holds
fixed, and record the rest. Two well-known bugs live here: accumulation normalised per
micro-batch instead of per target token (1 x 32 then trains differently from 32 x 1), and a final
partial accumulation group scaled by the configured count instead of its real size. The loop
divides the summed loss by the targets of the whole update, so neither can happen; this notebook
checks it on your task."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # the counting runs on the CPU; kept for a uniform interface
seed = 0
micro_batch = 2  # examples per forward/backward pass (per replica)
accumulation = 8  # passes per optimizer update
replicas = 1  # data-parallel replicas
drop_partial = False  # drop the examples that do not fill a whole update
hold = "epochs"  # what the budget holds fixed: "updates", "examples" or "epochs"
budget = 1.0  # how many of them
reconcile_updates = 30  # updates of the real loop compared with the calculator
reconcile_examples = 45  # on this many examples, so the updates cross passes and meet partial ones
check_examples = 16  # examples of the normalisation check (1 x N, 2 x N/2, N x 1)
partial_examples = 13  # a second check on a final partial group
tolerance = 1e-4  # allowed relative gradient deviation"""),
code("""import pandas as pd

import workbook as wb

p = wb.params.check(globals(), "04_batch_accounting")
t = wb.load_task(p["task"], **p["task_options"])
out = wb.runs.notebook_dir(p["out_dir"], "04_batch_accounting")
splits = wb.split_examples(t, wb.load_examples(t))
items = wb.encode_examples(t, splits["train"])
targets_per_example = sum(int((it.tensors["labels"] != -100).sum()) for it in items) / len(items)
print(f"task {t.name!r}: {len(items)} training examples, {targets_per_example:.2f} targets each "
      f"on average; writing to {out}")"""),
md("""## The calculator"""),
code("""account = wb.accounting.BatchAccount(p["micro_batch"], p["accumulation"], p["replicas"],
                                     len(items), p["drop_partial"])
account.table().T.rename(columns={0: "value"})"""),
code("""account.budget(p["hold"], p["budget"], targets_per_example)"""),
md("""The same budget held fixed, for other accumulations (so other effective batches): holding
updates changes the examples learned; holding examples or epochs changes the updates."""),
code("""budget = account.compare(p["hold"], p["budget"], (p["accumulation"] // 2 or 1, p["accumulation"],
                                                 p["accumulation"] * 2), targets_per_example)
budget"""),
md("""The worked example, always: 2 x 8 on one GPU over 3,200 examples."""),
code("""worked = wb.accounting.BatchAccount(2, 8, 1, 3200)
worked.budget("epochs", 1)"""),
md("""## Reconciliation with the real loop
The loop runs a small budget; its counters (optimizer steps, examples, partial updates, targets)
must equal the calculator's. Any mismatch fails the notebook."""),
code("""# NBVAL_IGNORE_OUTPUT
cfg = wb.TrainConfig(micro_batch=p["micro_batch"], accumulation=p["accumulation"],
                     updates=p["reconcile_updates"], drop_partial=p["drop_partial"],
                     seed=p["seed"], device=p["device"], progress=True)
loop_account = wb.accounting.BatchAccount(p["micro_batch"], p["accumulation"], 1,
                                          min(len(items), p["reconcile_examples"]),
                                          p["drop_partial"])
steps = wb.train(t, items[: loop_account.examples], cfg).steps"""),
code("""reconciled = wb.accounting.reconcile(loop_account, steps, items)
reconciled"""),
md("""## Normalisation on your task
The gradient of one update over the same examples, split 1 x N, 2 x N/2, ..., N x 1. With the
loop's normalisation every split agrees with the first (float tolerance); the classic wrong one -
a mean per micro-batch, divided by the number of micro-batches - does not, as soon as the
micro-batches hold different numbers of targets. The second table uses a final partial group."""),
code("""check = pd.concat([
    wb.accounting.normalisation_check(t, items[: p["check_examples"]],
                                      (p["check_examples"], 2, 1), p["tolerance"]),
    wb.accounting.normalisation_check(t, items[: p["partial_examples"]],
                                      (p["partial_examples"], 2, 4), p["tolerance"]),
], keys=["equal split", "partial group"]).reset_index(level=0, names="case")
check.assign(max_relative_deviation=check.max_relative_deviation.map(lambda d: f"{d:.1e}"))"""),
md("""## Batch-norm statistics
Batch norm computes its statistics over what one pass sees: the per-device micro-batch (or a
ghost batch), never the effective batch. Accumulation does not change that."""),
code("""bn = wb.accounting.batch_norm_statistics(t, items, p["micro_batch"], p["accumulation"])
if bn.empty:
    print("this task's model has no batch norm; a demonstration on the classification sample:")
    demo = {norm: wb.accounting.batch_norm_statistics(
        wb.load_task("workbook.samples.classification:task", batch_norm=norm, virtual_batch=2),
        wb.encode_examples(wb.load_task("workbook.samples.classification:task"),
                           wb.load_examples(wb.load_task("workbook.samples.classification:task"))[:64]),
        4, 4).head(1) for norm in ("batch", "ghost")}
    bn = pd.concat(demo, names=["norm"]).reset_index(level=0)
bn"""),
code("""loop_ok = bool(reconciled.match.all())
norm_ok = bool(check[~check.normalisation.str.contains("wrong")].within_tolerance.all())
wrong_caught = bool(not check[check.normalisation.str.contains("wrong")].iloc[1:]
                    .within_tolerance.all())
wb.runs.save_table(account.table(), out, "account")
wb.runs.save_table(budget, out, "budget")
wb.runs.save_table(reconciled, out, "reconciliation")
wb.runs.save_table(check, out, "normalisation")
verdict = "pass" if loop_ok and norm_ok else "fail"
wb.runs.write_summary(out, verdict, {
    "examples_per_update": account.examples_per_update, "updates_per_pass": account.updates_per_pass,
    "worked_example_updates": worked.budget("epochs", 1)["updates"],
    "reconciled": loop_ok, "normalisation_ok": norm_ok, "wrong_normalisation_caught": wrong_caught,
    "max_deviation": float(check[~check.normalisation.str.contains("wrong")]
                           .max_relative_deviation.max())}, task=t.name)
print(f"verdict: {verdict}")"""),
])

nb05 = nb([
md("""# 05 - Memory variants: change the memory, not the question

When the pilot runs out of memory, find the phase and the input responsible (notebook 03), then
pick a lever - and record it as a **variant** of the control, measured like the control:

- a smaller **micro-batch** with accumulation raised keeps the effective batch; it shrinks the
  activations, but accumulation frees neither the weights nor the optimizer state;
- a shorter **max length** also shrinks the activations - and may cut what the task needs: when
  truncation removes target tokens, it is *not the same experiment*, and the row says so with the
  number of examples and targets affected;
- **activation checkpointing** keeps fewer intermediate results and recomputes them in backward
  (PyTorch's non-reentrant `torch.utils.checkpoint`): memory for time;
- **mixed precision** runs some operations in bf16 (or fp16 with a `GradScaler` on CUDA, updated
  once per optimizer step and unscaled once before clipping).

Each row: peak memory per phase, time per update, a quality proxy (validation loss after the same
updates on the same data order, always on the control's validation examples) and flags. The
device-free prediction gives each variant at the planned rental size."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory (the max-length variant sets max_length)
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # "cpu", "cuda" or "auto"
seed = 0
micro_batch = 4  # the control
accumulation = 4
eval_batch = 16
length = 0  # positions of the measured batches (0: the data's longest)
short_length = 20  # max_length of the truncation variant
updates = 20  # updates per variant for time and the quality proxy
lr = 1e-3
train_limit = 0  # use only the first N training examples (0: all)
val_limit = 64  # validation examples for the quality proxy
plan_micro_batch = 16  # the rental size each variant is predicted at
plan_accumulation = 2
plan_length = 1024
plan_eval_batch = 32"""),
code("""import workbook as wb

p = wb.params.check(globals(), "05_memory_variants")
out = wb.runs.notebook_dir(p["out_dir"], "05_memory_variants")
control = wb.variants.Variant("control", p["micro_batch"], p["accumulation"])
study = wb.variants.VariantStudy(p["task"], p["task_options"], p["updates"], p["lr"], p["seed"],
                                 p["device"], p["eval_batch"], p["length"], p["train_limit"],
                                 p["val_limit"], wb.predict.Plan.from_params(p))
variants = wb.variants.default_variants(control, p["short_length"])
print(f"{len(variants)} variants of {study.control_task.name!r}; writing to {out}")"""),
code("""# NBVAL_IGNORE_OUTPUT
table = study.run(variants)
wb.variants.display_table(table)"""),
md("""What each variant is and what it changed (the flags do not depend on timing):"""),
code("""table[["id", "effective_batch", "status", "flags", "reason"]]"""),
code("""wb.plots.variant_tradeoff(table, save=out / "variants.png")"""),
code("""verdict = wb.variants.save(table, out, study.control_task)
print(f"verdict: {verdict}")"""),
])

nb06 = nb([
md("""# 06 - Learning-rate comparison as a tracked study

A comparison is honest only when the control and its variants share the architecture, the data
and its order, the effective batch and the budget, and when the evaluation interval, the stopping
rule and the metric to select on are fixed **before the first trial**. So the plan is written to
the study folder first, and the study refuses to change it afterwards.

Every trial keeps its row in the ledger (SQLite, in the run folder): a diverged trial shows where
the setting breaks and what it consumed; re-running it (on another seed or batch) gets a new id
with a link to the trial it repeats, instead of silently replacing the failure. An untracked
experiment does not exist. Evaluation runs at fixed *step* intervals (never time intervals), with
an evaluation batch at least the training micro-batch; a final partial evaluation batch is
padded with examples that weigh zero, so the metric does not depend on the evaluation batch
size. The best checkpoint is often not the last: each trial keeps its top-N checkpoints (and the
last, for resuming), and the best is chosen afterwards.

The default values - a control of 1e-4 with variants 5e-5 and 2e-4 over 200 updates - illustrate
how to write the plan; they are not recommendations for your model."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # "cpu", "cuda" or "auto"
seed = 0  # seed of the validation sample (the trials have their own seeds)
study_name = "lr-comparison"
lrs = [1e-4, 5e-5, 2e-4]  # the control first, then the variants
seeds = [0]  # one trial per (lr, seed); several seeds show the spread
updates = 200  # the same budget for every trial
micro_batch = 2
accumulation = 8
eval_every = 50  # evaluate every N updates
eval_batch = 32  # at least the micro-batch
eval_sample = 0  # periodic evaluation on a sample of this size (0: the whole validation set)
metric = "loss"  # what selects the best checkpoint: "loss" or a task metric such as "accuracy"
top_n = 2  # checkpoints kept per trial, plus the last
divergence_multiple = 3.0  # a trial whose loss exceeds this x its first loss is stopped
prediction_examples = 4  # validation examples whose predictions are saved at each evaluation
notes = "none"  # free text kept with the study"""),
code("""import workbook as wb

p = wb.params.check(globals(), "06_lr_study")
out = wb.runs.notebook_dir(p["out_dir"], "06_lr_study")
study = wb.study.Study(out / "study", wb.study.plan_from_params(p))
print(f"plan of {study.plan.name!r} written to {study.folder / 'plan.json'} before any trial; "
      f"{len(study.plan.trials())} trials planned")"""),
md("""## The trials"""),
code("""# NBVAL_IGNORE_OUTPUT
study.run_all(progress=True)
study.trial_table()"""),
code("""study.trial_table()[["id", "lr", "seed", "status", "best_step"]]"""),
code("""wb.plots.study_curves(study.curves(), study.evals(), study.trial_table(),
                     save=out / "study_curves.png")"""),
md("""## Per learning rate, every seed
The best value of each seed is kept; the mean and spread never hide a seed."""),
code("""# NBVAL_IGNORE_OUTPUT
study.lr_summary()"""),
code("""wb.plots.lr_summary(study.lr_summary(), study.trial_table(), study.plan.metric,
                    save=out / "lr_summary.png")"""),
md("""## The study table
The spreadsheet view: where the configuration is stored, notes, trials, the best checkpoint's
validation performance and the command that reproduces it."""),
code("""# NBVAL_IGNORE_OUTPUT
study.study_table().T"""),
md("""## Evaluation checks
A sampled periodic evaluation is compared with the full validation set (class shares, lengths),
and the best checkpoint is evaluated on the full set at the end. A validation curve that repeats
every pass over the data suggests training data not shuffled, or evaluation data overlapping
training; the check needs evaluations over at least two passes."""),
code("""study.skew if not study.skew.empty else "periodic evaluation uses the whole validation set\""""),
code("""study.periodicity()"""),
md("""For classification, the correct predictions per class at each evaluation of the best trial
(a "+0.05 recall" on a rare class may be a single example):"""),
code("""# NBVAL_IGNORE_OUTPUT
best = study.best()
evals = study.evals()
evals[evals.trial == best["id"]][["step", "scope", "loss", "metrics", "per_class"]] if best else None"""),
code("""verdict = wb.study.save(study, out)
print(f"verdict: {verdict}")"""),
])

nb07 = nb([
md("""# 07 - Resume and reload

Saved weights serve some inference uses; resuming *training* needs much more: the optimizer, the
learning-rate schedule, the gradient scaler, the random states (Python, NumPy, torch, CUDA), the
position in the data (pass, update within the pass) and the counters. A resume that is only
"roughly right" silently changes the experiment. So this notebook tests resume early and in a
**new process**: one run goes to K updates uninterrupted; the same run is checkpointed at k < K
and a fresh Python process loads the checkpoint and continues to K. Per update, the loss, the
learning rate and the ids of the examples consumed must match, and the final parameters must be
bit-identical on the CPU (on CUDA: within a stated tolerance). Two cases: mid-pass, and exactly
at the end of a pass, where a restored loader must start the next pass instead of ending the run.
The default run uses accumulation 8.

Checkpoints are folders written to a temporary name and renamed, with the weights in
safetensors, everything else loadable with `torch.load(weights_only=True)`, and a manifest of
sha256 digests: a changed file, or a pickle that would run code, is refused.

At the end, the result is archived (weights, configuration, code revision, environment, raw
metrics, procedure, control outputs) and reloaded in a fresh process, which must reproduce the
control outputs exactly."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory (e.g. {"dropout": 0.1})
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # "cpu" (bit-exact) or "cuda" (set a tolerance)
seed = 0
micro_batch = 2
accumulation = 8
lr = 1e-3
updates = 10  # K: the uninterrupted run
train_limit = 64  # a small pass, so K crosses passes (0: all examples)
mid_step = 6  # a resume point inside a pass
boundary_step = 0  # a resume point at the end of a pass (0: the first pass's last update)
tolerance = 0.0  # allowed difference (0: bit-exact; CUDA needs a small positive value)
demonstrate_faults = True  # also plant the classic resume bugs and show they are caught
controls = 8  # control inputs kept in the archive"""),
code("""import math

import workbook as wb

p = wb.params.check(globals(), "07_resume_reload")
out = wb.runs.notebook_dir(p["out_dir"], "07_resume_reload")
cfg = wb.TrainConfig(micro_batch=p["micro_batch"], accumulation=p["accumulation"], lr=p["lr"],
                     seed=p["seed"], device=p["device"])
spec = wb.resume.recipe(p["task"], p["task_options"], cfg, p["train_limit"])
task, items, _ = wb.resume.rebuild(spec)
per_pass = math.ceil(len(items) / (p["micro_batch"] * p["accumulation"]))
boundary = p["boundary_step"] or per_pass
print(f"{len(items)} training examples, {per_pass} updates per pass; resume after update "
      f"{p['mid_step']} (mid-pass) and {boundary} (end of a pass); writing to {out}")"""),
md("""## Resume in a new process"""),
code("""# NBVAL_IGNORE_OUTPUT
cases, details = wb.resume.check_cases(spec, p["updates"], p["mid_step"], boundary, out,
                                       p["tolerance"])
cases"""),
code("""cases[["case", "resumed_after", "updates_compared", "same_examples", "exact",
       "continued_to_the_end"]]"""),
code("""wb.plots.resume_overlay(details, save=out / "resume.png")"""),
md("""## What the check catches
The same resume with a classic bug planted. "Random states not restored" is only visible when
training draws random numbers (dropout): a task without any is not affected by it."""),
code("""faults = (wb.resume.planted_faults(spec, p["updates"], p["mid_step"], out, details["reference"],
                                  details["weights"], p["tolerance"])
          if p["demonstrate_faults"] else None)
faults"""),
md("""## Safe loading"""),
code("""tamper = wb.resume.tamper_checks(out / f"ckpt-{p['mid_step']:06d}", out)
tamper"""),
md("""## Archive, and reload in a fresh process"""),
code("""# NBVAL_IGNORE_OUTPUT
import subprocess
import sys

import pandas as pd

final, weights = details["reference"], details["weights"]
model = task.build_model()
model.load_state_dict(weights)
archive = wb.archive.write_archive(
    out / "archive", p["task"], p["task_options"], model, spec["config"],
    pd.DataFrame(final).drop(columns=["ids"]),
    [f"python -m workbook pilot --task {p['task']} --only 07"], p["controls"])
reloaded = subprocess.run([sys.executable, "-m", "workbook", "reload", "--archive",
                           str(archive)], capture_output=True, text=True)
print(reloaded.stdout or reloaded.stderr)"""),
code("""import json

result = json.loads(reloaded.stdout) if reloaded.returncode == 0 else {"identical": False}
print(f"archive reloaded in a new process; control outputs identical: {result['identical']}")"""),
code("""ok = bool(cases.exact.all() and cases.continued_to_the_end.all() and result["identical"]
          and tamper.refused.all() and not tamper["code ran"].fillna(False).any())
wb.runs.save_table(cases, out, "resume_cases")
wb.runs.save_table(tamper, out, "tamper")
if faults is not None:
    wb.runs.save_table(faults, out, "planted_faults")
wb.runs.write_summary(out, "pass" if ok else "fail", {
    "cases": cases[["case", "resumed_after", "exact", "max_param_diff"]].to_dict("records"),
    "archive_identical": result["identical"], "tampering_refused": bool(tamper.refused.all()),
    "faults_caught": None if faults is None else faults.set_index("planted bug").caught.to_dict()},
    task=task.name)
print(f"verdict: {'pass' if ok else 'fail'}")"""),
])

nb08 = nb([
md("""# 08 - The rental plan

The pilot exists to choose a rental. The **selection sheet** has one row per candidate
configuration and GPU: memory (GiB), precision, micro-batch, accumulation, activation
checkpointing, distribution strategy, maximum length, the predicted peak per phase with
headroom and the overheads the prediction does not see, whether it fits, the FLOPs of an update
and the time they take at an assumed utilisation, and the result the configuration is meant to
produce. Every figure says whether it was measured, counted or assumed. A configuration is
adopted only after the software stack it needs is verified; the sheet lists what was verified
here and what remains to verify on the rental.

Then the variants, by priority, are packed into a 3, 7 and 30-day plan with time reserved for
evaluation, export and the unexpected; what does not fit is listed, not dropped. The sheet
plans - it predicts neither duration nor quality - and the conclusion is written so it can be
re-read later, including when the control remains the best choice."""),
params("""task = "workbook.samples.generation:task"  # package.module:attribute of your task
task_options = {}  # keyword arguments for a task factory (e.g. {"context": 4096})
out_dir = ""  # where this notebook writes (empty: a new folder under runs/)
device = "cpu"  # where the stack is verified
seed = 0
gpus = {"L4": 24, "A100-40GB": 40, "L40S": 48, "A100-80GB": 80, "H200": 141}  # name: GiB
gpu_tflops = {"L4": 121, "A100-40GB": 312, "L40S": 362, "A100-80GB": 312, "H200": 989}  # dense bf16 peak (vendor sheets)
utilisation = 0.35  # assumed share of the peak reached in training
rental_gpu = "A100-80GB"  # the GPU to plan the days on
candidates = [{"name": "control", "micro_batch": 16, "accumulation": 2, "length": 1024, "precision": "bf16", "expected": "the study's control at campaign scale"}, {"name": "checkpointed", "micro_batch": 32, "accumulation": 1, "length": 1024, "precision": "bf16", "activation_checkpointing": True, "expected": "same effective batch, fewer passes per update"}, {"name": "2 replicas", "micro_batch": 16, "accumulation": 1, "length": 1024, "precision": "bf16", "replicas": 2, "expected": "same effective batch on two GPUs"}]
updates = 20000  # the campaign budget of one trial
eval_every = 500
export_minutes = 5.0  # assumed time to save and export the final checkpoint
headroom = 0.2
cuda_context_gib = 1.0  # assumed unless notebook 03 measured it on a GPU
allocator_cache_share = 0.1
variants = [{"name": "control", "priority": 1, "candidate": "control", "repeats": 3}, {"name": "best study lr", "priority": 2, "candidate": "control", "repeats": 3}, {"name": "checkpointed", "priority": 3, "candidate": "checkpointed", "repeats": 1}]
reserve_share = 0.2  # of each plan's days, kept for evaluation, export and the unexpected
train_limit = 200  # examples used to shape the batches (only their shapes matter)"""),
code("""import pandas as pd

import workbook as wb

p = wb.params.check(globals(), "08_rental_plan")
t = wb.load_task(p["task"], **p["task_options"])
out = wb.runs.notebook_dir(p["out_dir"], "08_rental_plan")
splits = wb.split_examples(t, wb.load_examples(t))
train = wb.encode_examples(t, splits["train"][: p["train_limit"]])
val = wb.encode_examples(t, splits["validation"])
candidates = wb.rental.candidates_from(p["candidates"])
wb.rental.gpu(p["rental_gpu"], p["gpus"])
assumptions = wb.rental.Assumptions(p["utilisation"], p["eval_every"], 0, p["export_minutes"],
                                    wb.predict.Overheads(int(p["cuda_context_gib"] * 2**30),
                                                         p["allocator_cache_share"], False))
print(f"{len(candidates)} candidates x {len(p['gpus'])} GPUs for {t.name!r}; writing to {out}")"""),
md("""## The selection sheet"""),
code("""sheet = wb.rental.selection_sheet(t, train, val, candidates, p["gpus"], p["gpu_tflops"],
                                  p["updates"], p["headroom"], assumptions)
sheet"""),
md("""Where each figure comes from:"""),
code("""pd.Series(sheet.attrs["sources"], name="source").to_frame()"""),
md("""## The software stack"""),
code("""# NBVAL_IGNORE_OUTPUT
stack = wb.rental.stack_check(p["task"], p["device"], candidates[0].precision)
stack"""),
md("""## 3, 7 and 30 days"""),
code("""plans = pd.concat([wb.rental.pack(p["variants"], sheet, p["rental_gpu"], days, p["reserve_share"])
                   for days in (3, 7, 30)], ignore_index=True)
plans"""),
md("""## Conclusion"""),
code("""# NBVAL_IGNORE_OUTPUT
from IPython.display import Markdown

chosen = wb.rental.choose(sheet, p["rental_gpu"])
text = wb.rental.conclusion(out.parent, chosen, p["rental_gpu"], plans, stack)
(out / "conclusion.md").write_text(text)
Markdown(text)"""),
code("""wb.runs.save_table(sheet, out, "selection")
wb.runs.save_table(plans, out, "plan")
wb.runs.save_table(stack, out, "stack")
verdict = "pass" if chosen is not None else "fail"
wb.runs.write_summary(out, verdict, {
    "rental_gpu": p["rental_gpu"], "chosen": chosen and chosen["candidate"],
    "fitting_rows": int(sheet.fits.sum()), "rows": len(sheet),
    "scheduled": plans.groupby("days").scheduled.sum().to_dict()}, task=t.name)
print(f"verdict: {verdict}")"""),
])

def sources(book) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"])) for c in book["cells"]]


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "notebooks"
    target.mkdir(parents=True, exist_ok=True)
    for name, book in (("01_inspect_examples", nb01), ("02_overfit", nb02),
                       ("03_phase_gates", nb03), ("04_batch_accounting", nb04),
                       ("05_memory_variants", nb05), ("06_lr_study", nb06),
                       ("07_resume_reload", nb07), ("08_rental_plan", nb08)):
        path = target / f"{name}.ipynb"
        # an unchanged notebook keeps its executed outputs; a changed one must be executed again
        if path.exists() and sources(nbf.read(path, as_version=4)) == sources(book):
            continue
        nbf.write(book, path)
        print(f"wrote {path} without outputs: execute it before committing")
