"""The pilot's time limits and interruptions: a stuck or dead kernel, or a notebook that
raises, becomes an error row and the pilot goes on, a killed pilot leaves a valid index of what
finished, a finished kernel is shut down without an interrupt (apart from
tests/commands/test_pilot.py so that the two test workers share the pilot's heavy runs).
The killed pilot's process runs beside the tests before it (`killed`): the stuck kernel's test
mostly waits for its time limit."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from workbook.commands.pilot import run_pilot


def faulty(tmp_path, fault: str) -> tuple[dict, Path]:
    """tests.stuck_task's options: its fault fires once, in the first notebook's kernel."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    flag = tmp_path / "fault-once"
    flag.write_text("")
    return {"flag": str(flag), "fault": fault}, flag


def indexed(run: Path) -> list[dict]:
    """The rows of the run's index.json (none before the first notebook finished)."""
    index = run / "index.json"
    return json.loads(index.read_text())["notebooks"] if index.exists() else []


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """test_a_dead_kernel_...'s pilot, one process of its own (`python -m workbook pilot`),
    started when the module's first test asks for it: 01's kernel dies, 08 stops with an
    error (an unknown rental GPU), and SIGTERM comes as 09 starts, once 01 and 08 are indexed
    (a thread watches its index.json). Stopped, its kernels with it, whatever the tests did."""
    tmp = tmp_path_factory.mktemp("killed")
    options, flag = faulty(tmp, "die")
    out, stderr, temp = tmp / "run", tmp / "stderr.txt", tmp / "temp"
    temp.mkdir()  # the pilot's and its kernels' temporary files (TMPDIR)
    with stderr.open("w") as err:  # a file: a pipe nobody reads while 01 hangs could fill
        proc = subprocess.Popen([sys.executable, "-m", "workbook", "pilot", "--task",
                                 "tests.stuck_task:task",
                                 *[f"--option={k}={v!r}" for k, v in options.items()],
                                 "--smoke", "--only", "01,08,09", "-p", "rental_gpu='B300'",
                                 "--out", str(out)],
                                env={**os.environ, "PYTHONPATH": os.getcwd(),
                                     "TMPDIR": str(temp)},
                                stdout=subprocess.DEVNULL, stderr=err)

    def terminate_once_two_are_indexed():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(indexed(out)) < 2 and proc.poll() is None:
            time.sleep(0.2)
        if len(indexed(out)) == 2 and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    watcher = threading.Thread(target=terminate_once_two_are_indexed, daemon=True)
    watcher.start()
    try:
        yield SimpleNamespace(proc=proc, watcher=watcher, out=out, flag=flag, stderr=stderr,
                              temp=temp)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the pilot shuts its kernel down on SIGTERM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        watcher.join()


def test_a_stuck_kernel_becomes_an_error_row_at_the_time_limit(tmp_path, killed):
    """A hang waits for the limit, so it runs 01 alone, at a limit past the time its kernel
    takes to reach the hanging cell (about 4 s on an idle 2-core machine: start, then
    `import workbook`; more while `killed`'s pilot runs beside it, which the wait leaves room
    for). A limit that ended it before the hang fired (the flag still there: a loaded machine)
    is tried once longer; the claim is the same either way."""
    for limit in (12, 30):
        options, flag = faulty(tmp_path / f"{limit}", "hang")
        run, index = run_pilot("tests.stuck_task:task", out=str(tmp_path / f"{limit}" / "run"),
                               smoke=True, only="01", task_options=options, progress=False,
                               timeout=limit)
        if not flag.exists():
            break
    [row] = index.to_dict(orient="records")
    assert row["verdict"] == "error" and not flag.exists(), row
    assert f"did not finish within {limit} s" in row["error"]
    assert "stuck in cell" in row["error"] and row["seconds"] < limit + 30
    assert "wb.inspection.run(p, out" in row["error"], "names the cell that was running"
    assert [r["verdict"] for r in indexed(run)] == ["error"]


