"""Notebook 09: the same loop on N processes with DistributedDataParallel, launched with
torchrun from this (single) process under a time limit, and the multi-host rules checked on
what every rank reported: one writer, identical replicas, disjoint shards with a new order each
pass, global loss normalisation, synchronised batch-norm statistics, evaluation as sums over
ranks, and resume of the N-process run in N new processes. Then the same loop sharded with
FSDP2 (`sharded_replica`, two more launches) and the rules that change under sharding: every
rank writes its shard of a DCP checkpoint, resume from it in new processes is exact, the first
updates agree with one process, tied weights stay tied; and the per-rank peak of every phase
against `sharding.predict_sharded`."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file

from ..base.errors import WorkbookError
from ..contract.data import Item, prepare
from ..contract.task import Task, task_from_params
from ..storage.artifacts import read_json
from ..storage.files import write_text
from ..storage.records import StepRecord
from ..storage.runs import claim_dir, fresh_process
from ..storage.runs import shown as shown_path
from ..training import checkpoint as ckpt
from ..training.deviation import max_difference, relative_deviation
from ..training.devices import resolve_device
from ..training.evaluation import LOSS
from ..training.loop import UpdateShape, seed_everything
from ..training.ranks import backend, digest
from ..training.replica import (
    FAULTS,
    RESULT,
    WEIGHTS,
    ReplicaSpec,
    check_items,
    rank_mean_gradient,
    reference_gradient,
    shard,
    update_groups,
)
from .accounting import BatchAccount, reconcile

LAUNCH_TIMEOUT = 600  # seconds for one launch (a few updates on every rank)
# The rule each planted fault must fail.
CAUGHT_BY = {"rank_seed": "identical initial parameters",
             "same_order": "disjoint shards covering the split",
             "all_ranks_write": "only rank 0 writes",
             "fixed_order": "a new order every pass",
             "bn_rank0": "batch-norm statistics synchronised",
             "rank_mean_loss": "loss normalised over a partial update (unequal shares)"}
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


def launch(spec: ReplicaSpec, folder: Path, resume_from: Path | None = None,
           timeout: float = LAUNCH_TIMEOUT) -> dict[str, Any]:
    """Run `spec` on its shape's replicas, one process each, with torchrun into the new
    `folder` and return what rank 0 gathered. A stuck launch is killed with every worker after
    `timeout` seconds."""
    replicas = spec.shape.replicas
    if not isinstance(replicas, int) or replicas < 2:
        raise WorkbookError(f"replicas must be 2 or more, got {replicas!r}",
                            "data parallelism needs at least two processes")
    claim_dir(folder)  # a launch never writes over an earlier one
    cmd = command(spec, folder, resume_from)
    done = fresh_process(cmd["args"], timeout, f"the {replicas}-process launch",
                         launcher=cmd["launcher"])
    if done.returncode:
        log = write_text(folder / "launch-error.log", done.stdout + done.stderr)
        errors = re.findall(r"error: (.*(?:\n  -> fix: .*)?)", done.stderr)
        raised = re.findall(r"^\[rank\d+\]: \w*(?:Error|Exception)\b.*$", done.stderr, re.M)
        shown = errors[-1] if errors else "; ".join(dict.fromkeys(raised)) or \
            done.stderr.strip()[-800:]
        raise WorkbookError(f"the {replicas}-process launch failed (exit {done.returncode}): "
                            f"{shown}", f"every rank's output is in {shown_path(log)}")
    return read_json(folder / RESULT, "the launch's result")


def command(spec: ReplicaSpec, folder: Path,
            resume_from: Path | None = None) -> dict[str, list[str]]:
    """The torchrun command line of a launch: `python LAUNCHER -m workbook ARGS`."""
    launcher = ["-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={spec.shape.replicas}", "--max_restarts=0"]
    args = ["ddp", "--spec", json.dumps(asdict(spec)), "--out", str(folder)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    return {"launcher": launcher, "args": args}


def rented_spec(spec: ReplicaSpec, gpus: int = 8) -> ReplicaSpec:
    """The launch to run by hand on the rented machine before the campaign: the same rules at
    the rental's scale - one process per GPU, bf16, 100 updates over the whole training and
    validation splits, a checkpoint at update 50 - not the pilot's 10 fp32 updates on 32
    examples."""
    return replace(spec, device="cuda", shape=replace(spec.shape, replicas=gpus,
                                                      precision="bf16"),
                   updates=100, train_limit=0, validation_limit=0, checkpoint_at=50)


def shell_command(spec: ReplicaSpec, out: str = "runs/ddp") -> str:
    """The command to run the same launch by hand, e.g. on a rented multi-GPU machine."""
    import shlex

    cmd = command(spec, Path(out))
    return "torchrun " + shlex.join([*cmd["launcher"][2:], "-m", "workbook", *cmd["args"]])


# --- the rules ------------------------------------------------------------------------------
def _row(rule: str, verdict: str, measured: str) -> dict[str, str]:
    return {"rule": rule, "verdict": verdict, "measured": measured,
            "remediation": REMEDIATION[rule] if verdict == "fail" else ""}


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
    rows.append(_row("only rank 0 writes", "fail" if others else "pass",
                     "; ".join(f"rank {r} wrote {final_names(f)}" for r, f in others.items())
                     or f"rank 0 wrote {final_names(result['writes'][0]) or 'nothing'}; the "
                     f"other {world - 1} rank(s) nothing"))
    for rule, key in (("identical initial parameters", "init"),
                      ("replicas identical after training", "final")):
        digests = result["init_digest"] if key == "init" else [r["final_digest"] for r in ranks]
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        rows.append(_row(rule, "fail" if differ else "pass",
                         f"ranks {differ} differ from rank 0" if differ else
                         f"one parameter digest on all {world} ranks"))
    rows += _shard_rows(result)
    recon = accounting(result, items, task)
    wrong = recon[~recon.match]
    rows.append(_row("examples per update = micro-batch x accumulation x replicas",
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
        shards = _row("disjoint shards covering the split", "fail",
                      f"{len(overlap)} examples on more than one rank in the updates of the "
                      "first pass (the run did not finish it: coverage not checked)")
    elif not complete:
        shards = _row("disjoint shards covering the split", "not applicable",
                      "the run did not finish a pass (raise updates)")
    else:
        bad = bool(overlap or missing)
        shards = _row("disjoint shards covering the split", "fail" if bad else "pass",
                      f"{len(overlap)} examples on more than one rank, {len(missing)} on none"
                      if bad else f"{len(result['train_ids'])} examples, each on exactly one of "
                      f"{len(ranks)} ranks in the first pass")
    second = [[i for rec in recs if rec["epoch"] == 1 for i in rec["ids"]] for recs in ranks]
    if not all(second):
        order = _row("a new order every pass", "not applicable",
                     "the run did not reach a second pass")
    else:
        same = [r for r, (a, b) in enumerate(zip(seen, second, strict=True))
                if a[:len(b)] == b[:len(a)]]
        order = _row("a new order every pass", "fail" if same else "pass",
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
    rows = [_row("gradient all-reduce on the last micro-step only",
                 "pass" if two["all_reduces"] == one["all_reduces"] else "fail",
                 f"{one['all_reduces']} all-reduce call(s) per update without accumulation, "
                 f"{two['all_reduces']} with 2 micro-steps")]
    for case, rule in GRADIENT_RULES.items():
        check = checks[case]
        dev = check["max_relative_deviation"]
        ok = dev <= tolerance and check["identical_on_ranks"]
        rows.append(_row(rule, "pass" if ok else "fail",
                         f"{check['split']} on {len(check['targets_per_rank'])} ranks against "
                         f"1 x {check['examples']} in one process: max relative deviation "
                         f"{dev:.1e} (tolerance {tolerance:.0e}); targets per rank "
                         f"{[int(t) for t in check['targets_per_rank']]}"
                         + _rank_mean_note(check, tolerance)))
    return rows


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
        return _row(rule, "not applicable", "the model has no batch-norm layer")
    problems = []
    for where, c in zip(("checkpoint", "final evaluation"), checks, strict=False):
        if not c["identical_after_sync"]:
            problems.append(f"ranks still differ at the {where}")
        if c["saved_vs_rank_mean"] is not None and c["saved_vs_rank_mean"] > 1e-6 and \
                c["ranks_differed_by"] > 1e-6:
            problems.append(f"the {where} holds statistics {c['saved_vs_rank_mean']:.2g} away "
                            "from the mean over ranks (one rank's only)")
    c = checks[0]
    return _row(rule, "fail" if problems else "pass", "; ".join(problems) or
                f"{c['layers']} layer(s); the ranks differed by {c['ranks_differed_by']:.2g} "
                "before the sync; the checkpoint holds their mean")


def reduce_sums(sums: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Numerators and denominators added over ranks."""
    return {k: [sum(s[k][0] for s in sums), sum(s[k][1] for s in sums)] for k in sums[0]}


