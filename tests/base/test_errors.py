import pickle

import pytest

from workbook.base.errors import WorkbookError
from workbook.base.forked import ForkedWorkers, WorkerTraceback, fork_available


def test_a_workbook_error_pickles_whole():
    back = pickle.loads(pickle.dumps(WorkbookError("encode failed on example 4", "fix encode")))
    assert type(back) is WorkbookError
    assert (back.problem, back.fix) == ("encode failed on example 4", "fix encode")
    assert str(back) == "encode failed on example 4\n  -> fix: fix encode"


def _refuse(n):
    raise WorkbookError(f"example {n} refused", "fix example")


@pytest.mark.skipif(not fork_available(), reason="no fork here")
def test_a_workers_workbook_error_reaches_the_parent_as_itself():
    with ForkedWorkers(_refuse, 1, "a test's work", "nothing") as workers:
        workers.put(7)
        with pytest.raises(WorkbookError, match="example 7 refused") as raised:
            workers.take()
    assert raised.value.fix == "fix example"
    assert isinstance(raised.value.__cause__, WorkerTraceback)
