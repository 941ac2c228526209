"""Campaign-scale sizing (issue 23). Prints its figures; none of them is a unit test.

    PYTHONPATH=. .venv/bin/python benchmarks/campaign_scale.py [--only c] [--configs 7b,70b]
        [--against-full-depth]

(a) the twin path against a real run of campaign models that fit the pilot box, every phase
(b) FSDP2 on 2 and 4 gloo processes against the measured per-rank peak, every phase
(c) 7 B and 70 B Llama configs: seconds and peak resident memory of the FSDP2 sizing, per-GPU
    peak of every phase for N = 8, 16, 64 (each config sized in a fresh process, so its peak
    resident memory is its own). The sizing runs the sharded step at 3 and 4 layers and carries
    every operator to the full depth (`sharding.sharded_run`); `--against-full-depth` also runs
    the sharded step at the full depth (the sizing before depth carrying: minutes) and prints
    the largest difference in bytes of any phase at any N.

The last line is `campaign_scale_max_abs_error_pct: <value>` over the parts that report errors
(a and b; part c has none to report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import workbook as wb  # noqa: E402
from workbook.samples.models import TinyDecoder  # noqa: E402
from workbook.samples.tokenizer import VOCAB_SIZE  # noqa: E402
from workbook.training.loop import TrainConfig, UpdateShape  # noqa: E402
from workbook.training.predict import Plan, predict, sized_batches  # noqa: E402
from workbook.training.workload import TRAINING_PHASES, measured_peaks  # noqa: E402

GIB = 2**30

# the campaign shape of part (c): micro-batch 2 (a padded batch: at 1, Hugging Face's SDPA path
# skips its attention mask for a batch without padding, a choice fake tensors cannot see) x
# 4096 positions, bf16, activation checkpointing, AdamW; the twin's data shapes the batches
SHAPE = {"micro_batch": 2, "accumulation": 2, "precision": "bf16",
         "activation_checkpointing": True, "length": 4096}
CONFIGS = {"7b": {},  # examples/llama_campaign.py's defaults (Llama-2 7B shape)
           "70b": {"layers": 80, "width": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672}}
WORLDS = (8, 16, 64)


# --- part (a): the twin path against a real run of the campaign model -------------------
def twin_cases():
    """(label, task, plan): a 0.20 B Llama (12 x 1024, grouped-query attention) from a config and
    a 0.10 B plain decoder of the samples' own code wrapped as `campaign.Deep`."""
    llama = wb.load_task("examples.llama_campaign:task", layers=12, width=1024, heads=16,
                         kv_heads=4, ffn=2816, positions=512)
    sample = wb.load_task("workbook.samples.generation:task")
    deep = wb.campaign.Deep(lambda layers: TinyDecoder(VOCAB_SIZE, 768, layers, 12, 512),
                            layers=14)
    plain = dataclasses.replace(sample, campaign_model=deep,
                                build_model=partial(TinyDecoder, VOCAB_SIZE, 64, 2, 4, 512))
    return [("llama 0.20 B (12 x 1024) fp32 mb2 x acc2 len256", llama,
             Plan(UpdateShape(2, 2), 256)),
            ("decoder 0.10 B (14 x 768) fp32 mb4 x acc2 len256 +ckpt", plain,
             Plan(UpdateShape(4, 2, activation_checkpointing=True), 256))]


def twin_path_rows(label: str, task: wb.Task, plan: Plan) -> list[dict]:
    """One row per phase: predicted through the twin path, measured on the campaign model."""
    split = wb.prepare(task)
    train, val = split.train[:64], split.items["validation"][:16]
    begin = time.perf_counter()
    predicted = predict(task, train, val, plan, campaign=True)
    sizing_s = time.perf_counter() - begin
    real = dataclasses.replace(task, build_model=task.campaign_model, campaign_model=None)
    measured = measured_peaks(real, TrainConfig(plan.shape, device="cpu"),
                              *sized_batches(real, train, val, plan))
    rows = []
    for phase, p in zip(TRAINING_PHASES, predicted.predicted_peak_bytes, strict=True):
        m = measured[phase]
        rows.append({"case": label, "phase": phase, "predicted_mib": p / 2**20,
                     "measured_mib": m / 2**20, "error_pct": 100 * (p - m) / m,
                     "sizing_s": sizing_s, "sized": predicted.attrs.get("sized", "")})
    return rows


