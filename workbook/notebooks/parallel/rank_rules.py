"""Notebook 09's multi-host rules, judged on what every rank of a launch reported (one writer,
identical replicas, disjoint shards, loss normalisation, batch norm, evaluation, resume), and
the tables of accounting, evaluation and phase times over ranks."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
from safetensors.torch import load_file

from ...base.errors import WorkbookError
from ...contract.data import Item
from ...contract.metric_reduction import GATHERED, MEAN, OWN, ROWS, WORDS, rank_value, reduced
from ...contract.task import Task
from ...storage.records import StepRecord
from ...training.deviation import max_difference
from ...training.evaluation import LOSS
from ...training.loop import UpdateShape
from ...training.replica import WEIGHTS, ReplicaSpec
from ..accounting import BatchAccount, reconcile
from .launches import launch

REMEDIATION = {
    "only rank 0 writes": "guard every log line, ledger row and checkpoint with "
                          "`if dist.get_rank() == 0:` and put a barrier before others read it",
    "identical initial parameters": "build the model after seeding with the SAME seed on every "
                                    "rank (never seed + rank); DDP's broadcast from rank 0 hides "
                                    "this for parameters only",
    "replicas identical after training": "let DDP synchronise every gradient (no parameter "
                                         "outside the wrapped module, no rank-only update)",
    "disjoint shards covering the split": "give each rank its own shard: DistributedSampler("
                                          "dataset, num_replicas=world, rank=rank)",
    "a new order every pass": "call sampler.set_epoch(epoch) at the start of every pass",
    "examples per update = micro-batch x accumulation x replicas":
        "count examples and targets on every rank and sum them; see notebook 04",
    "gradient all-reduce on the last micro-step only": "wrap every micro-step but the last in "
                                                       "`with model.no_sync():`",
    "loss normalised over the whole update (R x N/R)":
        "sum the loss, all-reduce the target count of the whole update and divide by it "
        "(x replicas, since DDP averages); never a mean per rank",
    "loss normalised over the whole update, with accumulation":
        "sum the loss over micro-steps and ranks and divide once by the update's targets",
    "loss normalised over a partial update (unequal shares)":
        "divide by the all-reduced target count, so a rank with fewer examples weighs less",
    "batch-norm statistics synchronised": "use nn.SyncBatchNorm on CUDA, or all-reduce the "
                                          "running statistics before evaluating and saving",
    "evaluation reduced as sums over ranks": "all-reduce numerators and denominators (padding "
                                             "weighs zero); never average the ranks' means",
    "resume in new processes is exact": "save every rank's random state and the data position "
                                        "in the one checkpoint; restore each rank's own",
}


RULES = tuple(REMEDIATION)


# --- the rules ------------------------------------------------------------------------------
def rule_row(rule: str, verdict: str, measured: str,
             remediation: dict[str, str] = REMEDIATION) -> dict[str, str]:
    return {"rule": rule, "verdict": verdict, "measured": measured,
            "remediation": remediation[rule] if verdict == "fail" else ""}


def merged_steps(result: dict[str, Any]) -> list[StepRecord]:
    """One StepRecord per update with the counters of every rank added up (ids in rank order)."""
    ranks = [r["records"] for r in result["ranks"]]
    steps = []
    for per_rank in zip(*ranks, strict=True):
        first = per_rank[0]
        steps.append(StepRecord(first["step"], first["epoch"], first["micro_batches"],
                                sum(r["examples"] for r in per_rank), int(first["targets"]),
                                first["loss"], first["lr"], first["grad_norm"], 0.0, 0.0,
                                [i for r in per_rank for i in r["ids"]]))
    return steps


def accounting(result: dict[str, Any], items: list[Item], task: Task | None = None) -> pd.DataFrame:
    """Notebook 04's reconciliation with replicas: the calculator against the sum of the
    counters of every rank."""
    spec = result["spec"]
    shape = replace(UpdateShape.from_dict(spec["shape"]), replicas=result["world"])
    account = BatchAccount(shape, result["train_examples"], spec["drop_partial"])
    by_str = [Item(str(it.id), it.tensors) for it in items]
    return reconcile(account, merged_steps(result), by_str, task)


def final_names(files: list[str]) -> str:
    """The files a rank wrote, as people read them: the temporary names a writer renames from
    (`.NAME.partial-...`) left out, unless nothing else was written."""
    final = [f for f in files if ".partial-" not in f] or list(files)
    return ", ".join(final)


def rules(result: dict[str, Any], items: list[Item], tolerance: float = 1e-4,
          eval_tolerance: float = 1e-5, task: Task | None = None) -> pd.DataFrame:
    """One row per multi-host rule with its verdict ("pass", "fail" or "not applicable"), what was
    measured and, when it fails, the remedy."""
    world, ranks = result["world"], result["ranks"]
    rows = []
    others = {r: files for r, files in enumerate(result["writes"]) if r and files}
    rows.append(rule_row("only rank 0 writes", "fail" if others else "pass",
                         "; ".join(f"rank {r} wrote {final_names(f)}" for r, f in others.items())
                         or f"rank 0 wrote {final_names(result['writes'][0]) or 'nothing'}; the "
                         f"other {world - 1} rank(s) nothing"))
    for rule, key in (("identical initial parameters", "init"),
                      ("replicas identical after training", "final")):
        digests = result["init_digest"] if key == "init" else [r["final_digest"] for r in ranks]
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        rows.append(rule_row(rule, "fail" if differ else "pass",
                             f"ranks {differ} differ from rank 0" if differ else
                             f"one parameter digest on all {world} ranks"))
    rows += _shard_rows(result)
    recon = accounting(result, items, task)
    wrong = recon[~recon.match]
    rows.append(rule_row("examples per update = micro-batch x accumulation x replicas",
                         "fail" if len(wrong) else "pass",
                         "; ".join(f"{r.counter}: loop {r.loop}, expected {r.expected}"
                                   for r in wrong.itertuples()) or
                         f"{len(recon)} counters of {world} ranks match the calculator"))
    rows += _gradient_rows(result, tolerance)
    rows.append(_bn_row(result))
    rows.append(_eval_row(result, eval_tolerance))
    return pd.DataFrame(rows)


def _shard_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """Epoch 0 of every rank: disjoint and together the whole split; epoch 1: a new order."""
    ranks = [r["records"] for r in result["ranks"]]
    seen = [[i for rec in recs if rec["epoch"] == 0 for i in rec["ids"]] for recs in ranks]
    complete = not any(rec["epoch"] == 0 for rec in ranks[0][-1:]) and result["first_step"] == 1
    overlap = set.intersection(*map(set, seen)) if seen else set()
    missing = set(result["train_ids"]) - set().union(*map(set, seen))
    if result["spec"]["drop_partial"]:
        missing = set()  # a dropped partial update leaves examples out by design
    if not complete and overlap:  # disjointness shows before the pass ends, coverage not
        shards = rule_row("disjoint shards covering the split", "fail",
                          f"{len(overlap)} examples on more than one rank in the updates of the "
                          "first pass (the run did not finish it: coverage not checked)")
    elif not complete:
        shards = rule_row("disjoint shards covering the split", "not applicable",
                          "the run did not finish a pass (raise updates)")
    else:
        bad = bool(overlap or missing)
        shards = rule_row("disjoint shards covering the split", "fail" if bad else "pass",
                          f"{len(overlap)} examples on more than one rank, {len(missing)} on "
                          "none" if bad else f"{len(result['train_ids'])} examples, each on "
                          f"exactly one of {len(ranks)} ranks in the first pass")
    second = [[i for rec in recs if rec["epoch"] == 1 for i in rec["ids"]] for recs in ranks]
    if not all(second):
        order = rule_row("a new order every pass", "not applicable",
                         "the run did not reach a second pass")
    else:
        same = [r for r, (a, b) in enumerate(zip(seen, second, strict=True))
                if a[:len(b)] == b[:len(a)]]
        order = rule_row("a new order every pass", "fail" if same else "pass",
                         f"ranks {same} read pass 2 in the order of pass 1" if same else
                         "every rank reads its examples in a new order in pass 2")
    return [shards, order]


GRADIENT_RULES = {"equal": "loss normalised over the whole update (R x N/R)",
                  "accumulation": "loss normalised over the whole update, with accumulation",
                  "partial": "loss normalised over a partial update (unequal shares)"}


def _gradient_rows(result: dict[str, Any], tolerance: float) -> list[dict[str, str]]:
    checks = {c["case"]: c for c in result.get("gradient_check") or []}
    if not checks:
        return []
    one, two = checks["equal"], checks["accumulation"]
    rows = [rule_row("gradient all-reduce on the last micro-step only",
                     "pass" if two["all_reduces"] == one["all_reduces"] else "fail",
                     f"{one['all_reduces']} all-reduce call(s) per update without accumulation, "
                     f"{two['all_reduces']} with 2 micro-steps")]
    for case, rule in GRADIENT_RULES.items():
        check = checks[case]
        dev = check["max_relative_deviation"]
        ok = dev <= tolerance and check["identical_on_ranks"]
        differ = check.get("data_differs_on_ranks")
        if differ and not ok:
            rows.append(_data_row(rule, check, differ))
            continue
        rows.append(rule_row(rule, "pass" if ok else "fail",
                             f"{check['split']} on {len(check['targets_per_rank'])} ranks against "
                             f"1 x {check['examples']} in one process: max relative deviation "
                             f"{dev:.1e} (tolerance {tolerance:.0e}); targets per rank "
                             f"{[int(t) for t in check['targets_per_rank']]}"
                             + _rank_mean_note(check, tolerance)))
    return rows


DATA_DIFFERS = ("the data differs between runs: rank(s) {ranks} encoded the same examples into "
                "other tensors than rank 0 (a random augmentation or other per-example "
                "randomness in encode or the DataLoader workers), so the gradients cannot be "
                "compared - the loss normalisation is not judged")
SEED_DATA = ("seed the per-example randomness: a DataLoader generator=torch.Generator()"
             ".manual_seed(seed) and worker seeds derived from it (torch's worker_init_fn "
             "default), the same on every rank; or make encode deterministic for this check")


def _data_row(rule: str, check: dict[str, Any], ranks: list[int]) -> dict[str, str]:
    """A normalisation rule that cannot be judged: the ranks' losses received other tensors
    than the one-process reference for the same examples."""
    return {"rule": rule, "verdict": "not applicable",
            "measured": DATA_DIFFERS.format(ranks=ranks) + f" (max relative deviation "
            f"{check['max_relative_deviation']:.1e} on {check['split']})",
            "remediation": SEED_DATA}


def _rank_mean_note(check: dict[str, Any], tolerance: float) -> str:
    """Said when a mean per rank would pass this check too (it cannot tell them apart)."""
    if len(set(check["targets_per_rank"])) == 1:
        return " (equal: a per-rank mean would agree too)"
    alike = check.get("rank_mean_deviation")
    if alike is not None and alike <= tolerance:
        return (f" (a per-rank mean would agree too: it deviates by only {alike:.1e} on these "
                "examples)")
    return ""


def _bn_row(result: dict[str, Any]) -> dict[str, str]:
    rule = "batch-norm statistics synchronised"
    checks = [c for c in ((result.get("checkpoint") or {}).get("batch_norm"),
                          result["batch_norm_final"]) if c]
    if not checks or not checks[0].get("layers"):
        return rule_row(rule, "not applicable", "the model has no batch-norm layer")
    problems = []
    for where, c in zip(("checkpoint", "final evaluation"), checks, strict=False):
        if not c["identical_after_sync"]:
            problems.append(f"ranks still differ at the {where}")
        if c["saved_vs_rank_mean"] is not None and c["saved_vs_rank_mean"] > 1e-6 and \
                c["ranks_differed_by"] > 1e-6:
            problems.append(f"the {where} holds statistics {c['saved_vs_rank_mean']:.2g} away "
                            "from the mean over ranks (one rank's only)")
    c = checks[0]
    return rule_row(rule, "fail" if problems else "pass", "; ".join(problems) or
                    f"{c['layers']} layer(s); the ranks differed by {c['ranks_differed_by']:.2g} "
                    "before the sync; the checkpoint holds their mean")


def rank_reductions(ev: dict[str, Any]) -> dict[str, str]:
    """How the task's framework reduces each metric over ranks, as the ranks' adapters declared
    it (`Task.framework.metric_reductions`); a metric not named is a mean over rows."""
    return {k: v for r in ev["ranks"] for k, v in (r.get("reductions") or {}).items()}


def reduced_values(ev: dict[str, Any]) -> dict[str, float]:
    """Each metric reduced over ranks the way its framework reduces it (a metric the framework
    computes from gathered outputs: the one-process value)."""
    how = rank_reductions(ev)
    single = ev["single"] or {}
    out = {}
    for k in ev["ranks"][0]["sums"]:
        value = reduced(how.get(k, ROWS), [tuple(r["sums"][k]) for r in ev["ranks"]
                                           if k in r["sums"]])
        out[k] = value if value is not None else rank_value(*single.get(k, (0.0, 0.0)))
    return out


def _eval_row(result: dict[str, Any], tolerance: float) -> dict[str, str]:
    rule = "evaluation reduced as sums over ranks"
    ev = result["evaluation"]
    how, values, single = rank_reductions(ev), reduced_values(ev), ev["single"]
    deviations = {k: abs(values[k] - single[k][0] / single[k][1]) /
                  max(abs(single[k][0] / single[k][1]), 1e-12)
                  for k in single if single[k][1] and k in values}
    means = [r["sums"][LOSS][0] / max(r["sums"][LOSS][1], 1) for r in ev["ranks"]]
    wrong = sum(means) / len(means)
    right = single[LOSS][0] / single[LOSS][1]
    worst = max(deviations.values())
    sizes = [r["examples"] for r in ev["ranks"]]
    measured = (f"shards of {sizes} examples; loss {values[LOSS]:.6g} reduced vs {right:.6g} "
                f"in one process (max relative deviation {worst:.1e}); the mean of rank means "
                f"would say {wrong:.6g}")
    off = [k for k, d in deviations.items() if d > tolerance]
    if off:
        measured += "; " + "; ".join(
            _metric_note(k, how.get(k, ROWS), values[k], single[k][0] / single[k][1],
                         [rank_value(*r["sums"][k]) for r in ev["ranks"] if k in r["sums"]])
            for k in off)
    gathered = sorted(k for k, v in how.items() if v == GATHERED)
    if gathered:
        measured += (f"; {', '.join(gathered)}: {WORDS[GATHERED]}, as in one process")
    return rule_row(rule, "fail" if off else "pass", measured)


def _metric_note(name: str, how: str, value: float, single: float,
                 per_rank: list[float]) -> str:
    """One metric reduced off its one-process value, with the likely cause."""
    named = "the loss" if name == LOSS else name
    if how == OWN:
        ranks = ", ".join(f"rank {r} {v:.6g}" for r, v in enumerate(per_rank))
        return (f"{named} is computed in on_validation_epoch_end from each rank's own "
                f"accumulated state and logged without sync_dist: every rank logs its own "
                f"shard's value ({ranks}; the logger and checkpointing read rank 0's) where one "
                f"process gives {single:.6g}, and no mean of them over rows gives that "
                f"({value:.6g}) - "
                f"compute it from all ranks' state: gather the state first (self.all_gather) "
                f"or keep it in a torchmetrics Metric (its states sync before compute), and "
                f"log the result with sync_dist=True")
    said = f"{named} {value:.6g} reduced as {WORDS[how]} vs {single:.6g} in one process"
    if how == MEAN:
        return said + (" - a metric logged with sync_dist=True at the epoch's end is the mean of "
                       "the ranks' own values: no F1, ratio of totals or count is; compute it "
                       "from outputs gathered over ranks (self.all_gather, a torchmetrics "
                       "Metric) or log counts with reduce_fx='sum'")
    if how == ROWS and name != LOSS:
        return said + (" - it is reduced as a mean over rows (Lightning's epoch mean of a step "
                       "log, sync_dist=True): a per-rank F1, ratio of totals or count is no "
                       "such mean; gather the outputs first or sum its counts over ranks")
    return said


def evaluation_table(result: dict[str, Any]) -> pd.DataFrame:
    """Loss and metrics per rank, reduced over ranks (each metric as its framework reduces
    it) and in one process."""
    ev = result["evaluation"]
    rows = [{"evaluated by": f"rank {r}", "examples": e["examples"], **_ratios(e["sums"])}
            for r, e in enumerate(ev["ranks"])]
    total = sum(e["examples"] for e in ev["ranks"])
    rows.append({"evaluated by": "all ranks (sums reduced)", "examples": total,
                 **{("loss" if k == LOSS else k): v for k, v in reduced_values(ev).items()}})
    rows.append({"evaluated by": "one process", "examples": total, **_ratios(ev["single"])})
    return pd.DataFrame(rows)


def _ratios(sums: dict[str, list[float]]) -> dict[str, float]:
    return {("loss" if k == LOSS else k): num / den if den else float("nan")
            for k, (num, den) in sums.items()}


def phase_table(result: dict[str, Any]) -> pd.DataFrame:
    """One phase table per rank: median time per update, the gradient all-reduce on its own
    (it runs inside backward), and the memory counters of one measured update (notebook 03's:
    CUDA allocated and reserved apart; CPU live-tensor peak, and the resident-set high-water)."""
    rows = []
    for rank, r in enumerate(result["ranks"]):
        frame = pd.DataFrame(r["records"])
        for phase in ("data", "forward + loss", "backward", "all_reduce", "update"):
            reading = r["memory"].get(phase, {})
            rows.append({"rank": rank, "phase": phase.replace("_", "-"),
                         "median_s": float(frame[phase].median()),
                         "calls_per_update": int(frame.all_reduces.median())
                         if phase == "all_reduce" else None,
                         **{k: reading.get(k) for k in ("counter", "peak_allocated_bytes",
                                                         "allocated_bytes",
                                                         "peak_reserved_bytes",
                                                         "reserved_bytes", "rss_peak_bytes")},
                         "finite": bool(frame.loss.map(math.isfinite).all())})
        for phase, seconds in (("evaluation", r["eval_s"]), ("checkpoint", r["checkpoint_s"])):
            rows.append({"rank": rank, "phase": phase, "median_s": seconds})
    return pd.DataFrame(rows)


# --- resume in new processes -------------------------------------------------------------------

def resumed_updates(uninterrupted: list[list[dict]], resumed: list[list[dict]]) -> pd.DataFrame:
    """Each resumed update against the same update of the uninterrupted launch (per rank, its
    records in order): the loss, the learning rate and every rank's examples."""
    ref = {rec["step"]: [records[i] for records in uninterrupted]
           for i, rec in enumerate(uninterrupted[0])}
    rows = []
    for i, rec in enumerate(resumed[0]):
        mine, theirs = [records[i] for records in resumed], ref[rec["step"]]
        rows.append({"step": rec["step"], "loss_uninterrupted": theirs[0]["loss"],
                     "loss_resumed": rec["loss"], "loss_diff": abs(rec["loss"] - theirs[0]["loss"]),
                     "same_lr": rec["lr"] == theirs[0]["lr"],
                     "same_examples_on_every_rank": all(
                         a["ids"] == b["ids"] for a, b in zip(mine, theirs, strict=True))})
    return pd.DataFrame(rows)


