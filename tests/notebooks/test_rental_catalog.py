"""Notebook 08's price catalog and speed references: the shipped files read with their date and
sources, bad catalogs and tables refused with the line and the fix (each beside a clean twin),
whole-instance pricing, spot interruptions, interpolation and 03's calibration."""

import datetime as dt
import math
from pathlib import Path

import pandas as pd
import pytest

from workbook import WorkbookError
from workbook.notebooks.rental.candidates import Candidate
from workbook.notebooks.rental.plans import cheapest, pack
from workbook.notebooks.rental.prices import (
    Spot,
    cheapest_offer,
    price_columns,
    read_catalog,
    spread,
)
from workbook.notebooks.rental.sheet import Assumptions, selection_sheet
from workbook.notebooks.rental.speeds import (
    calibrate,
    gpu_of_device,
    measured_speed,
    read_speeds,
)
from workbook.training.loop import UpdateShape
from workbook.training.predict import Plan

GPUS = {"L4": 24, "A100-40GB": 40, "L40S": 48, "A100-80GB": 80, "H100": 80, "H200": 141}
HEADER = ("Provider,InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,"
          "Price,SpotPrice,Region,AvailabilityZone")
CLEAN = ["x,one,H100,1,16,200,,2.0,1.0,r1,", "x,eight,H100,8,128,1600,,12.0,,r1,",
         "y,two,H100,2,32,400,,5.0,0.8,r2,", "y,cpu-box,,,4,16,,0.2,0.1,r2,"]


def _catalog(tmp_path: Path, rows: list[str], header: str = HEADER,
             meta: tuple[str, ...] = ("# date: 2026-11-01", "# source x: https://x.example")):
    path = tmp_path / "prices.csv"
    path.write_text("\n".join([*meta, header, *rows]) + "\n")
    return path


def test_the_shipped_catalog_is_dated_sourced_and_reads_clean():
    catalog = read_catalog("", GPUS, today=dt.date(2026, 12, 3))
    assert catalog.date == dt.date(2026, 12, 3) and catalog.dated_by == "the file"
    assert catalog.providers == ["aws", "lambda", "nebius", "runpod", "verda"]
    assert set(catalog.sources) == set(catalog.providers), "every provider cites its file"
    assert all("skypilot-catalog/blob/" in url for url in catalog.sources.values())
    assert set(catalog.offers.gpu) == set(GPUS), "every GPU of the default list has an offer"
    assert catalog.offers.source.str.startswith("skypilot-catalog@").all()
    # SkyPilot's "A100" is the 40 GB card
    assert set(catalog.offers[catalog.offers.instance == "gpu_1x_a100"].gpu) == {"A100-40GB"}


def test_a_clean_catalog_reads_and_leaves_out_what_is_no_gpu_offer(tmp_path):
    catalog = read_catalog(_catalog(tmp_path, CLEAN + ["x,t4,T4,1,4,16,,0.5,,r1,",
                                                       "x,nothing,H100,1,4,16,,,,r1,",
                                                       "x,slice,L4,0.125,4,16,,0.1,,r1,"]),
                           GPUS, today=dt.date(2026, 12, 3))
    assert len(catalog.offers) == 3 and catalog.providers == ["x", "y"]
    assert catalog.left_out == {"CPU only": 1, "a GPU the plan does not consider": 1,
                                "no price (neither Price nor SpotPrice)": 1,
                                "a slice of a GPU": 1}
    assert catalog.offers.line.tolist() == [4, 5, 6], "file line numbers kept per offer"
    # a GPU SkyPilot knows that the notebook's list leaves out is no error
    fewer = read_catalog("", {"L4": 24}, today=dt.date(2026, 12, 3))
    assert set(fewer.offers.gpu) == {"L4"} and fewer.left_out[
        "a GPU the plan does not consider"] == 21


