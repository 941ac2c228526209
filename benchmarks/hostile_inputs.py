"""Hostile and careless input, probe by probe (tests/hostile_probes.py): tampered archives,
checkpoints and plans that name a marker-writing task, empty or forged manifests, extra files,
hostile ids in the report, a full disk (a tiny tmpfs, as root), bad paths and bad values.

    python benchmarks/hostile_inputs.py

Last lines: `hostile_inputs_handled: N/N`, `code_executed: 0`, `files_left_behind: 0`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hostile_probes import PROBES, probe  # noqa: E402


def main() -> int:
    handled = ran = left = 0
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
        message = " ".join(outcome.message.split())[:110]
        print(f"{'ok ' if outcome.handled else 'BAD'} {name:40s} {message}")
    total = len(PROBES) - len(skipped)
    if skipped:
        print(f"skipped here: {', '.join(skipped)}")
    print(f"hostile_inputs_handled: {handled}/{total}")
    print(f"code_executed: {ran}")
    print(f"files_left_behind: {left}")
    return 0 if handled == total and not ran and not left else 1


if __name__ == "__main__":
    sys.exit(main())