def _eval_row(result: dict[str, Any], tolerance: float) -> dict[str, str]:
    rule = "evaluation reduced as sums over ranks"
    ev = result["evaluation"]
    reduced, single = reduce_sums([r["sums"] for r in ev["ranks"]]), ev["single"]
    deviations = {k: abs(reduced[k][0] / reduced[k][1] - single[k][0] / single[k][1]) /
                  max(abs(single[k][0] / single[k][1]), 1e-12) for k in single if single[k][1]}
    means = [r["sums"][LOSS][0] / max(r["sums"][LOSS][1], 1) for r in ev["ranks"]]
    wrong = sum(means) / len(means)
    right = single[LOSS][0] / single[LOSS][1]
    worst = max(deviations.values())
    sizes = [r["examples"] for r in ev["ranks"]]
    return _row(rule, "pass" if worst <= tolerance else "fail",
                f"shards of {sizes} examples; loss {reduced[LOSS][0] / reduced[LOSS][1]:.6g} "
                f"reduced vs {right:.6g} in one process (max relative deviation {worst:.1e}); "
                f"the mean of rank means would say {wrong:.6g}")


def evaluation_table(result: dict[str, Any]) -> pd.DataFrame:
    """Loss and metrics per rank, reduced over ranks and in one process."""
    ev = result["evaluation"]
    rows = [{"evaluated by": f"rank {r}", "examples": e["examples"], **_ratios(e["sums"])}
            for r, e in enumerate(ev["ranks"])]
    total = sum(e["examples"] for e in ev["ranks"])
    rows.append({"evaluated by": "all ranks (sums reduced)", "examples": total,
                 **_ratios(reduce_sums([e["sums"] for e in ev["ranks"]]))})
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
                         "finite": bool(frame.loss.map(_finite).all())})
        for phase, seconds in (("evaluation", r["eval_s"]), ("checkpoint", r["checkpoint_s"])):
            rows.append({"rank": rank, "phase": phase, "median_s": seconds})
    return pd.DataFrame(rows)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