def part_a() -> list[float]:
    """Campaign models that still fit here, sized through their twin (`predict(...,
    campaign=True)`) against a real measured run of the campaign model, every phase."""
    print("(a) the twin path against a real run of the campaign model (fp32 on this CPU)")
    errors = []
    for label, task, plan in twin_cases():
        rows = twin_path_rows(label, task, plan)
        print(f"  {label}: {rows[0]['sized']}, sized in {rows[0]['sizing_s']:.1f} s")
        for r in rows:
            print(f"    {r['phase']:16s} predicted {r['predicted_mib']:9.1f} MiB  measured "
                  f"{r['measured_mib']:9.1f} MiB  {r['error_pct']:+.3f}%")
            errors.append(abs(r["error_pct"]))
    return errors


# --- part (b): FSDP2 on gloo processes against the measured per-rank peak -----------------
def part_b() -> list[float]:
    """FSDP2 on 2 and 4 gloo processes: each rank's measured live-tensor peak against
    `sharding.predict_sharded`, every phase, for the generation sample (tied embeddings) and the
    pilot twin of the 7 B Llama (transformers' LlamaForCausalLM, 2 x 128). The measurement's
    FSDP collectives all-reduce in a scratch buffer, without the temporaries gloo's own
    reduce-scatter and all-gather add and NCCL does not
    (`sharded_replica._collectives_in_place`)."""
    from workbook.notebooks.parallel import measure_fsdp

    print("(b) FSDP2 per-rank peak, predicted against measured on gloo")
    errors = []
    for label, task, options in (("generation sample, tied", "workbook.samples.generation:task",
                                  {"tie_embeddings": True}),
                                 ("Llama 7B's twin", "examples.llama_campaign:task", {})):
        for world in (2, 4):
            table = measure_fsdp(task, options, Plan(UpdateShape(2, 2)), world)
            for phase, rows in table.groupby("phase", sort=False):
                pct = rows.error_pct.astype(float)
                print(f"  {label} x{world} {phase:16s} error {pct.min():+7.2f}% .. "
                      f"{pct.max():+7.2f}% over {len(rows)} ranks")
                errors += [abs(v) for v in pct.dropna()]
    return errors


# --- part (c) -------------------------------------------------------------------------------
def size_one(name: str, against_full_depth: bool = False) -> dict:
    """Runs in a fresh process: one config sized at N = 8 (the fake run), 16 and 64 derived,
    and 64 also sized directly to show the derivation's gap; with `against_full_depth`, N = 8
    once more at the full depth, after the resident memory is read."""
    import resource
    import time

    from examples.llama_campaign import make_task
    from workbook.contract.data import prepare
    from workbook.training import campaign, sharding
    from workbook.training.loop import UpdateShape
    from workbook.training.memory import _rss_peak
    from workbook.training.predict import Plan

    task = make_task(**CONFIGS[name])
    data = prepare(task, limits={"train": 50})
    shape = {k: v for k, v in SHAPE.items() if k != "length"}
    plan = Plan(UpdateShape(**shape), SHAPE["length"], SHAPE["micro_batch"])
    params = campaign.parameter_count(campaign.on_meta(task.campaign_model))
    start = time.perf_counter()
    run = sharding.sharded_run(task, data.train, data.validation, plan, WORLDS[0])
    seconds = time.perf_counter() - start
    frames = {w: run.at(w) for w in WORLDS}
    start = time.perf_counter()
    direct = sharding.sharded_run(task, data.train, data.validation, plan, WORLDS[-1]).at(
        WORLDS[-1])
    direct_seconds = time.perf_counter() - start
    # this process's own high-water mark (VmHWM starts afresh at exec; ru_maxrss keeps the
    # parent's resident size when the parent is large, as after part a)
    rss = _rss_peak() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gap = max(abs(a - b) / b * 100 for a, b in zip(frames[WORLDS[-1]].predicted_peak_bytes,
                                                 direct.predicted_peak_bytes, strict=True))
    full = {}
    if against_full_depth:
        start = time.perf_counter()
        depth_of, campaign.depth_of = campaign.depth_of, lambda task: None  # no carrying
        try:
            whole = sharding.sharded_run(task, data.train, data.validation, plan, WORLDS[0])
        finally:
            campaign.depth_of = depth_of
        full = {"full_depth_seconds": time.perf_counter() - start,
                "carried_vs_full_depth_bytes": max(
                    abs(a - b) for w in WORLDS for a, b in zip(
                        run.at(w).predicted_peak_bytes, whole.at(w).predicted_peak_bytes,
                        strict=True)),
                "breakdowns_equal": all(run.at(w).breakdown.tolist() ==
                                        whole.at(w).breakdown.tolist() for w in WORLDS)}
    return {"config": name, "parameters": params, "seconds": seconds, "sized": run.sized,
            "direct_seconds": direct_seconds, "peak_rss_bytes": rss,
            "derived_vs_direct_pct": gap, **full,
            "per_gpu": {w: dict(zip(f.phase, f.predicted_peak_bytes.astype(float), strict=True))
                        for w, f in frames.items()}}