@pytest.mark.parametrize("rows, header, meta, words", [
    (CLEAN, HEADER.replace(",SpotPrice", ""), ("# date: 2026-11-01",),
     r"line 2: no column SpotPrice"),
    (CLEAN[:1] + ["x,bad,H100,1,16,200,,-2.0,1.0,r1,"], HEADER, ("# date: 2026-11-01",),
     r"line 4: Price '-2.0' is not a price of 0 or more"),
    (CLEAN[:1] + ["x,bad,H100,1,16,200,,2.0,cheap,r1,"], HEADER, ("# date: 2026-11-01",),
     r"line 4: SpotPrice 'cheap' is not a price"),
    (CLEAN[:1] + ["x,bad,H1OO,1,16,200,,2.0,1.0,r1,"], HEADER, ("# date: 2026-11-01",),
     r"line 4: unknown GPU 'H1OO'"),
    (CLEAN[:1] + ["x,bad,H100,zero,16,200,,2.0,1.0,r1,"], HEADER, ("# date: 2026-11-01",),
     r"line 4: AcceleratorCount 'zero' is not a positive number"),
    (CLEAN, HEADER, ("# source x: https://x.example", "# date: 2027-01-01"),
     r"line 2: date 2027-01-01 is after today \(2026-12-03\)"),
    (CLEAN, HEADER, ("# date: last week",), r"date 'last week' is not YYYY-MM-DD"),
    (CLEAN, HEADER, ("# date: 2026-11-01", "# currency: EUR"), r"prices in EUR"),
])
def test_a_bad_catalog_is_refused_with_its_line_and_the_fix(tmp_path, rows, header, meta,
                                                            words):
    with pytest.raises(WorkbookError, match=words) as caught:
        read_catalog(_catalog(tmp_path, rows, header, meta), GPUS, "USD", dt.date(2026, 12, 3))
    assert caught.value.fix


def test_a_missing_catalog_and_a_skypilot_file_without_provider_column(tmp_path):
    with pytest.raises(WorkbookError, match="does not exist"):
        read_catalog(tmp_path / "nope.csv", GPUS)
    folder = tmp_path / "lambda"
    folder.mkdir()
    # SkyPilot's own layout: <cloud>/vms.csv, no Provider, no AvailabilityZone, no date line
    (folder / "vms.csv").write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,"
        "SpotPrice\ngpu_1x_a100,A100,1.0,30.0,200.0,1.99,us-east-1,,\n")
    catalog = read_catalog(folder / "vms.csv", GPUS)
    assert catalog.providers == ["lambda"] and catalog.offers.gpu.tolist() == ["A100-40GB"]
    assert catalog.dated_by.startswith("no date in the file")


def test_whole_instances_are_paid_and_the_cheapest_total_wins(tmp_path):
    offers = read_catalog(_catalog(tmp_path, CLEAN), GPUS, today=dt.date(2026, 12, 3)).offers
    assert cheapest_offer(offers, 1, "price").instance == "one"  # 2.0 beats 5.0 and 12.0
    # two GPUs share one instance: "two" at 5.0, not two "one" at 4.0 with no link between
    assert cheapest_offer(offers, 2, "price").instance == "two"
    assert cheapest_offer(offers, 8, "price").instance == "eight"  # one node, not 8 x "one"
    assert cheapest_offer(offers[offers.instance == "eight"], 1, "spot_price") is None
    # where no instance holds them all, several smaller ones, said in the offer's words
    ones = offers[offers.instance == "one"]
    assert cheapest_offer(ones, 2, "price").instance == "one"
    # at the same total, fewer instances
    tie = read_catalog(_catalog(tmp_path, ["x,one,H100,1,1,1,,1.0,,r,",
                                           "x,four,H100,4,1,1,,4.0,,r,"]),
                       GPUS, today=dt.date(2026, 12, 3)).offers
    assert cheapest_offer(tie, 8, "price").instance == "four"
    catalog = read_catalog(_catalog(tmp_path, CLEAN[:1]), GPUS, today=dt.date(2026, 12, 3))
    row = price_columns("H100", 2, (1.0, 1.0, 1.0), {}, catalog, None, 0.0)
    assert row["offer"] == "x one (1 GPU, r1) x2 instances" and row["cost"] == 4.0