# --- resume and planted faults ----------------------------------------------------------------
def resume_check(spec: ReplicaSpec, reference: dict[str, Any], reference_folder: Path,
                 folder: Path, tolerance: float = 0.0) -> tuple[dict[str, str], pd.DataFrame]:
    """Continue the reference launch's checkpoint in N new processes and compare update by
    update (loss, learning rate, every rank's examples) and the final parameters."""
    if not reference.get("checkpoint"):
        raise WorkbookError("the reference launch wrote no checkpoint",
                            "give checkpoint_at, an update before the last")
    resumed = launch(spec, folder,
                     resume_from=reference_folder / reference["checkpoint"]["path"])
    ref = {rec["step"]: [r["records"][i] for r in reference["ranks"]]
           for i, rec in enumerate(reference["ranks"][0]["records"])}
    rows = []
    for i, rec in enumerate(resumed["ranks"][0]["records"]):
        mine = [r["records"][i] for r in resumed["ranks"]]
        theirs = ref[rec["step"]]
        rows.append({"step": rec["step"], "loss_uninterrupted": theirs[0]["loss"],
                     "loss_resumed": rec["loss"], "loss_diff": abs(rec["loss"] -
                                                                   theirs[0]["loss"]),
                     "same_lr": rec["lr"] == theirs[0]["lr"],
                     "same_examples_on_every_rank": all(
                         a["ids"] == b["ids"] for a, b in zip(mine, theirs, strict=True))})
    table = pd.DataFrame(rows)
    a, b = load_file(str(reference_folder / WEIGHTS)), load_file(str(folder / WEIGHTS))
    diff = max_difference(a, b)
    exact = bool(len(table) and table.same_lr.all() and table.same_examples_on_every_rank.all()
                 and table.loss_diff.max() <= tolerance and diff <= tolerance
                 and table.step.iloc[-1] == spec.updates)
    return _row("resume in new processes is exact", "pass" if exact else "fail",
                f"resumed after update {resumed['first_step'] - 1} in {resumed['world']} new "
                f"processes: {len(table)} updates compared, max loss difference "
                f"{table.loss_diff.max():.1e}, max parameter difference {diff:.1e} "
                f"(tolerance {tolerance:g})"), table


NOT_DEMONSTRABLE = "not demonstrable on this task: "


@dataclass
class Demonstration:
    """The launch that plants one fault: its settings and the training items it runs on, or
    (`why`) the reason no data of this task can show the fault."""

    spec: ReplicaSpec
    items: list[Item] = field(repr=False)
    why: str = ""