def test_a_finished_kernel_is_shut_down_without_an_interrupt_and_a_time_limit_still_has_one(
        tmp_path):
    """jupyter_client sends SIGINT before every shutdown request; a kernel that is not in its
    idle loop when it lands writes a KeyboardInterrupt ('Fatal Python error' while it starts)
    into kernels.log - one per notebook. The pilot's kernels are shut down without it; a
    cell's time limit still interrupts."""
    import asyncio

    from workbook.commands.pilot import _kernel_manager, ensure_kernel

    async def lifecycle():
        km = _kernel_manager(tmp_path / "kernels.log")(kernel_name=ensure_kernel())
        await km.start_kernel()
        client = km.client()
        client.start_channels()
        sent, send = [], km.provisioner.send_signal

        async def spy(signum):
            sent.append(signum)
            return await send(signum)
        km.provisioner.send_signal = spy
        try:
            await client.wait_for_ready(timeout=60)
            await km.interrupt_kernel()  # what a cell's time limit does
            await client.wait_for_ready(timeout=60)
            interrupted = list(sent)
            await km.shutdown_kernel()
        finally:
            client.stop_channels()
            if await km.is_alive():
                await km.shutdown_kernel(now=True)
        return interrupted, sent, await km.is_alive()

    interrupted, sent, alive = asyncio.run(asyncio.wait_for(lifecycle(), 120))
    assert interrupted == [signal.SIGINT], "a time limit interrupts"
    assert sent == [signal.SIGINT] and not alive, "the shutdown sent no SIGINT of its own"


def test_a_dead_kernel_and_a_raising_notebook_are_error_rows_and_a_killed_pilot_keeps_them(
        killed):
    """One pilot process (`killed`), its claims in the order they come. 01's kernel dies
    mid-cell: an error row naming the cell, and the pilot goes on to 08, which stops with an
    error (an unknown rental GPU) - recorded, what it found kept, its summary carrying it. Then
    SIGTERM while 09 starts: exit 130, and index.json, index.csv and report.html of what
    finished, the rest `interrupted`, nothing left in the temporary folder. (01's pass on
    the README's task is tests/notebooks/test_inspection.py's test_clean_samples_raise_no_flag;
    a notebook's own fail verdict is read as its pass is: 01's flags fail it in
    tests/notebooks/test_inspection.py, the zero targets of a planted max_length in
    test_truncation_leaving_no_targets_is_flagged.)"""
    proc, out, flag = killed.proc, killed.out, killed.flag
    killed.watcher.join(250)
    assert len(indexed(out)) >= 2, "01 and 08 never finished: " + killed.stderr.read_text()[-800:]
    try:
        proc.wait(120)
    finally:
        err = killed.stderr.read_text()
    assert proc.returncode == 130, err[-800:]
    assert [r["notebook"] for r in indexed(out)] == [
        "01_inspect_examples", "08_rental_plan", "09_data_parallel"]
    died, plan_row, last = indexed(out)
    assert died["verdict"] == "error" and not flag.exists()
    assert "kernel died in cell" in died["error"]
    assert "wb.inspection.run(p, out" in died["error"], "names the cell that was running"
    assert plan_row["verdict"] == "error" and "unknown GPU 'B300'" in plan_row["error"]
    plan = json.loads((out / "08_rental_plan" / "summary.json").read_text())
    assert plan["verdict"] == "error" and "unknown GPU 'B300'" in plan["error"]
    assert isinstance(plan["found"], list)
    assert last["verdict"] == "interrupted"
    table = pd.read_csv(out / "index.csv")  # the same rows (08's error spans two lines)
    assert table.notebook.tolist() == [r["notebook"] for r in indexed(out)]
    assert table.verdict.tolist() == ["error", "error", "interrupted"]
    assert (out / "report.html").exists()
    assert not list(out.glob("*.tmp"))
    # nothing left in the temporary folder: 09's kernel, interrupted while it started, ended
    # and its connection file (tmpXXXX.json) removed
    assert not list(killed.temp.iterdir())