def resumed_against(reference: list[list[dict]], resumed: list[list[dict]],
                    reference_folder: Path, folder: Path, last_update: int,
                    tolerance: float) -> tuple[pd.DataFrame, bool, str]:
    """`resumed_updates` and the final parameters (`WEIGHTS` of both folders): the table,
    whether every update to `last_update` and the parameters agree within `tolerance`, and
    the comparison in words."""
    table = resumed_updates(reference, resumed)
    diff = max_difference(load_file(str(reference_folder / WEIGHTS)),
                          load_file(str(folder / WEIGHTS)))
    exact = bool(len(table) and table.same_lr.all() and table.same_examples_on_every_rank.all()
                 and table.loss_diff.max() <= tolerance and diff <= tolerance
                 and table.step.iloc[-1] == last_update)
    return table, exact, (f"{len(table)} updates compared, max loss difference "
                          f"{table.loss_diff.max():.1e}, max parameter difference {diff:.1e} "
                          f"(tolerance {tolerance:g})")


def resume_check(spec: ReplicaSpec, reference: dict[str, Any], reference_folder: Path,
                 folder: Path, tolerance: float = 0.0) -> tuple[dict[str, str], pd.DataFrame]:
    """Continue the reference launch's checkpoint in N new processes and compare update by
    update (loss, learning rate, every rank's examples) and the final parameters."""
    resumed = launch(spec, folder, resume_from=resume_point(reference, reference_folder))
    return resume_rule(spec, reference, resumed, reference_folder, folder, tolerance)