def demonstration(fault: str, spec: ReplicaSpec, items: list[Item],
                  reference: dict[str, Any] | None = None, task: Task | None = None,
                  tolerance: float = 1e-4) -> Demonstration:
    """Settings and data on which the planted `fault` is observable: a demonstration whose data
    cannot show its fault proves nothing about the rule, and its miss is no finding about the
    task. What the launch without the fault measured (`reference`) or this process can compute
    decides it; where nothing can show the fault, `why` says so."""
    planted, world = replace(spec, fault=fault), spec.shape.replicas
    if fault == "rank_seed" and task is not None and not _init_depends_on_seed(task, spec.seed):
        return Demonstration(planted, items, f"build_model gives bit-identical parameters "
                             f"after seeding with {spec.seed} and with {spec.seed + 1} "
                             "(pretrained or fixed initialisation), so seeding with the rank "
                             "changes nothing")
    if fault == "all_ranks_write" and not spec.checkpoint_at:  # only a checkpoint shows it
        planted = replace(planted, checkpoint_at=1)
    if fault == "fixed_order":  # every rank must read examples of a second pass
        n = _second_pass_examples(planted, len(items))
        if n is None:
            per_update = spec.shape.examples_per_update
            return Demonstration(planted, items, f"{spec.updates} updates of {per_update} "
                                 f"examples reach no second pass on every rank even with the "
                                 f"fewest training examples the gradient check takes "
                                 f"({2 * world}): raise updates")
        if n < len(items):
            check = min(spec.check_examples, n // (2 * world) * 2 * world)
            planted, items = replace(planted, train_limit=n, check_examples=check), items[:n]
    if fault == "bn_rank0":
        checks = [c for c in ((reference or {}).get("batch_norm_final"),
                              ((reference or {}).get("checkpoint") or {}).get("batch_norm"))
                  if c and c.get("layers")]
        off = max((c.get("rank0_vs_rank_mean", c["ranks_differed_by"]) for c in checks),
                  default=None)
        if off is not None and off <= 1e-6:
            return Demonstration(planted, items, f"rank 0's batch-norm statistics were within "
                                 f"{off:.1g} of the mean over ranks in the launch without the "
                                 "bug (the ranks' statistics agree), so saving rank 0's saves "
                                 "the mean")
    if fault == "rank_mean_loss":
        why = _rank_mean_alike(_partial_check(reference) or _rank_mean_here(task, items, spec),
                               tolerance)
        if why:
            return Demonstration(planted, items, why)
    return Demonstration(planted, items)


def _init_depends_on_seed(task: Task, seed: int) -> bool:
    """Whether the task's model is initialised differently under another seed (this process's
    random state is left as it was)."""
    state = ckpt.rng_state()
    try:
        digests = []
        for s in (seed, seed + 1):
            seed_everything(s)
            digests.append(digest(task.build_model().state_dict()))
    finally:
        ckpt.set_rng_state(state)
    return digests[0] != digests[1]


def _passes_read(n: int, spec: ReplicaSpec, world: int) -> list[set[int]]:
    """The passes in which each rank reads real examples during a launch of `spec` from
    scratch on `n` training examples (the pass order is a pure function, nothing runs)."""
    read: list[set[int]] = [set() for _ in range(world)]
    step, epoch = 0, 0
    while step < spec.updates:
        groups = update_groups(n, spec, epoch, world)[: spec.updates - step]
        for group in groups:
            for r in range(world):
                if shard(group, r, world, spec.shape.micro_batch, spec.fault)[0]:
                    read[r].add(epoch)
        step, epoch = step + len(groups), epoch + 1
    return read


def _second_pass_examples(spec: ReplicaSpec, available: int) -> int | None:
    """The most training examples (at most `available`, at least what the gradient check
    takes) on which every rank of the launch reads examples of a second pass."""
    world, per_update = spec.shape.replicas, spec.shape.examples_per_update
    for n in range(min(available, max(1, (spec.updates - 1) * per_update)), 2 * world - 1, -1):
        if all(1 in passes for passes in _passes_read(n, spec, world)):
            return n
    return None


def _partial_check(launched: dict[str, Any] | None) -> dict[str, Any] | None:
    """The partial case of a launch's gradient check, when it measured the per-rank mean."""
    for check in (launched or {}).get("gradient_check") or []:
        if check["case"] == "partial" and "rank_mean_deviation" in check:
            return check
    return None


def _rank_mean_here(task: Task | None, items: list[Item],
                    spec: ReplicaSpec) -> dict[str, Any] | None:
    """The gradient check's partial case computed in this process (no launch): what a mean
    per rank gives against the whole update's normalisation, at the launch's initial model."""
    world, n = spec.shape.replicas, spec.check_examples
    if task is None or n % (2 * world) or n > len(items):
        return None  # the launch says what is wrong with the settings
    chosen = check_items(task, items, n, world)[: n - 1]
    state = ckpt.rng_state()
    try:
        seed_everything(spec.seed)
        model = task.build_model()
    finally:
        ckpt.set_rng_state(state)
    cpu = torch.device("cpu")
    grads, counts = rank_mean_gradient(task, model, chosen, world, cpu)
    return {"examples": n - 1, "targets_per_rank": counts,
            "split": " + ".join(f"1 x {len(chosen[r::world])}" for r in range(world)),
            "rank_mean_deviation": relative_deviation(grads, reference_gradient(
                task, model, chosen, cpu))}


def _rank_mean_alike(check: dict[str, Any] | None, tolerance: float) -> str:
    """Why a mean per rank cannot be told from the right normalisation on the check's data
    ("" when it can, or when nothing says)."""
    if check is None or check["rank_mean_deviation"] > tolerance:
        return ""
    targets = [int(t) for t in check["targets_per_rank"]]
    cause = ("the loss counts as many targets on every rank whichever examples are chosen"
             if len(set(targets)) == 1 else
             "every rank's share has the same mean gradient per target (alike examples)")
    return (f"on the gradient check's {check['examples']} examples ({check['split']}, targets "
            f"per rank {targets}) a mean per rank gives the whole update's gradient to "
            f"{check['rank_mean_deviation']:.1e} (tolerance {tolerance:.0e}): {cause}")


def planted_faults(spec: ReplicaSpec, items: list[Item], folder: Path,
                   reference: dict[str, Any] | None, faults: tuple[str, ...] = tuple(FAULTS),
                   task: Task | None = None, tolerance: float = 1e-4) -> pd.DataFrame:
    """Each classic multi-process bug planted in its own launch, on data that can show it
    (`demonstration`): does the rule meant to name it fail? A bug the task's model cannot have
    (batch norm without batch-norm layers) is listed, not launched; one no data of this task
    can show is "not demonstrable", with the reason - neither fails the verdict."""
    rows = []
    for fault in faults:
        expected = CAUGHT_BY[fault]
        row = {"planted bug": FAULTS[fault], "rule": expected}
        bn = (reference or {}).get("batch_norm_final")
        if fault == "bn_rank0" and bn is not None and not bn.get("layers"):
            rows.append({**row, "verdict": "not applicable", "caught": None,
                         "other failing rules": "",
                         "measured": "not planted: the model has no batch-norm layer"})
            continue
        demo = demonstration(fault, spec, items, reference, task, tolerance)
        if not demo.why:
            result = launch(demo.spec, folder / f"fault-{fault}")
            table = rules(result, demo.items, tolerance, task=task).set_index("rule")
            verdict = table.verdict[expected]
            if verdict != "fail" and fault == "rank_mean_loss":  # the launch's own measure
                demo.why = _rank_mean_alike(_partial_check(result), tolerance)
        if demo.why:
            rows.append({**row, "verdict": "not demonstrable", "caught": None,
                         "other failing rules": "", "measured": NOT_DEMONSTRABLE + demo.why})
            continue
        rows.append({**row, "verdict": verdict, "caught": verdict == "fail",
                     "other failing rules": ", ".join(r for r in table.index[table.verdict ==
                                                                             "fail"]
                                                      if r != expected),
                     "measured": table.measured[expected]})
    return pd.DataFrame(rows)


def check_devices(device: str, replicas: int) -> str:
    """Check the settings and say which collective backend carries them: gloo on the CPU, NCCL
    with one GPU per process, gloo on CUDA tensors when processes must share GPUs (NCCL refuses
    two ranks on one GPU). Returns a line for the reader."""
    if device not in ("cpu", "cuda"):
        raise WorkbookError(f"device {device!r} is not one notebook 09 runs on",
                            "use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per process)")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 2:
        raise WorkbookError(f"replicas must be an integer of 2 or more, got {replicas!r}",
                            "data parallelism needs at least two processes")
    if device == "cuda":
        resolve_device(device)  # no GPU at all: the clear error, not a launch that fails
    chosen = backend(device, replicas)
    if device == "cpu":
        return f"{replicas} processes on the CPU, collectives over gloo"
    if chosen == "nccl":
        return f"{replicas} processes, one GPU each, collectives over NCCL"
    return (f"{replicas} processes share {torch.cuda.device_count()} GPU(s): NCCL needs one GPU "
            "per process, so gloo carries the collectives on CUDA tensors. The rules are the "
            "same; NCCL itself is not exercised - run with one GPU per process to check it")


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


@dataclass
class ParallelResult:
    """Everything notebook 09 shows: the launch, its rules (the resume in new processes
    included), the accounting over ranks, evaluation, phase times and the planted bugs."""

    task: Task
    backend: str  # which collective backend carries the launch, in words
    spec: ReplicaSpec
    account: BatchAccount  # the calculator for this launch
    launch: dict  # what rank 0 gathered
    rules: pd.DataFrame
    accounting: pd.DataFrame
    evaluation: pd.DataFrame
    phases: pd.DataFrame
    resume_row: dict
    resumed: pd.DataFrame
    faults: pd.DataFrame | None
    rented_command: str  # the same launch on 8 GPUs, by hand
    sharded: "ShardedCheck | None" = None  # the FSDP2 section (parameter fsdp)


def run(params: dict[str, Any], out_dir: Path) -> ParallelResult:
    """Notebook 09 from its parameters: the launch, the resume and the planted bugs run in
    folders under `out_dir`."""
    shape = UpdateShape.from_params(params)
    if not 0 < params["checkpoint_at"] < params["updates"]:
        raise WorkbookError(f"checkpoint_at {params['checkpoint_at']} is not an update before "
                            f"the last (updates={params['updates']}): the resume check needs a "
                            "checkpoint to continue from",
                            f"give checkpoint_at between 1 and {params['updates'] - 1}")
    backend_line = check_devices(params["device"], shape.replicas)
    task = task_from_params(params)
    items = prepare(task, ("train",), {"train": params["train_limit"]}).train
    spec = ReplicaSpec(params["task"], params["task_options"], shape, params["updates"],
                       params["lr"], params["seed"], params["train_limit"],
                       params["validation_limit"], params["eval_batch"],
                       check_examples=params["check_examples"],
                       checkpoint_at=params["checkpoint_at"], device=params["device"])
    result = launch(spec, out_dir / "run", timeout=params["launch_timeout"])
    resume_row, resumed = resume_check(spec, result, out_dir / "run", out_dir / "resumed",
                                       params["resume_tolerance"])
    faults = (planted_faults(spec, items, out_dir, result, task=task,
                             tolerance=params["tolerance"])
              if params["demonstrate_faults"] else None)
    rented = rented_spec(spec)
    sharded = (sharded_check(sharded_spec(spec), task, out_dir, params["tolerance"],
                             params["resume_tolerance"], params["launch_timeout"])
               if params.get("fsdp", True) else None)
    return ParallelResult(
        task, backend_line, spec, BatchAccount(shape, len(items)), result,
        with_row(rules(result, items, params["tolerance"], task=task), resume_row),
        accounting(result, items, task), evaluation_table(result), phase_table(result),
        resume_row, resumed, faults, shell_command(rented), sharded)


def save(result: ParallelResult, out_dir: Path) -> str:
    """Notebook 09's tables and `summary.json`. The verdict fails on a failing rule, and on a
    planted bug its rule missed (a rule that misses its bug cannot be trusted on yours)."""
    from ..storage.runs import save_table, write_summary

    rules, accounting, phases, resumed, faults = (result.rules, result.accounting,
                                                  result.phases, result.resumed, result.faults)
    for table, name in ((rules, "rules"), (accounting, "accounting"), (phases, "phases"),
                        (resumed, "resume")):
        save_table(table, out_dir, name)
    caught = not_shown = None
    if faults is not None:
        save_table(faults, out_dir, "planted_faults")
        caught = {r["planted bug"]: r["caught"] for r in faults.to_dict("records")}
        not_shown = {r["planted bug"]: r["measured"] for r in faults.to_dict("records")
                     if r.get("verdict") == "not demonstrable"}
    verdict_ = outcome(rules, faults)
    sharded = result.sharded
    fsdp = None
    if sharded is not None:
        for table, name in ((sharded.rules, "fsdp_rules"), (sharded.faults, "fsdp_planted_faults"),
                            (sharded.resumed, "fsdp_resume"), (sharded.memory, "fsdp_memory")):
            save_table(table, out_dir, name)
        if sharded_verdict(sharded) == "fail":
            verdict_ = "fail"
        errors = sharded.memory.error_pct.dropna()
        fsdp = {"rules": sharded.rules.set_index("rule").verdict.to_dict(),
                "faults_caught": {r["planted bug"]: r["caught"]
                                  for r in sharded.faults.to_dict("records")},
                "memory_max_abs_error_pct": float(f"{errors.abs().max():.3g}")
                if len(errors) else None,
                "seconds": round(sharded.seconds, 1)}
    checks = {c["case"]: float(f"{c['max_relative_deviation']:.2g}")
              for c in result.launch["gradient_check"]}
    write_summary(out_dir, verdict_, {
        "replicas": result.spec.shape.replicas,
        "rules_failing": int((rules.verdict == "fail").sum()),
        "gradient_max_relative_deviation": checks, "faults_caught": caught,
        "faults_not_demonstrable": not_shown,
        "all_reduce_median_s": float(phases[phases.phase == "all-reduce"].median_s.median()),
        "fsdp": fsdp},
        task=result.task.name, rules=rules.set_index("rule").verdict.to_dict())
    return verdict_


# --- FSDP2: the rules that change under sharding ---------------------------------------------
FSDP_REMEDIATION = {
    "every rank writes its shard of the checkpoint":
        "save a sharded model with torch.distributed.checkpoint on EVERY rank: "
        "dcp.save(get_state_dict(model, optimizer), checkpoint_id=DIR) is a collective; never "
        "guard it with `if rank == 0:` (that writes rank 0's shards only)",
    "first updates agree with one process (1 x N)":
        "divide the summed loss by the all-reduced target count of the whole update (FSDP's "
        "reduce-scatter averages over ranks, so x ranks), keep every parameter inside a "
        "fully_shard unit, and give every rank the same initial weights",
    "tied weights stay one tensor under sharding":
        "tie the weights BEFORE fully_shard (build the model tied, or call model.tie_weights() "
        "first) and keep both owners in one fully_shard unit (e.g. the root)",
    "resume from the sharded checkpoint in new processes is exact":
        "load with dcp.load into the sharded model and optimizer on every rank and apply it "
        "with set_state_dict; restore each rank's random state, the schedule and the data "
        "position from the same checkpoint",
}
FSDP_RULES = tuple(FSDP_REMEDIATION)
FSDP_CAUGHT_BY = {"rank0_checkpoint": "every rank writes its shard of the checkpoint",
                  "tie_after_shard": "tied weights stay one tensor under sharding"}


def _fsdp_row(rule: str, verdict: str, measured: str) -> dict[str, str]:
    return {"rule": rule, "verdict": verdict, "measured": measured,
            "remediation": FSDP_REMEDIATION[rule] if verdict == "fail" else ""}


FSDP_CHECKPOINT_AT = 2  # the FSDP run checkpoints after update 2 at the latest ...
FSDP_RESUMED_UPDATES = 2  # ... and resumes for 2 more (the shard order is the DDP run's rule)


def sharded_spec(spec: ReplicaSpec, **changes: Any):
    """The FSDP launch of the same run: task, update shape, data and learning rate; a short
    run (a checkpoint after `FSDP_CHECKPOINT_AT` updates, `FSDP_RESUMED_UPDATES` after it)."""
    from ..training.sharded_replica import ShardedSpec

    at = min(spec.checkpoint_at, FSDP_CHECKPOINT_AT)
    settings = {"updates": min(spec.updates, at + FSDP_RESUMED_UPDATES), "checkpoint_at": at,
                **changes}
    return ShardedSpec(spec.task, spec.task_options, spec.shape, lr=spec.lr, seed=spec.seed,
                       train_limit=spec.train_limit, validation_limit=spec.validation_limit,
                       eval_batch=spec.eval_batch, drop_partial=spec.drop_partial,
                       device=spec.device, collective_timeout_s=spec.collective_timeout_s,
                       **settings)


def shard_rule(launched: dict[str, Any], name: str) -> dict[str, str]:
    """Did every rank write its shard into checkpoint `name`, and does its metadata hold every
    element of every tensor?"""
    rule = FSDP_RULES[0]
    point = launched["checkpoint"]
    written, cov = point["written"][name], point["coverage"][name]
    idle = [r for r, files in enumerate(written) if not any(f.endswith(".distcp")
                                                            for f in files)]
    who = "; ".join(f"rank {r} wrote {', '.join(f) or 'nothing'}" for r, f in enumerate(written))
    share = cov["covered"] / max(cov["elements"], 1)
    if idle or cov["covered"] < cov["elements"]:
        return _fsdp_row(rule, "fail",
                         f"{name}: {who}; its metadata covers {cov['covered']:,} of "
                         f"{cov['elements']:,} elements ({100 * share:.1f}%): "
                         f"{cov['short_tensors']} tensors lack the shards of rank(s) "
                         f"{idle or '?'} (e.g. {', '.join(cov['short_examples'])})")
    return _fsdp_row(rule, "pass", f"{name}: {who}; its metadata covers all "
                     f"{cov['elements']:,} elements of the model and optimizer state")


def first_updates_rule(launched: dict[str, Any], run: str = "clean",
                       tolerance: float = 1e-4) -> dict[str, str]:
    """The first updates of the sharded run against the same updates in one process: the loss
    of each and the first update's gradient, relative, within `tolerance`. The parameters after
    them are shown, not judged: AdamW divides each element's step by that element's own
    gradient size, so gradients that differ only by rounding (the reduce-scatter adds in
    another order) can still give steps up to the learning rate apart."""
    rule = FSDP_RULES[1]
    first = launched["first_updates"]
    got = first["runs"][run]
    ref = first["reference_losses"]
    loss_dev = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], ref,
                                                                    strict=True))
    grad_dev, missing = got["gradient_deviation"], got["missing_gradients"]
    ok = loss_dev <= tolerance and grad_dev <= tolerance and not missing
    world = launched["world"]
    shape = launched["spec"]["shape"]
    text = (f"{first['updates']} updates of {world} ranks x {shape['accumulation']} x "
            f"{shape['micro_batch']} against the same examples in one process: loss max "
            f"relative deviation {loss_dev:.1e}, first update's gradient {grad_dev:.1e} "
            f"(tolerance {tolerance:.0e}); parameters after them {got['parameter_deviation']:.1e} "
            "apart (relative; shown, not judged: AdamW scales each element's step by its own "
            "gradient, so rounding-level gradient differences can move it by up to lr)")
    if missing:
        text += f"; no gradient in the sharded run for {', '.join(missing)}"
    return _fsdp_row(rule, "pass" if ok else "fail", text)


