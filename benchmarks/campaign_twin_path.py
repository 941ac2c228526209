"""Part (a) of benchmarks/campaign_scale.py: campaign models that still fit this machine, sized
through their pilot twin (`predict(..., campaign=True)`: fake tensors, the real-run check on the
twin, operator traces at 3 and 4 layers carried to the full depth) against a real measured run
of the campaign model itself, every phase.

    python benchmarks/campaign_twin_path.py
"""

from __future__ import annotations

import dataclasses
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workbook as wb  # noqa: E402
from workbook.loop import UpdateShape  # noqa: E402
from workbook.predict import Plan, predict, sized_batches  # noqa: E402
from workbook.samples.models import TinyDecoder  # noqa: E402
from workbook.tokenizer import VOCAB_SIZE  # noqa: E402
from workbook.workload import TRAINING_PHASES, measured_peaks  # noqa: E402


def cases():
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
    measured = measured_peaks(real, plan.shape.train_config(device="cpu"),
                              *sized_batches(real, train, val, plan))
    rows = []
    for phase, p in zip(TRAINING_PHASES, predicted.predicted_peak_bytes, strict=True):
        m = measured[phase]
        rows.append({"case": label, "phase": phase, "predicted_mib": p / 2**20,
                     "measured_mib": m / 2**20, "error_pct": 100 * (p - m) / m,
                     "sizing_s": sizing_s, "sized": predicted.attrs.get("sized", "")})
    return rows


def main() -> float:
    worst = 0.0
    for label, task, plan in cases():
        rows = twin_path_rows(label, task, plan)
        print(f"{label}: {rows[0]['sized']}, sized in {rows[0]['sizing_s']:.1f} s")
        for r in rows:
            print(f"  {r['phase']:16s} predicted {r['predicted_mib']:9.1f} MiB  measured "
                  f"{r['measured_mib']:9.1f} MiB  {r['error_pct']:+.3f}%")
            worst = max(worst, abs(r["error_pct"]))
    print(f"twin_path_max_abs_error_pct: {worst:.3f}")
    return worst


if __name__ == "__main__":
    main()