def test_price_columns_typed_wins_and_spot_adds_the_interruptions(tmp_path):
    catalog = read_catalog(_catalog(tmp_path, CLEAN[1:2]), GPUS, today=dt.date(2026, 12, 3))
    row = price_columns("H100", 1, (10.0, 8.0, 12.0), {}, catalog, None, 0.0)
    # a 1-GPU job on the only instance, an 8-GPU one: 8 GPUs paid at 1.5 each
    assert (row["paid_gpus"], row["price_per_hour"], row["cost"]) == (8, 1.5, 120.0)
    assert (row["cost_low"], row["cost_high"]) == (96.0, 144.0)
    assert row["spot_cost"] is None and row["price_from"] == "catalog of 2026-11-01"
    typed = price_columns("H100", 1, (10.0, 8.0, 12.0), {"H100": 3.0}, catalog, None, 0.0)
    assert (typed["cost"], typed["price_from"], typed["paid_gpus"]) == (30.0, "typed", 1)
    assert typed["offer"] == "typed: gpu_price_per_hour" and typed["spot_cost"] is None
    spot = Spot(interruptions_per_day=2.0, restart_minutes=30.0, resume_s=0.0)
    cheap = read_catalog(_catalog(tmp_path, CLEAN[:1]), GPUS, today=dt.date(2026, 12, 3))
    # 2 a day x (30 min + half of a 1 h checkpoint interval) = 2 h lost a day: 1/12 more
    row = price_columns("H100", 1, (24.0, 24.0, 24.0), {}, cheap, spot, 3600.0)
    assert row["spot_cost"] == pytest.approx(24 * (1 + 2 / 24) * 1.0)
    assert Spot(0.0).overhead(3600.0) == 0.0
    with pytest.raises(WorkbookError, match="spot_restart_minutes is -1"):
        Spot(1.0, -1)


def test_the_spread_lists_each_providers_cheapest_offer(tmp_path):
    catalog = read_catalog(_catalog(tmp_path, CLEAN), GPUS, today=dt.date(2026, 12, 3))
    table = spread(catalog, "H100", 2)
    assert table.provider.tolist() == ["y", "x"]
    assert table.price_per_used_gpu_hour.tolist() == [2.5, 6.0] and table.offer.tolist() == [
        "two", "eight"]
    assert table.spot_price_per_used_gpu_hour.tolist()[0] == 0.4
    # one GPU used of the 8-GPU instance: its whole price per used GPU
    assert spread(catalog, "H100", 1).price_per_used_gpu_hour.tolist() == [2.0, 5.0]


def test_the_sheet_prices_every_row_from_the_catalog(gen_task, gen_items, tmp_path):
    gpus = {"toy": 1.0, "small": 24, "big": 80}
    catalog = read_catalog(_catalog(tmp_path, ["p,s1,small,1,4,16,,1.0,0.3,r,",
                                               "q,s1,small,1,4,16,,1.2,,r,",
                                               "p,b8,big,8,4,16,,16.0,4.0,r,"]),
                           gpus, today=dt.date(2026, 12, 3))
    cand = Candidate("c", Plan(UpdateShape(4, 2, precision="fp32"), length=64))
    sheet = selection_sheet(gen_task, gen_items["train"][:30], gen_items["validation"][:8],
                            [cand], gpus, {"toy": 10, "small": 100, "big": 400}, 1000, 0.2,
                            Assumptions(catalog=catalog, spot=Spot(0.0)))
    rows = sheet.set_index("gpu")
    assert rows.loc["small", "offer"] == "p s1 (1 GPU, r)" and rows.loc["small", "providers"] == 2
    assert rows.loc["big", "paid_gpus"] == 8, "the 8-GPU instance is paid whole"
    assert rows.loc["big", "cost"] == pytest.approx(round(rows.loc["big", "budget_hours"] * 16, 2))
    assert rows.loc["small", "spot_cost"] == pytest.approx(
        round(rows.loc["small", "budget_hours"] * 0.3, 2))
    assert pd.isna(rows.loc["toy", "cost"]) and pd.isna(rows.loc["toy", "offer"])
    assert "catalog" in sheet.attrs["sources"]["cost"]
    options = cheapest(sheet, "big").set_index("candidate")
    assert options.loc["c", "cheapest_gpu"] == "small"
    assert options.loc["c", "cheapest_offer"] == "p s1 (1 GPU, r)"
    plans = pack([{"name": "v", "priority": 1, "candidate": "c", "repeats": 2}], sheet, "small",
                 3, 0.2)
    assert plans.offer.tolist() == ["p s1 (1 GPU, r)"]
    assert plans.spot_cost[0] == pytest.approx(rows.loc["small", "spot_cost"] * 2, abs=0.011)


