"""Every planted case, named by its cause or not, the blind ones apart.

The project's own planted suites (benchmarks/llm_finetune.py, frameworks.py, foreign_code.py:
each prints `..._named: N/M  false_alarms: K`) and the blind cases (tests/blind: written from
public bug reports by someone who had not read the checks; a test marked `twin` is a clean twin
that must raise nothing, every other one a planted bug that must be named) are run and
counted. The blind count is the figure that predicts what users see; each blind file's first
run against the unchanged workbook is kept in tests/blind/FIRST_RUN*.md.

    python benchmarks/planted_cases.py [--blind-only | --trainers-only]

First lines: `grpo_named`, `reward_named`, `accelerate_named: N/M  ..._false_alarms: K` (the
planted tests and clean twins of tests/contract/test_<trainer>.py, named in the notebook a user
reads first); last lines: `project_named: N/M  project_false_alarms: K`, `blind_named: N/M
blind_false_alarms: K`.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("llm_finetune", "frameworks", "foreign_code")
COUNT = re.compile(r"_named\w*: (\d+)/(\d+)\s+false_alarms: (\d+)")
LIMIT = 1800  # seconds for one suite


def run(cmd: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORKBOOK_HEADLESS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=LIMIT)
    return done.stdout + done.stderr


def suite(name: str) -> tuple[int, int, int]:
    """(named, planted, false alarms) of one of the project's benchmark suites."""
    out = run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py")])
    found = COUNT.findall(out)
    if not found:
        raise SystemExit(f"error: {name}.py printed no count; its last lines:\n{out[-2000:]}")
    named, planted, alarms = map(int, found[-1])
    return named, planted, alarms


# the trainers of issue 54, each with its planted bugs (`planted`) and clean twins (`twin`)
TRAINERS = {"grpo": "tests/contract/test_grpo.py", "reward": "tests/contract/test_reward.py",
            "accelerate": "tests/contract/test_accelerate.py"}


def blind(marker: str, where: str = "tests/blind") -> tuple[int, int]:
    """(passed, run) of the tests under `where` selected by `marker`."""
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
               "-m", marker, where, "-o", "addopts="])
    counts = dict((word, int(n)) for n, word in re.findall(
        r"(\d+) (passed|failed|xfailed|xpassed|error|errors)", out.splitlines()[-1]
        if out.strip() else ""))
    passed = counts.get("passed", 0) + counts.get("xpassed", 0)
    total = passed + counts.get("failed", 0) + counts.get("xfailed", 0) + \
        counts.get("error", 0) + counts.get("errors", 0)
    print(f"  {where} ({marker}): "
          f"{out.strip().splitlines()[-1] if out.strip() else 'no output'}")
    return passed, total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blind-only", action="store_true", help="skip the project's suites")
    parser.add_argument("--trainers-only", action="store_true",
                        help="only the GRPO, reward-model and Accelerate planted cases")
    args = parser.parse_args()
    named = planted = alarms = 0
    for trainer, path in TRAINERS.items():
        n, p = blind("planted", path)
        silent, twins = blind("twin", path)
        print(f"{trainer}_named: {n}/{p}  {trainer}_false_alarms: {twins - silent} "
              f"(of {twins} clean twins)", flush=True)
    if args.trainers_only:
        return
    if not args.blind_only:
        for name in SUITES:
            n, p, a = suite(name)
            print(f"{name}: {n}/{p} named, {a} false alarms", flush=True)
            named, planted, alarms = named + n, planted + p, alarms + a
        print(f"project_named: {named}/{planted}  project_false_alarms: {alarms}")
    bugs_named, bugs = blind("not twin")
    twins_silent, twins = blind("twin")
    print(f"blind_named: {bugs_named}/{bugs}  blind_false_alarms: {twins - twins_silent}")


if __name__ == "__main__":
    main()