def tie_rule(launched: dict[str, Any], run: str = "clean") -> dict[str, str]:
    rule = FSDP_RULES[2]
    groups = launched["tied_groups"]
    if not groups:
        return _fsdp_row(rule, "not applicable", "the model shares no parameter between "
                         "modules (no tied weights)")
    got = launched["first_updates"]["runs"][run]
    names = ["/".join(g) for g in groups]
    split = [names[g] for g in got["split_groups"]]
    saved = got["saved_tie_difference"]
    if split:
        return _fsdp_row(rule, "fail", f"{', '.join(split)}: different tensors inside the "
                         f"forward ({got['forwards_checked']} forwards checked) - a module "
                         "computes with a copy FSDP gathers and the optimizer never updates; "
                         "the gathered state dict still shows them equal (max difference "
                         f"{max(saved.values(), default=0):.1g}), so only the forward shows it")
    return _fsdp_row(rule, "pass", f"{', '.join(names)}: one tensor in every forward "
                     f"({got['forwards_checked']} checked) and equal in the gathered state")


def sharded_resume_rule(launched: dict[str, Any], resumed: dict[str, Any], folder: Path,
                        resumed_folder: Path, tolerance: float = 0.0
                        ) -> tuple[dict[str, str], pd.DataFrame]:
    """The resumed launch against the uninterrupted one: the restored weights and optimizer
    state (digests), every later update (loss, learning rate, each rank's examples), the final
    parameters."""
    rule = FSDP_RULES[3]
    ref = {rec["step"]: [r[i] for r in launched["records"]]
           for i, rec in enumerate(launched["records"][0])}
    rows = []
    for i, rec in enumerate(resumed["records"][0]):
        mine, theirs = [r[i] for r in resumed["records"]], ref[rec["step"]]
        rows.append({"step": rec["step"], "loss_uninterrupted": theirs[0]["loss"],
                     "loss_resumed": rec["loss"],
                     "loss_diff": abs(rec["loss"] - theirs[0]["loss"]),
                     "same_lr": rec["lr"] == theirs[0]["lr"],
                     "same_examples_on_every_rank": all(
                         a["ids"] == b["ids"] for a, b in zip(mine, theirs, strict=True))})
    table = pd.DataFrame(rows)
    a, b = load_file(str(folder / WEIGHTS)), load_file(str(resumed_folder / WEIGHTS))
    diff = max_difference(a, b)
    point, got = launched["checkpoint"], resumed["restored"]
    same_model = got["model_digest"] == point["model_digest"]
    same_optim = got["optim_digest"] == point["optim_digest"]
    exact = bool(same_model and same_optim and len(table) and table.same_lr.all()
                 and table.same_examples_on_every_rank.all()
                 and table.loss_diff.max() <= tolerance and diff <= tolerance
                 and table.step.iloc[-1] == launched["spec"]["updates"])
    restored = ("weights and optimizer state restored bit-identical" if same_model and
                same_optim else f"restored {'weights' if not same_model else ''}"
                f"{' and ' if not (same_model or same_optim) else ''}"
                f"{'optimizer state' if not same_optim else ''} differ from the saved ones")
    return _fsdp_row(rule, "pass" if exact else "fail",
                     f"resumed after update {resumed['first_step'] - 1} in {resumed['world']} "
                     f"new processes: {restored}; {len(table)} updates compared, max loss "
                     f"difference {table.loss_diff.max():.1e}, max parameter difference "
                     f"{diff:.1e} (tolerance {tolerance:g})"), table