def test_the_shipped_speed_references_cite_every_row_and_interpolate():
    book = read_speeds("", GPUS)
    assert set(book.sources) == {"llm-foundry", "torchtitan"}
    assert book.references.source.isin(list(book.sources)).all()
    a100 = book.references[book.references.gpu == "A100-80GB"]
    one = a100[a100.parameters == 1315950592].mfu.iloc[0]
    three = a100[a100.parameters == 2651837440].mfu.iloc[0]
    middle = math.exp((math.log(1315950592) + math.log(2651837440)) / 2)
    speed = book.estimate("A100-80GB", middle, "fsdp")
    assert speed.basis == "interpolated" and speed.mfu == pytest.approx((one + three) / 2,
                                                                          abs=1e-4)
    assert (speed.low, speed.high) == (min(one, three), max(one, three))
    assert "interpolated in log(parameters) between 1.32 B and 2.65 B" in speed.words
    tiny = book.estimate("A100-80GB", 200_000, "single")
    assert tiny.basis == "extrapolated" and "smallest reference (125.31 M)" in tiny.words
    assert "no single reference: fsdp rows stand in" in tiny.words
    l4 = book.estimate("L4", 7e9, "fsdp")
    assert l4.words.startswith("no L4 reference: those of A100-40GB, A100-80GB, H100")
    # MPT's "7b" (6.66 and 6.67 B, two sequence lengths) is one size: 2 rows beside 8 B's 2
    h100 = book.estimate("H100", 7.3e9, "fsdp")
    assert h100.words.endswith("range 0.33-0.46 MFU over 4 rows of llm-foundry, torchtitan")
    assert 0.33 < h100.mfu < 0.4644 and (h100.low, h100.high) == (0.33, 0.4644)
    without_h100 = read_speeds("", {"L4": 24})
    assert "H100" in without_h100.estimate("L4", 8e9, "fsdp").words, "off-list GPUs stand in"
    exact = book.estimate("H100", 8e9, "fsdp")
    assert exact.basis == "reference" and (exact.low, exact.high) == (0.33, 0.39)


@pytest.mark.parametrize("row, words", [
    ("H100,1e9,fsdp,0.4,ref", None),
    ("H100,1e9,fsdp,1.5,ref", r"line 3: mfu '1.5' is not a share"),
    ("B900,1e9,fsdp,0.4,ref", r"line 3: unknown GPU 'B900'"),
    ("H100,-1,fsdp,0.4,ref", r"line 3: parameters '-1' is not a positive count"),
    ("H100,1e9,zero3,0.4,ref", r"line 3: strategy 'zero3'"),
    ("H100,1e9,fsdp,0.4,blog", r"line 3: source 'blog' has no address"),
])
def test_a_bad_speed_table_is_refused_with_its_line(tmp_path, row, words):
    path = tmp_path / "speeds.csv"
    path.write_text(f"# ref: https://example.org/bench\ngpu,parameters,strategy,mfu,source\n"
                    f"{row}\n")
    if words is None:
        assert read_speeds(path, GPUS).estimate("H100", 1e9, "fsdp").mfu == 0.4
        return
    with pytest.raises(WorkbookError, match=words):
        read_speeds(path, GPUS)


def test_the_gpu_of_a_cuda_device_name():
    assert gpu_of_device("NVIDIA A100-SXM4-80GB", GPUS) == "A100-80GB"
    assert gpu_of_device("NVIDIA A100-SXM4-40GB", GPUS) == "A100-40GB"
    assert gpu_of_device("NVIDIA H100 80GB HBM3", GPUS) == "H100"
    assert gpu_of_device("NVIDIA L40S", GPUS) == "L40S"
    assert gpu_of_device("NVIDIA L4", GPUS) == "L4"
    assert gpu_of_device("NVIDIA GeForce RTX 4090", GPUS) is None


