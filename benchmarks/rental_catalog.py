"""Notebook 08 priced three ways on the sample task: from the catalog shipped with the workbook,
from a user's catalog (a company price list written to a temporary folder, SkyPilot's columns)
and from the prices the notebook used to assume by hand. Prints each plan's offer, on-demand
and spot cost, and the spread across providers; last line
`offers: N providers: M cheapest_vs_assumed: <ratio>` - the shipped catalog's cheapest cost of
the recommended plan over the same plan at the formerly assumed prices.

    python benchmarks/rental_catalog.py [--task MOD:ATTR] [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

import workbook as wb
from workbook.notebooks import rental
from workbook.notebooks.rental.prices import spread

# the hand-typed on-demand prices 08 assumed before it read a catalog ("ASSUMED ... edit these")
ASSUMED = {"L4": 0.8, "A100-40GB": 1.6, "L40S": 1.2, "A100-80GB": 2.2, "H200": 4.0}
COMPANY = """# date: 2026-11-20
# currency: USD
# source company: https://intranet.example/gpu-price-list (the user's own, for this benchmark)
Provider,InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
company,l4-node,L4,1,8,32,,0.55,,eu-1,
company,h100-node,H100,8,96,1024,,17.6,6.4,eu-1,
company,a100-node,A100-80GB,4,48,512,,6.0,,eu-1,
"""


def priced(params: dict, out: Path) -> rental.RentalResult:
    out.mkdir(parents=True)
    return rental.run(params, out)


def recommended(result: rental.RentalResult) -> pd.Series:
    return result.options.set_index("candidate").loc[result.chosen["candidate"]]


def spend(result: rental.RentalResult) -> float:
    """The recommended plan's on-demand cost, unrounded: hours x GPUs paid x price."""
    best = recommended(result)
    row = result.sheet[(result.sheet.candidate == result.chosen["candidate"])
                       & (result.sheet.gpu == best.cheapest_gpu)].iloc[0]
    return row.budget_hours * row.paid_gpus * row.price_per_hour


def ranges(result: rental.RentalResult) -> None:
    """Per GPU, the spread of an hour of 1 and of 8 GPUs across the catalog's providers (whole
    instances: one GPU of an 8-GPU instance costs the instance)."""
    for gpu in result.catalog.offers.gpu.unique():
        parts = []
        for count in (1, 8):
            table = spread(result.catalog, gpu, count)
            hourly = table.price_per_used_gpu_hour.dropna() * count
            spot = table.spot_price_per_used_gpu_hour.dropna() * count
            who = ", ".join(p + (f" x{int(n)} instances" if n and n > 1 else "")
                            for p, n in zip(table.provider, table.instances, strict=True))
            parts.append(f"{count} GPU{'s' * (count > 1)}/h {hourly.min():.2f}-{hourly.max():.2f}"
                         f" over {len(hourly)} ({who}), spot "
                         + (f"{spot.min():.2f}-{spot.max():.2f} over {len(spot)}"
                            if len(spot) else "none"))
        print(f"  {gpu:<10} " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="workbook.samples.generation:task")
    parser.add_argument("--smoke", action="store_true", help="08's smoke sizes")
    args = parser.parse_args()
    base = wb.params.of("08_rental_plan", small=args.smoke, task=args.task)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "company.csv").write_text(COMPANY)
        runs = {
            "shipped catalog": priced(base, tmp / "shipped"),
            "user catalog": priced({**base, "price_catalog": str(tmp / "company.csv")},
                                   tmp / "user"),
            "assumed prices": priced({**base, "gpus": {g: base["gpus"][g] for g in ASSUMED},
                                      "gpu_tflops": {g: base["gpu_tflops"][g] for g in ASSUMED},
                                      "gpu_price_per_hour": ASSUMED}, tmp / "assumed")}
    for name, result in runs.items():
        best = recommended(result)
        print(f"{name}: {result.catalog.described()}")
        ranges(result)
        print(f"  recommended: candidate {result.chosen['candidate']} on "
              f"{int(best.cheapest_gpus)} x {best.cheapest_gpu}, {best.cheapest_hours:.2f} h "
              f"({best.cheapest_speed_from} speed), {best.currency} {best.cheapest_cost:.2f} "
              f"on {best.cheapest_offer}; spot "
              + (f"{best.currency} {best.cheapest_spot_cost:.2f} on {best.cheapest_spot_offer}"
                 if pd.notna(best.cheapest_spot_cost) else "not offered"))
        spread = result.offers[result.offers.candidate == result.chosen["candidate"]]
        for r in spread.itertuples():
            print(f"    {r.provider:<8} {r.offer:<34} {r.price_per_used_gpu_hour:>7.3f}/GPU-h "
                  f"cost {r.cost:>8.2f}   spot "
                  + (f"{r.spot_price_per_used_gpu_hour:.3f}/GPU-h cost {r.spot_cost:.2f}"
                     if pd.notna(r.spot_cost) else "-"))
    shipped = runs["shipped catalog"]
    ratio = spend(shipped) / spend(runs["assumed prices"])
    print(f"offers: {len(shipped.catalog.offers)} providers: {len(shipped.catalog.providers)} "
          f"cheapest_vs_assumed: {ratio:.3f}")


if __name__ == "__main__":
    main()