def sharded_faults(launched: dict[str, Any], resumed: dict[str, Any],
                   tolerance: float = 1e-4) -> pd.DataFrame:
    """The planted FSDP bugs of the same launches: does the rule meant to name each fail?"""
    from ..training.sharded_replica import PLANTED_PREFIX, SHARDED_FAULTS

    rows = []
    planted = PLANTED_PREFIX + launched["checkpoint"]["path"]
    row = shard_rule(launched, planted)
    load = resumed.get("planted_load") or {}
    if "error" in load:
        then = f"; loading it in new processes failed: {load['error']}"
    else:
        off = load.get("rank_max_difference", [])
        bad = [r for r, d in enumerate(off) if d > 0]
        then = ("; loaded in new processes without an error, it left the shards of rank(s) "
                f"{bad} up to {max(off):.1e} away from the saved values (they keep the fresh "
                "model's)" if bad else "; loaded in new processes, it restored every shard")
    rows.append({"planted bug": SHARDED_FAULTS["rank0_checkpoint"],
                 "rule": FSDP_CAUGHT_BY["rank0_checkpoint"], "verdict": row["verdict"],
                 "caught": row["verdict"] == "fail", "other failing rules": "",
                 "measured": row["measured"] + then})
    fault = "tie_after_shard"
    base = {"planted bug": SHARDED_FAULTS[fault], "rule": FSDP_CAUGHT_BY[fault]}
    if not launched["tied_groups"]:
        rows.append({**base, "verdict": "not demonstrable", "caught": None,
                     "other failing rules": "", "measured": NOT_DEMONSTRABLE +
                     "build_model shares no parameter between modules, so there is no tie to "
                     "make after sharding (the generation sample shows it with task_options "
                     "{'tie_embeddings': True})"})
    else:
        row = tie_rule(launched, fault)
        first = first_updates_rule(launched, fault, tolerance)
        rows.append({**base, "verdict": row["verdict"], "caught": row["verdict"] == "fail",
                     "other failing rules": first["rule"] if first["verdict"] == "fail" else "",
                     "measured": row["measured"]})
    return pd.DataFrame(rows)


