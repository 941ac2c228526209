"""Ctrl-C to a pilot's process group while 07's fresh `workbook reload` runs: the run stops,
says it was interrupted, exits 130 and leaves no process and no temporary folder (before, the
kernel was ended before its cell's cleanup ran: the result folder stayed behind)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


@pytest.mark.slow  # 07 reaches its reload after about 2 minutes at smoke size on 2 cores
def test_ctrl_c_while_07s_child_runs_stops_the_pilot_and_leaves_nothing(tmp_path):
    out, temp = tmp_path / "run", tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONFAULTHANDLER": "1"}  # a hang's stacks: see _hang_report
    proc = subprocess.Popen([sys.executable, "-m", "workbook", "pilot", "--only", "07",
                             "--smoke", "--out", str(out)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pilot, tree = psutil.Process(proc.pid), []
    try:
        deadline = time.monotonic() + 400
        while not tree and proc.poll() is None and time.monotonic() < deadline:
            with_child = pilot.children(recursive=True)
            if any("reload" in _cmdline(p) and "workbook" in _cmdline(p) for p in with_child):
                tree = with_child
            time.sleep(0.1)
        assert tree, "07 never started its reload"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the foreground group
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the pilot ran on 120 s after Ctrl-C:\n{_hang_report(proc, out)}")
    finally:
        proc.kill()
    assert proc.returncode == 130, (stdout[-500:], stderr[-500:])
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr[-500:]
    assert not psutil.wait_procs(tree, timeout=20)[1], "a process outlived the pilot"
    left = [p.name for p in temp.iterdir() if p.name.startswith("workbook")]  # not torch's cache
    assert not left, f"a temporary folder was left: {left}"
    assert not list(out.rglob(".*partial*"))
    assert '"interrupted"' in (out / "index.json").read_text()


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _hang_report(proc: subprocess.Popen, out: Path) -> str:
    """What a hang leaves to read (a flake under load was seen once): each process still there
    with each thread's kernel wait, then the Python stacks faulthandler writes on SIGABRT (the
    pilot's to its stderr, its kernel's and its forked workers' to kernels.log; a fresh
    process's goes to the kernel's pipe, so only its thread waits are shown)."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    lines = []
    for p in tree:
        with contextlib.suppress(psutil.Error, OSError):
            waits = [Path(f"/proc/{p.pid}/task/{t}/wchan").read_text()
                     for t in sorted(os.listdir(f"/proc/{p.pid}/task"))]
            lines.append(f"pid {p.pid} parent {p.ppid()} {p.status()} {_cmdline(p)[:5]} "
                         f"thread waits {waits}")
    for p in reversed(tree):  # children first; no core file left behind
        with contextlib.suppress(psutil.Error, OSError):
            p.rlimit(psutil.RLIMIT_CORE, (0, 0))
            p.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        lines.append("pilot's stderr:\n" + proc.communicate(timeout=20)[1][-6000:])
    with contextlib.suppress(OSError):
        lines.append("kernels.log:\n" + (out / "kernels.log").read_text(errors="replace")[-12000:])
    return "\n".join(lines)
