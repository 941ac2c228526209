"""Notebook 09's FSDP2 section: the sharded launch and its resume, the rules that change under
sharding, the planted FSDP bugs and the per-rank peak against `sharding.predict_sharded`."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from ...base.errors import WorkbookError
from ...contract.data import prepare
from ...contract.task import Task, load_task
from ...training.ranks import backend
from ...training.replica import ReplicaSpec
from .faults import NOT_DEMONSTRABLE
from .launches import LAUNCH_TIMEOUT, launch
from .rank_rules import outcome, resumed_against, rule_row

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
    return rule_row(rule, verdict, measured, FSDP_REMEDIATION)


FSDP_CHECKPOINT_AT = 2  # the FSDP run checkpoints after update 2 at the latest ...


FSDP_RESUMED_UPDATES = 2  # ... and resumes for 2 more (the shard order is the DDP run's rule)


def sharded_spec(spec: ReplicaSpec, **changes: Any):
    """The FSDP launch of the same run: task, update shape, data and learning rate; a short
    run (a checkpoint after `FSDP_CHECKPOINT_AT` updates, `FSDP_RESUMED_UPDATES` after it).
    Processes that would share a GPU run it on the CPU (`sharded_device`)."""
    from ...training.sharded_replica import ShardedSpec

    at = min(spec.checkpoint_at, FSDP_CHECKPOINT_AT)
    settings = {"updates": min(spec.updates, at + FSDP_RESUMED_UPDATES), "checkpoint_at": at,
                **changes}
    return ShardedSpec(spec.task, spec.task_options, spec.shape, lr=spec.lr, seed=spec.seed,
                       train_limit=spec.train_limit, validation_limit=spec.validation_limit,
                       eval_batch=spec.eval_batch, drop_partial=spec.drop_partial,
                       device=sharded_device(spec.device, spec.shape.replicas),
                       collective_timeout_s=spec.collective_timeout_s, **settings)


def sharded_device(device: str, replicas: int) -> str:
    """Where the FSDP2 launches run: on CUDA only with a GPU per process (NCCL). FSDP2's
    collectives over gloo on CUDA tensors shared by two processes crashed both ranks (SIGSEGV,
    torch 2.11 on one H200: benchmarks/gpu_check.py), so those run on the CPU over gloo."""
    return device if device == "cpu" or backend(device, replicas) == "nccl" else "cpu"


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
    table, exact, said = resumed_against(launched["records"], resumed["records"], folder,
                                         resumed_folder, launched["spec"]["updates"], tolerance)
    point, got = launched["checkpoint"], resumed["restored"]
    same_model = got["model_digest"] == point["model_digest"]
    same_optim = got["optim_digest"] == point["optim_digest"]
    restored = ("weights and optimizer state restored bit-identical" if same_model and
                same_optim else f"restored {'weights' if not same_model else ''}"
                f"{' and ' if not (same_model or same_optim) else ''}"
                f"{'optimizer state' if not same_optim else ''} differ from the saved ones")
    return _fsdp_row(rule, "pass" if exact and same_model and same_optim else "fail",
                     f"resumed after update {resumed['first_step'] - 1} in {resumed['world']} "
                     f"new processes: {restored}; {said}"), table


def sharded_faults(launched: dict[str, Any], resumed: dict[str, Any],
                   tolerance: float = 1e-4) -> pd.DataFrame:
    """The planted FSDP bugs of the same launches: does the rule meant to name each fail?"""
    from ...training.sharded_replica import PLANTED_PREFIX, SHARDED_FAULTS

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
    from ...training.predict import Plan

    try:
        from ...training.sharding import predict_sharded
    except ImportError as exc:
        return None, f"no prediction: workbook.sharding is not available ({exc})"
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
        from ...base.errors import reason

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
            ok = pd.notna(guess)
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


# an operation of the model that takes no DTensor: fully_shard cannot run the model as it is
UNSHARDABLE = re.compile(r"(aten\.[\w.]+) got mixed torch\.Tensor and DTensor")


def unshardable(problem: str) -> str:
    """Why 09's FSDP2 section did not run: the model's own operation under fully_shard, said
    as a finding about sharding this model - the data-parallel rules above it stand."""
    op = UNSHARDABLE.search(problem).group(1)
    rnn = " (nn.RNN / LSTM / GRU keep flat references to their weights, which fully_shard " \
        "turns into DTensors)" if "rnn" in op else ""
    return (f"FSDP2 not run: under fully_shard the model's operation {op} received a sharded "
            f"DTensor weight beside plain tensors{rnn}, so this model cannot be sharded with "
            "FSDP2 as it is written - train it with DDP (the rules above), or shard only the "
            "blocks that take DTensors (fully_shard per block, the recurrent module left "
            "replicated)")


def sharded_check(spec, task: Task, folder: Path, tolerance: float = 1e-4,
                  resume_tolerance: float = 0.0, timeout: float = LAUNCH_TIMEOUT
                  ) -> ShardedCheck:
    """Two launches: one trains (and measures, compares, checkpoints, plants), one resumes in
    new processes (and loads the planted checkpoint)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ...training.sharded_replica import PLANTED_PREFIX

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


def measure_fsdp(task: str, task_options: dict, plan, world: int) -> pd.DataFrame:
    """For the benchmark: FSDP2 on `world` processes (gloo on the CPU) of the task's model
    (`build_model`, the model 09 trains) for `plan` (`predict.Plan`, replicas=1: micro-batch
    and accumulation per rank). One launch measures every phase's per-rank peak (live tensors);
    `sharding.predict_sharded` predicts it for the same world and plan. Columns: rank, phase,
    measured_peak_bytes, predicted_peak_bytes, error_pct, note."""
    import tempfile

    from ...training.sharded_replica import ShardedSpec

    shape = replace(plan.shape, replicas=world)
    spec = ShardedSpec(task, dict(task_options), shape, updates=1,
                       eval_batch=plan.eval_batch or plan.shape.micro_batch, checkpoint_at=0,
                       plant=False, plan_length=plan.length or 0,
                       plan_eval_length=plan.eval_length or 0, train=False)
    with tempfile.TemporaryDirectory() as tmp:
        launched = launch(spec, Path(tmp) / f"fsdp-memory-x{world}")
    return memory_table(load_task(task, **task_options), spec, launched["memory"],
                        measured_note=launched.get("memory_note", ""))


def sharded_verdict(check: ShardedCheck | None) -> str:
    """"fail" on a failing FSDP rule or a planted FSDP bug its rule missed."""
    return "pass" if check is None else outcome(check.rules, check.faults)