def _predicted_sharded(task: Task, spec, world: int) -> tuple[pd.DataFrame | None, str]:
    """`sharding.predict_sharded` for the launch's model and plan (the model 09 trains, not a
    campaign model), or None and why not."""
    from ..training.predict import Plan

    try:
        from ..training.sharding import predict_sharded
    except ImportError as exc:
        return None, f"no prediction: workbook.training.sharding is not available ({exc})"
    data = prepare(task, limits={"train": spec.train_limit, "validation": spec.validation_limit})
    plan = Plan(replace(spec.shape, replicas=1), spec.plan_length or None, spec.eval_batch,
                spec.plan_eval_length or None)
    try:
        with warnings.catch_warnings():  # FSDP2's note on a root returning a view (logits)
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            return predict_sharded(task, data.train, data.validation or data.train, plan,
                                   world, campaign=False), ""
    except WorkbookError as exc:
        return None, f"no prediction: {exc.problem}"
    except Exception as exc:  # the prediction's failure is not the run's: the rules stand
        from ..base.errors import reason

        return None, f"no prediction: predict_sharded failed ({reason(exc, 200)})"


def memory_table(task: Task, spec, measured: list[dict[str, int]],
                 predicted: pd.DataFrame | None = None, note: str = "",
                 measured_note: str = "") -> pd.DataFrame:
    """Per rank and phase: the peak measured on this machine (live tensors: the CPU profiler's
    allocation events, the CUDA allocator on a GPU) against `sharding.predict_sharded` for the
    same world and plan, and the error in percent; the note says why a prediction is missing
    or how the measurement differs from what the prediction models (`measured_note`)."""
    if predicted is None and not note:
        predicted, note = _predicted_sharded(task, spec, len(measured))
    note = "; ".join(n for n in (note, measured_note) if n)
    if predicted is None and measured:
        predicted = pd.DataFrame(columns=["phase", "predicted_peak_bytes"])
    by_phase = ({} if predicted is None else
                predicted.set_index("phase").predicted_peak_bytes.to_dict())
    rows = []
    for rank, peaks in enumerate(measured):
        for phase, bytes_ in peaks.items():
            guess = by_phase.get(phase)
            ok = guess is not None and guess == guess
            rows.append({"rank": rank, "phase": phase, "measured_peak_bytes": int(bytes_),
                         "predicted_peak_bytes": int(guess) if ok else None,
                         "error_pct": 100 * (guess - bytes_) / bytes_ if ok and bytes_ else None,
                         "note": note})
    return pd.DataFrame(rows)


