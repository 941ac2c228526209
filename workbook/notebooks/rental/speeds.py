"""Notebook 08's speeds: the share of a GPU's peak a training reaches (MFU), from a table of
published references (model size x GPU x strategy, each with its source) interpolated for the
campaign's model, or from notebook 03's step time where it ran on that GPU."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ...base.errors import WorkbookError
from ..registry import GATES, summary_of
from .prices import KNOWN_ACCELERATORS, comment_header, finite_number

SHIPPED = Path(__file__).with_name("rental_data") / "speeds.csv"
COLUMNS = ("gpu", "parameters", "strategy", "mfu", "source")


@dataclass
class Speed:
    """The MFU a sheet row is timed at, its range and where it comes from."""

    mfu: float
    low: float
    high: float
    basis: str  # "measured", "reference", "interpolated", "extrapolated", "assumed"
    words: str


@dataclass
class SpeedBook:
    """Reference rows (gpu, parameters, strategy, mfu, source, ...) with the sources' addresses,
    and a measured speed per GPU name where notebook 03 timed the model the rental trains."""

    references: pd.DataFrame
    sources: dict[str, str]
    path: str
    measured: dict[str, Speed] = field(default_factory=dict)

    def estimate(self, gpu: str, parameters: int, strategy: str) -> Speed:
        """The speed of a row: measured on `gpu` when 03 measured it there; else the references
        of `gpu` (of every GPU when it has none, as a share of each one's peak) and `strategy`
        (FSDP's stand in when none has it), interpolated in log(parameters) between the two
        nearest sizes, the range their rows' lowest and highest MFU."""
        if gpu in self.measured:
            return self.measured[gpu]
        refs = self.references
        own = refs[refs.gpu == gpu]
        where = f"{gpu} references" if len(own) else \
            f"no {gpu} reference: those of {', '.join(sorted(set(refs.gpu)))}"
        refs = own if len(own) else refs
        same = refs[refs.strategy == strategy]
        if len(same):
            refs = same
        else:
            where += f" (no {strategy} reference: {', '.join(sorted(set(refs.strategy)))} " \
                     "rows stand in)"
        groups = size_groups(refs.parameters)
        inside = [g for g in groups if g[0] <= parameters <= g[-1]]
        below = [g for g in groups if g[-1] < parameters]
        above = [g for g in groups if g[0] > parameters]
        if inside:
            rows = refs[refs.parameters.isin(inside[0])]
            return Speed(round(rows.mfu.mean(), 4), rows.mfu.min(), rows.mfu.max(), "reference",
                         f"{where}, {_size(inside[0][0])}; {_cited(rows)}")
        if not below or not above:
            edge = above[0] if not below else below[-1]
            rows = refs[refs.parameters.isin(edge)]
            side, likely = ("smallest", "a smaller model usually reaches less") if not below \
                else ("largest", "a larger one may reach less")
            return Speed(round(rows.mfu.mean(), 4), rows.mfu.min(), rows.mfu.max(),
                         "extrapolated",
                         f"{where}: the {side} reference ({_size(edge[0])}) held for "
                         f"{_size(parameters)} - {likely}; {_cited(rows)}")
        low, high = below[-1], above[0]
        rows = refs[refs.parameters.isin(low + high)]
        lo_mean = refs[refs.parameters.isin(low)].mfu.mean()
        hi_mean = refs[refs.parameters.isin(high)].mfu.mean()
        t = (math.log(parameters) - _log_mean(low)) / (_log_mean(high) - _log_mean(low))
        mfu = lo_mean + min(max(t, 0.0), 1.0) * (hi_mean - lo_mean)
        return Speed(round(mfu, 4), rows.mfu.min(), rows.mfu.max(), "interpolated",
                     f"{where}, interpolated in log(parameters) between {_size(low[0])} and "
                     f"{_size(high[0])}; {_cited(rows)}")

    def described(self) -> str:
        return (f"speed references {self.path}: {len(self.references)} rows from "
                f"{', '.join(sorted(self.sources)) or 'no named source'}")


def size_groups(parameters) -> list[list[float]]:
    """The references' parameter counts in groups of one model size (each within 10% of its
    group's smallest: MPT's "7b" is 6.66 and 6.67 B by sequence length), smallest first."""
    groups: list[list[float]] = []
    for size in sorted(set(parameters)):
        if groups and size <= groups[-1][0] * 1.1:
            groups[-1].append(size)
        else:
            groups.append([size])
    return groups


def _log_mean(group: list[float]) -> float:
    return sum(math.log(x) for x in group) / len(group)


def _size(parameters: float) -> str:
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e9 else f"{parameters / 1e6:.2f} M"


def _cited(rows: pd.DataFrame) -> str:
    """'range 0.38-0.47 MFU over 4 rows of llm-foundry, torchtitan'."""
    return (f"range {rows.mfu.min():.2f}-{rows.mfu.max():.2f} MFU over {len(rows)} "
            f"row{'s' if len(rows) > 1 else ''} of {', '.join(sorted(set(rows.source)))}")


def read_speeds(path: str | Path | None, gpus: dict) -> SpeedBook:
    """The reference table at `path` ("" or None: the one shipped with the workbook), every row
    checked: a missing column, an MFU outside (0, 1], a parameter count that is not positive,
    a strategy other than single/ddp/fsdp, a GPU neither `gpus` nor SkyPilot names, or a
    source without an address is refused with its line and the fix. References of GPUs off
    the list stay: they stand in for a GPU without its own."""
    path = Path(path).expanduser() if path else SHIPPED
    if not path.is_file():
        raise WorkbookError(f"speed references {path} do not exist",
                            'give speeds a CSV path of your own, "references" for the table '
                            'shipped with the workbook, or "utilisation" for the single share')
    meta, head = comment_header(path.read_text(encoding="utf-8").splitlines())
    table = pd.read_csv(path, skiprows=head, dtype=str, keep_default_na=False)
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise WorkbookError(f"speed references {path}, line {head + 1}: no column "
                            f"{', '.join(missing)}", f"give the header the columns "
                            f"{', '.join(COLUMNS)} (optional: gpus, seq_len, precision, model, "
                            "note)")
    sources = {k: v for k, v in meta.items() if v.startswith("http")}
    problems, rows = [], []
    for i, r in table.iterrows():
        line = head + 2 + int(i)
        mfu, size = finite_number(r["mfu"]), finite_number(r["parameters"])
        if r["gpu"] not in gpus and r["gpu"].lower() not in KNOWN_ACCELERATORS:
            problems.append(f"line {line}: unknown GPU {r['gpu']!r}")
        elif mfu is None or not 0 < mfu <= 1:
            problems.append(f"line {line}: mfu {r['mfu']!r} is not a share in (0, 1]")
        elif size is None or size <= 0:
            problems.append(f"line {line}: parameters {r['parameters']!r} is not a positive "
                            "count")
        elif r["strategy"] not in ("single", "ddp", "fsdp"):
            problems.append(f"line {line}: strategy {r['strategy']!r} is not single, ddp or "
                            "fsdp")
        elif r["source"] not in sources and not r["source"].startswith("http"):
            problems.append(f"line {line}: source {r['source']!r} has no address (a "
                            f"'# {r['source']}: https://...' line above the header)")
        else:
            rows.append({**r.to_dict(), "mfu": mfu, "parameters": size, "line": line})
    if problems:
        raise WorkbookError(f"speed references {path}: " + "; ".join(problems[:5]),
                            f"fix those rows (gpu one of {sorted(gpus)} or as SkyPilot names "
                            "it, mfu a share, "
                            "parameters a count, a cited source), or remove them")
    if not rows:
        raise WorkbookError(f"speed references {path} have no rows",
                            "give at least one published measurement")
    shown = "shipped with the workbook (rental_data/speeds.csv)" if path == SHIPPED else str(path)
    return SpeedBook(pd.DataFrame(rows), sources, shown)


def measured_speed(gates: pd.DataFrame, pipeline: pd.DataFrame, gpu: str | None,
                   twin_flops_per_update: float | None, peak_tflops: float,
                   trains_campaign: bool) -> tuple[Speed | None, str]:
    """The MFU notebook 03 reached on a GPU (its update's counted FLOPs over the median time per
    update of its input-pipeline steps, against `peak_tflops`), with words; None and why when
    it cannot calibrate: 03 ran on the CPU, the GPU is not one of the list, or 03 trained a
    twin of the campaign model (a smaller model reaches a smaller share of the peak)."""
    device = str(gates.device.iloc[0]) if len(gates) and "device" in gates else "cpu"
    if not device.startswith("cuda"):
        return None, f"notebook 03 ran on {device}: no GPU step time to calibrate with"
    if gpu is None:
        return None, "notebook 03 ran on a GPU that is not one of the list: not calibrated"
    if not trains_campaign:
        return None, (f"notebook 03 timed the pilot twin on the {gpu}, not the campaign model: "
                      "not calibrated")
    times = pd.to_numeric(pipeline.get("time_s"), errors="coerce").dropna() \
        if len(pipeline) else pd.Series(dtype=float)
    if times.empty or not twin_flops_per_update:
        return None, "notebook 03 timed no update: not calibrated"
    achieved = twin_flops_per_update / times / (peak_tflops * 1e12)
    mfu = float(twin_flops_per_update / times.median() / (peak_tflops * 1e12))
    if not mfu > 0:
        return None, "notebook 03's updates counted no FLOPs: not calibrated"
    # significant digits, not decimals: a small model on a large GPU reaches 1e-5 of its peak
    return Speed(float(f"{mfu:.4g}"), float(achieved.min()), float(achieved.max()), "measured",
                 f"measured: notebook 03's median update of {times.median() * 1000:.1f} ms on "
                 f"the {gpu} (range over its {len(times)} updates)"), ""


def gpu_of_device(device_name: str, gpus: dict) -> str | None:
    """The GPU of the list a CUDA device name is ("NVIDIA A100-SXM4-80GB" -> "A100-80GB"):
    every part of the list's name is a whole word of the device's, the longest name first."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for name in sorted(gpus, key=len, reverse=True):
        if all(part in words for part in re.split(r"[^A-Z0-9]+", name.upper()) if part):
            return name
    return None


def calibrate(book: SpeedBook, run_dir: Path, count_flops, gpus: dict, tflops: dict,
              trains_campaign: bool, device_name: str | None) -> str:
    """Adds notebook 03's measured speed to `book` where 03 ran this run on a GPU of the list
    (`device_name`: the CUDA device's name, None without one); `count_flops(micro_batch,
    accumulation, length, precision)` counts an update's FLOPs. Returns what was done, in
    words."""
    folder = Path(run_dir) / GATES.stem
    if not (folder / "gates.csv").is_file():
        return "notebook 03 did not run in this run folder: speeds from the references"
    gates = pd.read_csv(folder / "gates.csv")
    pipeline = pd.read_csv(folder / "input_pipeline.csv") \
        if (folder / "input_pipeline.csv").is_file() else pd.DataFrame()
    gpu = gpu_of_device(device_name, gpus) if device_name else None
    flops = None
    if gpu and len(gates) and len(pipeline) and str(gates.device.iloc[0]).startswith("cuda"):
        row = gates.iloc[0]
        accumulation = max(1, int(pipeline.examples.iloc[0] // row.micro_batch))
        flops = count_flops(int(row.micro_batch), accumulation, int(row.seq_len),
                            str(row.precision))
    speed, why = measured_speed(gates, pipeline, gpu, flops, tflops.get(gpu, 1.0),
                                trains_campaign)
    if speed is None:
        return why + "; speeds from the references"
    book.measured[gpu] = speed
    return speed.words


MAX_GENERATION_SHARE = 0.95  # a larger share of a step measured is held here (x 20)


def generation_scale(run_dir: Path) -> tuple[float, str]:
    """1 / (1 - share), `share` generation's measured part of an update (notebook 03's
    `generation_share`, for a model that reports its phases: GRPO's policy), held at
    `MAX_GENERATION_SHARE`, with words; (1.0, "") where 03 measured none in this run folder."""
    folder = Path(run_dir) / GATES.stem
    summary = summary_of(run_dir, GATES.stem)
    figures = summary.get("figures") if isinstance(summary, dict) else None
    if not isinstance(figures, dict) or "generation_share" not in figures:
        return 1.0, ""
    share = finite_number(figures["generation_share"])
    if share is None or share < 0:
        raise WorkbookError(f"notebook 03's generation_share {figures['generation_share']!r} "
                            f"in {folder / 'summary.json'} is not a share of a step",
                            "run notebook 03 again in this run folder")
    held = ""
    if share > MAX_GENERATION_SHARE:
        held = (f" (03 measured {share:.0%}, held at {MAX_GENERATION_SHARE:.0%}: generation "
                "cannot be the whole step)")
        share = MAX_GENERATION_SHARE
    device = "the CPU"
    if (folder / "gates.csv").is_file():
        gates = pd.read_csv(folder / "gates.csv")
        if len(gates) and "device" in gates and str(gates.device.iloc[0]).startswith("cuda"):
            device = "a GPU"
    scale = 1 / (1 - share)
    return scale, (f"generation's measured share of a step here: {share:.0%}{held} (03, on "
                   f"{device}) - every time per update x {scale:.2g}; on a GPU generation is "
                   "memory-bound and its share is usually as large or larger: measure it with "
                   "03 on the rental")