def resume_point(reference: dict[str, Any], reference_folder: Path) -> Path:
    """The checkpoint of the reference launch a resume continues."""
    if not reference.get("checkpoint"):
        raise WorkbookError("the reference launch wrote no checkpoint",
                            "give checkpoint_at, an update before the last")
    return reference_folder / reference["checkpoint"]["path"]


def resume_rule(spec: ReplicaSpec, reference: dict[str, Any], resumed: dict[str, Any],
                reference_folder: Path, folder: Path, tolerance: float = 0.0
                ) -> tuple[dict[str, str], pd.DataFrame]:
    """`resume_check`'s judgement of a resume launched from `resume_point` into `folder`."""
    table, exact, said = resumed_against([r["records"] for r in reference["ranks"]],
                                         [r["records"] for r in resumed["ranks"]],
                                         reference_folder, folder, spec.updates, tolerance)
    return rule_row("resume in new processes is exact", "pass" if exact else "fail",
                    f"resumed after update {resumed['first_step'] - 1} in {resumed['world']} new "
                    f"processes: {said}"), table


def with_row(table: pd.DataFrame, row: dict[str, str]) -> pd.DataFrame:
    """The rules table with one more rule (the resume, judged after its own launch)."""
    return pd.concat([table, pd.DataFrame([row])], ignore_index=True)


def verdict(table: pd.DataFrame) -> str:
    """"pass" when no rule failed (a rule that does not apply fails nothing)."""
    return "fail" if (table.verdict == "fail").any() else "pass"


def outcome(rules: pd.DataFrame, faults: pd.DataFrame | None) -> str:
    """Notebook 09's verdict: "fail" on a failing rule, and on a planted bug its rule missed (a
    rule that misses its bug cannot be trusted on yours); a bug this task cannot show (caught
    None: "not demonstrable", "not applicable") fails nothing."""
    missed = faults is not None and any(c is False for c in faults.caught.tolist())
    return "fail" if missed else verdict(rules)
