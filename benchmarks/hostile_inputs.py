"""Hostile and careless input, probe by probe (tests/hostile_probes.py), every class of
issue 26: fields of the wrong type, range or shape in files the workbook wrote (checkpoint state
and meta, the recipe, archives, study designs, manifests, results), links, SQL planted in the
ledger, outputs that exist, suggested commands pasted into a shell, parameters that cannot
mean anything, the task's own pieces raising, a full disk (tiny tmpfs mounts, as root), exports
carrying hostile links, and child processes outliving their parent or the pilot.

    python benchmarks/hostile_inputs.py

Last lines: `hostile_inputs_handled: N/N`, `code_executed: 0`, `files_left_behind: 0`,
`sql_executed: 0`, `outputs_overwritten: 0`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hostile_probes import PROBES, probe  # noqa: E402


def main() -> int:
    handled = ran = left = sql = overwritten = 0
    skipped = []
    for name in PROBES:
        outcome = probe(name)
        if outcome.skipped:
            skipped.append(name)
            print(f"--- {name:40s} skipped: {outcome.skipped}")
            continue
        handled += outcome.handled
        ran += outcome.code_ran
        left += len(outcome.left)
        sql += outcome.sql_ran
        overwritten += outcome.overwritten
        message = " ".join(outcome.message.split())[:110]
        print(f"{'ok ' if outcome.handled else 'BAD'} {name:40s} {message}")
    total = len(PROBES) - len(skipped)
    if skipped:
        print(f"skipped here: {', '.join(skipped)}")
    print(f"hostile_inputs_handled: {handled}/{total}")
    print(f"code_executed: {ran}")
    print(f"files_left_behind: {left}")
    print(f"sql_executed: {sql}")
    print(f"outputs_overwritten: {overwritten}")
    return 0 if handled == total and not (ran or left or sql or overwritten) else 1


if __name__ == "__main__":
    sys.exit(main())
