"""Notebook 08's prices: GPU offers read from a dated catalog in SkyPilot's `vms.csv` columns
(the snapshot shipped in `rental_data/prices.csv`, or the user's own), checked row by row, and
the offer a sheet row is priced on - on-demand and spot side by side."""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ...base.errors import WorkbookError

SHIPPED = Path(__file__).with_name("rental_data") / "prices.csv"
REQUIRED = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice", "Region")
OPTIONAL = ("Provider", "vCPUs", "MemoryGiB", "GpuInfo", "AvailabilityZone", "Source")
# SkyPilot's accelerator names (sky show-gpus -a; catalogs/v7/common/metadata.csv): a row
# naming one that is not among the notebook's gpus is a real offer of a GPU the plan does not
# consider, so it is left out, not refused
KNOWN_ACCELERATORS = {
    "l4", "l40s", "a100", "a100-40gb", "a100-80gb", "a100-80gb-sxm", "h100", "h100-sxm",
    "h100-mega", "h100-nvlink", "h200", "h200-sxm", "a10", "a10g", "a40", "a4000", "a6000",
    "b200", "b300", "gb200", "gb300", "gh200", "h100-nvl",
    "k80", "l40", "m4000", "m60", "p100", "p4", "p4000", "rtx3060", "rtx3080", "rtx3090",
    "rtx4000-ada", "rtx4090", "rtx6000", "rtx6000-ada", "rtx-6000-ada", "rtx8000", "rtxa4000",
    "rtxa4500", "rtxa5000", "rtxa6000", "rtx-pro-6000", "t4", "t4g", "v100", "v100-32gb",
    "gaudi hl-205", "mi300x", "mi325x", "mi355x", "radeon mi25", "radeon pro v520",
    "inferentia", "inferentia2", "trainium", "trainium2"}
# SkyPilot's names for the notebook's GPUs, where they differ
ALIASES = {"a100": "A100-40GB", "a100-80gb-sxm": "A100-80GB", "h100-sxm": "H100",
           "h100-mega": "H100", "h100-nvlink": "H100", "h200-sxm": "H200"}


@dataclass
class Catalog:
    """GPU offers (one row per instance type and region: provider, instance, gpu, count,
    price and spot_price per instance-hour), the catalog's date and where it came from."""

    offers: pd.DataFrame
    date: dt.date
    dated_by: str  # "the file" or why the date is the file's modification day
    path: str
    currency: str = "USD"
    sources: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, int] = field(default_factory=dict)  # why -> rows

    @property
    def providers(self) -> list[str]:
        return sorted(set(self.offers.provider))

    def described(self) -> str:
        """'catalog <file> of 2026-12-03 (24 offers, 5 providers)' for sources and the report."""
        return (f"catalog {self.path} of {self.date.isoformat()}"
                f"{'' if self.dated_by == 'the file' else f' ({self.dated_by})'}, "
                f"{len(self.offers)} offers from {len(self.providers)} provider"
                f"{'s' if len(self.providers) != 1 else ''}")