@dataclass
class ShardedCheck:
    """Notebook 09's FSDP section: the training launch, the resume launch, the rules, the
    planted bugs, the resume table and the per-rank memory against the prediction."""

    spec: Any  # sharded_replica.ShardedSpec
    launch: dict
    resumed_launch: dict
    rules: pd.DataFrame
    faults: pd.DataFrame
    resumed: pd.DataFrame
    memory: pd.DataFrame
    seconds: float  # both launches, start to end


def sharded_check(spec, task: Task, folder: Path, tolerance: float = 1e-4,
                  resume_tolerance: float = 0.0, timeout: float = LAUNCH_TIMEOUT
                  ) -> ShardedCheck:
    """Two launches: one trains (and measures, compares, checkpoints, plants), one resumes in
    new processes (and loads the planted checkpoint)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ..training.sharded_replica import PLANTED_PREFIX

    start = time.perf_counter()
    trained, again = folder / "fsdp", folder / "fsdp-resumed"
    launched = launch(spec, trained, timeout=timeout)
    point = launched["checkpoint"]
    if not point:
        raise WorkbookError("the FSDP launch wrote no checkpoint",
                            "give checkpoint_at, an update before the last")
    planted = str(trained / (PLANTED_PREFIX + point["path"])) if spec.plant else ""
    # the prediction runs here while the new processes start and resume (they mostly wait)
    pool = ThreadPoolExecutor(1)
    try:
        future = pool.submit(launch, replace(spec, planted_checkpoint=planted, memory=False),
                             again, trained / point["path"], timeout)
        predicted, note = (_predicted_sharded(task, spec, launched["world"])
                           if launched.get("memory") else (None, "not measured"))
        resumed = future.result()
    finally:
        pool.shutdown(wait=False)
    seconds = time.perf_counter() - start
    resume_row, table = sharded_resume_rule(launched, resumed, trained, again,
                                            resume_tolerance)
    rules = pd.DataFrame([shard_rule(launched, point["path"]),
                          first_updates_rule(launched, "clean", tolerance),
                          tie_rule(launched, "clean"), resume_row])
    faults = sharded_faults(launched, resumed, tolerance) if spec.plant else \
        pd.DataFrame(columns=["planted bug", "rule", "verdict", "caught",
                              "other failing rules", "measured"])
    memory = memory_table(task, spec, launched.get("memory") or [], predicted, note,
                          launched.get("memory_note", ""))
    return ShardedCheck(spec, launched, resumed, rules, faults, table, memory, seconds)


def measure_fsdp(task: str, task_options: dict, plan, world: int, *, folder: Path | None = None,
                 train_limit: int = 32, validation_limit: int = 8, seed: int = 0,
                 lr: float = 1e-3, device: str = "cpu",
                 timeout: float = LAUNCH_TIMEOUT) -> pd.DataFrame:
    """For the benchmark: FSDP2 on `world` processes (gloo on the CPU) of the task's model
    (`build_model`, the model 09 trains) for `plan` (`predict.Plan`, replicas=1: micro-batch
    and accumulation per rank). One launch measures every phase's per-rank peak (live tensors);
    `sharding.predict_sharded` predicts it for the same world and plan. Columns: rank, phase,
    measured_peak_bytes, predicted_peak_bytes, error_pct, note."""
    import tempfile

    from ..training.sharded_replica import ShardedSpec

    shape = replace(plan.shape, replicas=world)
    spec = ShardedSpec(task, dict(task_options), shape, updates=1, lr=lr, seed=seed,
                       train_limit=train_limit, validation_limit=validation_limit,
                       eval_batch=plan.eval_batch or plan.shape.micro_batch, checkpoint_at=0,
                       device=device, plant=False, plan_length=plan.length or 0,
                       plan_eval_length=plan.eval_length or 0, train=False)
    with tempfile.TemporaryDirectory() as tmp:
        launched = launch(spec, Path(folder or tmp) / f"fsdp-memory-x{world}", timeout=timeout)
    return memory_table(task_from_spec(task, task_options), spec, launched["memory"],
                        measured_note=launched.get("memory_note", ""))


def task_from_spec(task: str, options: dict) -> Task:
    from ..contract.task import load_task

    return load_task(task, **options)


def sharded_verdict(check: ShardedCheck | None) -> str:
    """"fail" on a failing FSDP rule or a planted FSDP bug its rule missed."""
    if check is None:
        return "pass"
    missed = any(c is False for c in check.faults.caught.tolist())
    return "fail" if missed or (check.rules.verdict == "fail").any() else "pass"


__all__ = ["CAUGHT_BY", "FAULTS", "NOT_DEMONSTRABLE", "RULES", "Demonstration",
           "ParallelResult", "ReplicaSpec", "accounting", "command", "demonstration",
           "evaluation_table", "launch", "outcome", "phase_table", "planted_faults",
           "resume_check", "rules", "run", "save", "shell_command", "verdict", "with_row",
           "FSDP_RULES", "ShardedCheck", "measure_fsdp", "memory_table", "sharded_check",
           "sharded_faults", "sharded_spec", "sharded_verdict"]
