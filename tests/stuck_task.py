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