def read_catalog(path: str | Path | None, gpus: dict, currency: str = "USD",
                 today: dt.date | None = None) -> Catalog:
    """The catalog at `path` ("" or None: the snapshot shipped with the workbook), every row
    checked: a missing column, a negative or non-numeric price or GPU count, an accelerator
    name neither SkyPilot nor `gpus` knows, or a date after `today` is refused with its line
    and the fix. CPU-only rows, GPU slices and rows without any price are left out, counted."""
    path = Path(path).expanduser() if path else SHIPPED
    if not path.is_file():
        raise WorkbookError(f"price catalog {path} does not exist",
                            "give price_catalog the path of a CSV in SkyPilot's vms.csv columns, "
                            "or leave it empty for the catalog shipped with the workbook")
    lines = path.read_text(encoding="utf-8").splitlines()
    meta, head = comment_header(lines)
    try:
        table = pd.read_csv(path, skiprows=head, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as exc:
        raise WorkbookError(f"price catalog {path}: not a readable CSV ({exc})",
                            "save it as CSV with one header line of SkyPilot's columns") from exc
    missing = [c for c in REQUIRED if c not in table.columns]
    if missing:
        raise WorkbookError(f"price catalog {path}, line {head + 1}: no column "
                            f"{', '.join(missing)}",
                            f"give the header the columns {', '.join(REQUIRED)} "
                            f"(optional: {', '.join(OPTIONAL)})")
    date, dated_by = _date(meta, path, head, today or dt.date.today())
    stated = meta.get("currency", "USD").upper()
    if stated != currency.upper():
        raise WorkbookError(f"price catalog {path}: prices in {stated}, the notebook's currency "
                            f"is {currency}", f"set currency = {stated!r}, or give a catalog in "
                            f"{currency}")
    provider = _provider(path)
    rows, left_out, problems = [], Counter(), []
    for i, r in table.iterrows():
        line = head + 2 + int(i)
        why = _left_out(r)
        if why:
            left_out[why] += 1
            continue
        offer, problem = _offer(r, line, gpus)
        if problem:
            problems.append(problem)
        elif offer is None:
            left_out["a GPU the plan does not consider"] += 1
        else:
            rows.append({**offer, "provider": r.get("Provider") or provider})
    if problems:
        raise WorkbookError(f"price catalog {path}: " + "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
            "fix those rows (prices are numbers of 0 or more per instance-hour, AcceleratorCount "
            "a positive number, AcceleratorName as SkyPilot spells it or one of the notebook's "
            f"gpus {sorted(gpus)} - add a new GPU to gpus and gpu_tflops), or remove them")
    offers = pd.DataFrame(rows, columns=OFFER_COLUMNS)
    sources = {k.removeprefix("source ").strip(): v for k, v in meta.items()
               if k.startswith("source ")}
    return Catalog(offers, date, dated_by, _shown(path), stated, sources, dict(left_out))


OFFER_COLUMNS = ["provider", "instance", "gpu", "count", "price", "spot_price", "region",
                 "source", "line"]


def comment_header(lines: list[str]) -> tuple[dict[str, str], int]:
    """The `# key: value` lines above the column header, and how many lines they take."""
    meta, n = {}, 0
    for text in lines:
        if not text.startswith("#"):
            break
        n += 1
        key, sep, value = text[1:].partition(":")
        if sep:
            meta.setdefault(key.strip().lower(), value.strip())
    return meta, n


def _date(meta: dict[str, str], path: Path, head: int, today: dt.date) -> tuple[dt.date, str]:
    if "date" not in meta:
        day = dt.date.fromtimestamp(path.stat().st_mtime)
        return day, "no date in the file: its modification day"
    try:
        day = dt.date.fromisoformat(meta["date"])
    except ValueError as exc:
        raise WorkbookError(f"price catalog {path}: date {meta['date']!r} is not YYYY-MM-DD",
                            "write the day the prices were published as '# date: 2026-12-03' "
                            "above the header") from exc
    if day > today:
        line = next(i for i, k in enumerate(_keys(path), 1) if k == "date")
        raise WorkbookError(f"price catalog {path}, line {line}: date {day} is after today "
                            f"({today})", "give the day the prices were published or copied, "
                            "not a future one")
    return day, "the file"


def _keys(path: Path) -> list[str]:
    return [t[1:].partition(":")[0].strip().lower() for t in
            path.read_text(encoding="utf-8").splitlines() if t.startswith("#")]


def _provider(path: Path) -> str:
    """A file without a Provider column is one cloud's: SkyPilot keeps `<cloud>/vms.csv`."""
    return path.parent.name if path.name == "vms.csv" and path.parent.name else path.stem


def _shown(path: Path) -> str:
    return "shipped with the workbook (rental_data/prices.csv)" if path == SHIPPED else str(path)


def _left_out(r: pd.Series) -> str:
    """Why a row is no GPU offer to plan on ('' when it is one)."""
    if not str(r["AcceleratorName"]).strip():
        return "CPU only"
    if not str(r["Price"]).strip() and not str(r["SpotPrice"]).strip():
        return "no price (neither Price nor SpotPrice)"
    count = finite_number(r["AcceleratorCount"])
    if count is not None and 0 < count < 1:
        return "a slice of a GPU"
    return ""


def _offer(r: pd.Series, line: int, gpus: dict) -> tuple[dict | None, str]:
    """(offer, '') for a row of a GPU in `gpus`; (None, '') for another GPU SkyPilot knows;
    (None, problem) for a bad row."""
    name = str(r["AcceleratorName"]).strip()
    gpu = gpu_named(name, gpus)
    if gpu is None and name.lower() not in KNOWN_ACCELERATORS:
        return None, f"line {line}: unknown GPU {name!r}"
    count = finite_number(r["AcceleratorCount"])
    if count is None or count <= 0:
        return None, f"line {line}: AcceleratorCount {r['AcceleratorCount']!r} is not a " \
                     "positive number"
    prices = {}
    for column in ("Price", "SpotPrice"):
        text = str(r[column]).strip()
        value = finite_number(text) if text else None
        if text and (value is None or value < 0):
            return None, f"line {line}: {column} {text!r} is not a price of 0 or more"
        prices[column] = value
    if gpu is None:
        return None, ""
    return {"instance": str(r["InstanceType"]), "gpu": gpu, "count": count,
            "price": prices["Price"], "spot_price": prices["SpotPrice"],
            "region": str(r["Region"]), "source": str(r.get("Source", "")), "line": line}, ""


def finite_number(text) -> float | None:
    """A catalog cell as a finite number; None for an empty, non-numeric or infinite one."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def gpu_named(name: str, gpus: dict) -> str | None:
    """The notebook's GPU a catalog's accelerator name means (case aside; SkyPilot's "A100" is
    the 40 GB one), or None."""
    by_lower = {g.lower(): g for g in gpus}
    key = name.strip().lower()
    return by_lower.get(key) or (ALIASES.get(key) if ALIASES.get(key) in gpus else None)


@dataclass
class Spot:
    """What a spot interruption costs: `interruptions_per_day` (assumed), a restart of
    `restart_minutes` (provisioning and start-up, assumed) plus the restore 03 measured
    (`resume_s`, None when 03 did not run), and half a checkpoint interval of lost work."""

    interruptions_per_day: float = 1.0
    restart_minutes: float = 10.0
    resume_s: float | None = None

    def __post_init__(self):
        for name in ("interruptions_per_day", "restart_minutes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise WorkbookError(f"spot_{name} is {value!r}, not a number of 0 or more",
                                    f"give spot_{name} as a number of 0 or more")

    def overhead(self, checkpoint_interval_s: float) -> float:
        """Extra time per hour of training: interruptions x (restart + half an interval)."""
        lost_s = self.restart_minutes * 60 + (self.resume_s or 0) + checkpoint_interval_s / 2
        return self.interruptions_per_day / 24 * lost_s / 3600

    def words(self) -> str:
        resumed = (f" + the restore notebook 03 measured ({self.resume_s:.2f} s, the model it "
                   "trained)" if self.resume_s is not None else " (03 measured no restore)")
        return (f"{self.interruptions_per_day:g} interruptions a day (assumed: "
                f"spot_interruptions_per_day), each costing a {self.restart_minutes:g} min "
                f"restart (assumed: spot_restart_minutes){resumed} and half a checkpoint "
                "interval of lost work (a checkpoint at each evaluation)")


def price_columns(gpu: str, count: int | None, hours: tuple, typed: dict,
                  catalog: Catalog | None, spot: Spot | None, checkpoint_interval_s: float,
                  ) -> dict:
    """The price part of a sheet row on `count` x `gpu` for `hours` (mid, low, high): a typed
    price per GPU-hour wins; else the catalog's cheapest whole-instance offer for that many
    GPUs (idle GPUs of a larger instance are paid: `paid_gpus`), and its spot twin with the
    interruptions' overhead. Costs are None without hours or without an offer."""
    mid, low, high = hours
    count = int(count or 1)
    out = {"price_per_hour": None, "paid_gpus": count, "offer": None, "price_from": None,
           "cost": None, "cost_low": None, "cost_high": None, "spot_price_per_hour": None,
           "spot_offer": None, "spot_cost": None, "providers": 0}

    def cost(h, per_gpu, paid):
        return None if h is None or per_gpu is None else round(h * paid * per_gpu, 2)

    if gpu in typed:
        out.update(price_per_hour=typed[gpu], offer="typed: gpu_price_per_hour",
                   price_from="typed")
    if catalog is not None:  # typed prices are on-demand: spot still comes from the catalog
        here = catalog.offers[catalog.offers.gpu == gpu]
        out["providers"] = here.provider.nunique()
        best = cheapest_offer(here, count, "price")
        if best is not None and gpu not in typed:
            out.update(price_per_hour=round(best.price / best["count"], 4),
                       paid_gpus=_paid(count, best["count"]), offer=offer_words(best, count),
                       price_from=f"catalog of {catalog.date.isoformat()}")
        spot_best = cheapest_offer(here, count, "spot_price")
        if spot_best is not None:
            paid = _paid(count, spot_best["count"])
            per_gpu = spot_best.spot_price / spot_best["count"]
            extra = 1 + (spot.overhead(checkpoint_interval_s) if spot else 0.0)
            out.update(spot_price_per_hour=round(per_gpu, 4),
                       spot_offer=offer_words(spot_best, count),
                       spot_cost=cost(None if mid is None else mid * extra, per_gpu, paid))
    paid = out["paid_gpus"]
    out.update(cost=cost(mid, out["price_per_hour"], paid),
               cost_low=cost(low, out["price_per_hour"], paid),
               cost_high=cost(high, out["price_per_hour"], paid))
    return out


def _paid(count: int, per_instance: float) -> int:
    return int(math.ceil(count / per_instance) * per_instance)


NODE = 8  # GPUs one instance holds at most, as the references' nodes (NVLink within)


def cheapest_offer(offers: pd.DataFrame, count: int, column: str) -> pd.Series | None:
    """The offer that rents `count` GPUs for the least per hour in `column` ("price" or
    "spot_price"), whole instances only (a 1-GPU job on an 8-GPU instance pays for 8). The
    GPUs of a node share one instance: instances of at least min(count, 8) GPUs first, several
    smaller ones (no fast link between them) only where no such instance is offered."""
    priced = offers[offers[column].notna()]
    whole = priced[priced["count"] >= min(count, NODE)]
    priced = whole if len(whole) else priced
    if priced.empty:
        return None
    instances = (count / priced["count"]).apply(math.ceil)
    order = pd.DataFrame({"total": priced[column] * instances, "instances": instances})
    return priced.loc[order.sort_values(["total", "instances"], kind="stable").index[0]]


def offer_words(offer: pd.Series, count: int = 1) -> str:
    """'nebius gpu-h100-sxm_1gpu-16vcpu-200gb (1 GPU, eu-north1)', with 'x2 instances' when
    `count` GPUs take more than one."""
    n = offer["count"]
    instances = math.ceil(count / n)
    return (f"{offer.provider} {offer.instance} ({n:g} GPU{'s' if n != 1 else ''}, "
            f"{offer.region}){f' x{instances} instances' if instances > 1 else ''}")


def spread(catalog: Catalog, gpu: str, count: int = 1) -> pd.DataFrame:
    """Per provider, its cheapest on-demand and spot offer for `count` GPUs of `gpu`, with the
    whole instances' price per hour over the `count` GPUs used (`*_per_used_gpu_hour`: idle
    GPUs of a larger instance raise it), cheapest first: the spread across providers."""
    rows = []
    here = catalog.offers[catalog.offers.gpu == gpu]
    for provider, offers in here.groupby("provider"):
        row = {"gpu": gpu, "provider": provider}
        for column in ("price", "spot_price"):
            best = cheapest_offer(offers, count, column)
            row[column + "_per_used_gpu_hour"] = None if best is None else \
                round(best[column] * math.ceil(count / best["count"]) / count, 4)
            row[column.replace("price", "offer")] = None if best is None else best.instance
            if column == "price":
                row["instances"] = None if best is None else math.ceil(count / best["count"])
        rows.append(row)
    frame = pd.DataFrame(rows, columns=["gpu", "provider", "price_per_used_gpu_hour", "offer",
                                        "instances", "spot_price_per_used_gpu_hour",
                                        "spot_offer"])
    return frame.sort_values("price_per_used_gpu_hour", na_position="last", kind="stable") \
        .reset_index(drop=True)
