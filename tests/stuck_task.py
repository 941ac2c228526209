"""The README's own task, made to hang or kill its kernel once: for the pilot's time limits.
The fault fires only inside a notebook kernel (never in the pilot's own process) and only while
the `flag` file exists; it removes the flag first, so the next notebook runs normally."""

import os
import time
from pathlib import Path

from IPython import get_ipython

from tests.own_task import task as clean


def _examples(flag: Path, fault: str):
    def load():
        if get_ipython() is not None and flag.exists():
            flag.unlink()
            if fault == "hang":
                time.sleep(3600)
            os._exit(9)  # "die": the kernel vanishes mid-cell
        return clean.load_examples()
    return load


def task(flag: str, fault: str = "hang"):
    import dataclasses

    return dataclasses.replace(clean, load_examples=_examples(Path(flag), fault))


def hung_rank(rank: str = "1"):
    """The README's own task whose data never loads on one rank of a torchrun launch: the
    other ranks wait for it at their first collective."""
    import dataclasses

    def load():
        if os.environ.get("RANK") == rank:
            time.sleep(3600)
        return clean.load_examples()
    return dataclasses.replace(clean, load_examples=load)


def stuck_child(pid_file: str, grandchild: bool = False, only_in: str = "reload"):
    """The README's own task whose examples never load in `python -m workbook <only_in>` (a
    fresh process of the workbook): it writes its pid (and, with `grandchild`, the pid of a
    process it starts in a session of its own, as torchrun's workers are) to `pid_file`, then
    sleeps. Everywhere else (the probe, a kernel) it is the clean task."""
    import dataclasses
    import subprocess
    import sys

    def load():
        if sys.argv[1:2] == [only_in]:
            pids = [os.getpid()]
            if grandchild:
                pids.append(subprocess.Popen(["sleep", "3600"], start_new_session=True).pid)
            tmp = Path(f"{pid_file}.tmp")
            tmp.write_text(" ".join(map(str, pids)))
            tmp.rename(pid_file)
            time.sleep(3600)
        return clean.load_examples()
    return dataclasses.replace(clean, load_examples=load)
