"""Child processes: a suggested command pastes as inert words, a timed-out one is named, a
child never outlives the process that started it."""

import pytest

from workbook import WorkbookError

EVIL = "x$(touch {marker}):task"


def _pasted(line: str) -> None:
    import subprocess

    subprocess.run(["bash", "-c", f": {line}"], capture_output=True, timeout=30)


def test_a_suggested_command_is_quoted_so_pasting_it_runs_nothing(tmp_path):
    from workbook.storage.processes import command_line, workbook_command

    marker = tmp_path / "pwned"
    words = ["trial", "--study", str(tmp_path / "a study"), "--task", EVIL.format(marker=marker)]
    line = workbook_command(words)
    assert f"'{EVIL.format(marker=marker)}'" in line
    _pasted(line)
    assert not marker.exists()
    _pasted(" ".join(["python", "-m", "workbook", *words]))  # the twin, unquoted: it runs
    assert marker.exists(), "the check above would prove nothing"
    assert command_line(["a b", 3, "$HOME"]) == "'a b' 3 '$HOME'"
    # a path shown from the home folder (`runs.shown`) still runs: its ~/ stays unquoted
    assert command_line(["~/.venv/bin/python", "~/a b", "~"]) == \
        "~/.venv/bin/python ~/'a b' '~'"


def test_a_timed_out_command_names_itself_quoted(tmp_path):
    from workbook.storage.processes import fresh_process

    marker = tmp_path / "pwned"
    with pytest.raises(WorkbookError, match="did not finish within 0 s") as info:
        fresh_process(["reload", "--archive", str(tmp_path), "--task",
                       EVIL.format(marker=marker)], 0.2, "the reload")
    line = info.value.fix.split("run ", 1)[1].rsplit(" by hand", 1)[0]
    assert line.startswith("python -m workbook reload --archive ")
    _pasted(line)
    assert not marker.exists()


def test_a_child_ends_with_its_parent_but_not_with_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the *thread* that started a child ends: a child started
    from the main thread is asked to die with the process (the probes of
    tests/hostile_probes.py kill the parent), one started from another thread is not wrapped,
    so it outlives that thread and is stopped at exit or by stop_tree instead."""
    import sys
    import threading
    import time

    from workbook.storage import processes

    started = {}

    def start():
        started["proc"] = processes.start_child(
            [sys.executable, "-c", "import time; time.sleep(30)"])

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    proc = started["proc"]
    try:
        time.sleep(0.5)
        assert proc.poll() is None, "the child died with the thread that started it"
        assert proc.args[:2] == [sys.executable, "-c"] and proc in processes._CHILDREN
    finally:
        processes.stop_children()
    assert proc.poll() is not None and proc not in processes._CHILDREN, "stopped at exit"


def test_an_interrupt_stops_a_fresh_process_and_leaves_no_folder(tmp_path, monkeypatch):
    """Ctrl-C (SIGINT to this process) while a fresh process runs: KeyboardInterrupt here, the
    child stopped, the result folder removed (the mechanism under a pilot's Ctrl-C)."""
    import os
    import signal
    import tempfile
    import threading
    import time

    import psutil

    from workbook.storage.processes import fresh_result, signals_as_interrupt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the result folder lands here
    me, seen = psutil.Process(), []

    def interrupt_once_the_child_runs():
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            seen.extend(me.children(recursive=True))
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    interrupted = threading.Event()
    threading.Thread(target=interrupt_once_the_child_runs, daemon=True).start()
    with pytest.raises(KeyboardInterrupt), signals_as_interrupt(interrupted):
        fresh_result(["never-run"], 60, launcher=("-c", "import time; time.sleep(60)"))
    assert seen and interrupted.is_set()
    assert not psutil.wait_procs(seen, timeout=10)[1], "a child outlived the interrupt"
    assert not list(tmp_path.iterdir()), "the result folder was left"
