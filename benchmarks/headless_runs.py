"""Soak check for hangs: notebook 01 run headless by the pilot N times in a row while another
process keeps one core busy. A hang shows as a run that hits its time limit.

    python benchmarks/headless_runs.py [--runs 30] [--task MOD:ATTR] [--limit 120]

Last line: `headless_runs: <finished>/<runs> finished, hung: <n>, median_s: <s>`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def burn(stop: float) -> None:
    """Keep one core busy until `stop` (time.time())."""
    x = 0
    while time.time() < stop:
        x = (x * 31 + 7) % 1_000_003


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--task", default="workbook.samples.generation:task")
    parser.add_argument("--limit", type=float, default=120, help="the pilot's --timeout")
    args = parser.parse_args()
    busy = multiprocessing.Process(target=burn, args=(time.time() + 24 * 3600,), daemon=True)
    busy.start()
    finished, hung, seconds = 0, 0, []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(1, args.runs + 1):
                out = Path(tmp) / f"run{n}"
                start = time.monotonic()
                try:
                    done = subprocess.run(
                        [sys.executable, "-m", "workbook", "pilot", "--task", args.task,
                         "--smoke", "--only", "01", "--out", str(out),
                         "--timeout", str(args.limit)],
                        capture_output=True, text=True, timeout=args.limit + 120)
                    if (out / "index.json").exists():
                        row = json.loads((out / "index.json").read_text())["notebooks"][0]
                        verdict, error = row["verdict"], row["error"]
                    else:
                        verdict, error = "pilot failed", done.stderr.strip()[-300:]
                except subprocess.TimeoutExpired:  # the pilot's own limit failed to act
                    verdict, error = "hung", "the pilot itself passed its limit"
                took = time.monotonic() - start
                seconds.append(took)
                if verdict in ("pass", "fail"):
                    finished += 1
                elif "did not finish within" in error or verdict == "hung":
                    hung += 1
                print(f"run {n:2d}: {verdict} in {took:.1f} s {error}", flush=True)
    finally:
        busy.terminate()
    print(f"headless_runs: {finished}/{args.runs} finished, hung: {hung}, "
          f"median_s: {statistics.median(seconds):.1f}")
    return 0 if finished == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