def part_c(names: list[str], against_full_depth: bool = False) -> None:
    print(f"(c) FSDP2 per-GPU sizing, shape {SHAPE} (micro_batch x accumulation per GPU), "
          f"AdamW; machine: {os.cpu_count()} CPU cores")
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--one", name,
                              *(["--against-full-depth"] if against_full_depth else [])],
                             capture_output=True,
                             text=True, cwd=ROOT, timeout=1800,
                             env={**os.environ, "PYTHONPATH": str(ROOT),
                                  "OMP_NUM_THREADS": "1"})
        if out.returncode:
            print(f"  {name}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {name}: {r['parameters'] / 1e9:.2f} B parameters; sizing {r['seconds']:.1f} s "
              f"(the fake run at N={WORLDS[0]}; N={WORLDS[-1]} sized directly too: "
              f"{r['direct_seconds']:.1f} s, derived vs direct max gap "
              f"{r['derived_vs_direct_pct']:.2f}%); peak resident memory "
              f"{r['peak_rss_bytes'] / 2**20:.0f} MiB")
        print(f"    sized: {r['sized']}")
        if "full_depth_seconds" in r:
            print(f"    against the sharded run at the full depth ({r['full_depth_seconds']:.1f} "
                  f"s): largest difference of any phase at any N "
                  f"{r['carried_vs_full_depth_bytes']:.0f} bytes; breakdowns "
                  f"{'equal' if r['breakdowns_equal'] else 'DIFFER'}")
        phases = list(next(iter(r["per_gpu"].values())))
        print("    per-GPU peak, GiB      " + "".join(f"{p[:16]:>18}" for p in phases))
        for w, peaks in r["per_gpu"].items():
            print(f"    N={int(w):<3}                " +
                  "".join(f"{peaks[p] / GIB:>18.2f}" for p in phases))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="abc")
    parser.add_argument("--configs", default="7b,70b")
    parser.add_argument("--against-full-depth", action="store_true",
                        help="part c: also run the sharded step at the full depth and compare")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(size_one(args.one, args.against_full_depth)))
        return
    errors: list[float] = []
    if "a" in args.only:
        errors += part_a()
    if "b" in args.only:
        errors += part_b()
    if "c" in args.only:
        part_c(args.configs.split(","), args.against_full_depth)
    worst = max(errors) if errors else float("nan")
    print(f"campaign_scale_max_abs_error_pct: {worst:.3f}" if errors else
          "campaign_scale_max_abs_error_pct: nan (no part that reports errors ran)")


if __name__ == "__main__":
    main()