def _gates(device: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    gates = pd.DataFrame([{"phase": "data", "micro_batch": 2, "seq_len": 64, "precision": "bf16",
                           "device": device, "time_s": 0.1, "verdict": "pass"},
                          {"phase": "resume", "micro_batch": 2, "seq_len": 64,
                           "precision": "bf16", "device": device, "time_s": 0.4,
                           "verdict": "pass"}])
    pipeline = pd.DataFrame({"step": [1, 2, 3], "examples": [16] * 3,
                             "time_s": [0.02, 0.01, 0.04]})
    return gates, pipeline


def test_03_on_a_gpu_of_the_list_calibrates_the_speed_and_says_measured(tmp_path):
    gates, pipeline = _gates("cuda:0")
    speed, _ = measured_speed(gates, pipeline, "H100", 1e12, 1000.0, True)
    # 1e12 FLOPs in the median 0.02 s = 50 TFLOP/s of a 1000 TFLOP/s peak
    assert speed.basis == "measured" and speed.mfu == pytest.approx(0.05)
    assert (speed.low, speed.high) == pytest.approx((0.025, 0.1))
    cpu, why = measured_speed(*_gates("cpu"), "H100", 1e12, 1000.0, True)
    assert cpu is None and "ran on cpu" in why
    twin, why = measured_speed(gates, pipeline, "H100", 1e12, 1000.0, False)
    assert twin is None and "pilot twin" in why
    folder = tmp_path / "03_phase_gates"
    folder.mkdir()
    gates.to_csv(folder / "gates.csv", index=False)
    pipeline.to_csv(folder / "input_pipeline.csv", index=False)
    book = read_speeds("", GPUS)
    seen = []

    def count(micro, acc, length, precision):
        seen.append((micro, acc, length, precision))
        return 1e12

    words = calibrate(book, tmp_path, count, GPUS, {"H100": 1000.0}, True,
                      "NVIDIA H100 80GB HBM3")
    assert seen == [(2, 8, 64, "bf16")] and words.startswith("measured")
    assert book.estimate("H100", 7e9, "fsdp").basis == "measured"
    assert book.estimate("A100-80GB", 7e9, "fsdp").basis != "measured"
    assert calibrate(read_speeds("", GPUS), tmp_path / "none", count, GPUS, {}, True,
                     None).startswith("notebook 03 did not run")


def test_the_conclusion_names_the_offer_the_date_the_range_and_what_it_rests_on():
    from workbook.notebooks.rental.conclusions import offered, ranged, resting_on

    best = pd.Series({"cheapest_offer": "p s1 (1 GPU, r)", "cheapest_price_from":
                      "catalog of 2026-11-01", "cheapest_cost_low": 10.0,
                      "cheapest_cost_high": 14.0, "cheapest_spot_cost": 4.0,
                      "cheapest_spot_offer": "p s1 (1 GPU, r)"})
    assert offered(best, "USD") == (
        ", priced on p s1 (1 GPU, r), catalog of 2026-11-01, USD 10.00 to USD 14.00 over the "
        "speeds' range; on spot USD 4.00 (p s1 (1 GPU, r), interruptions included)")
    assert "no spot offer" in offered(best.drop("cheapest_spot_cost"), "USD")
    assert offered(pd.Series({"cheapest_offer": None}), "USD") == ""
    plan = pd.DataFrame({"hours_low": [1.0, 2.0], "hours_high": [1.5, 3.0],
                         "cost_low": [1.0, 2.0], "cost_high": [1.5, 3.0],
                         "offer": ["p s1 (1 GPU, r)"] * 2, "price_from": ["catalog of D"] * 2})
    assert ranged(plan, "USD") == (" (3.0-4.5 h, USD 3.00-USD 4.50 over the speeds' range; "
                                   "priced on p s1 (1 GPU, r), catalog of D)")
    flat = plan.assign(hours_high=plan.hours_low)
    assert ranged(flat, "USD").startswith(" (no range")
    words = resting_on({"speeds": "speed references X", "calibration": "measured: 03",
                        "catalog": "catalog Y of 2026-11-01", "typed": ["H100"]})
    assert words == ("Times rest on speed references X (measured: 03); costs on the catalog Y of "
                     "2026-11-01; typed prices for H100 win over it; memory on a fake-tensor "
                     "prediction plus stated overheads.")
    assert "assumed utilisation" in resting_on(None)
