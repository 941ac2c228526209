"""A framework's scratch output (a Trainer's output_dir, Lightning's log folder) lives in a
private temporary folder that is gone when the process ends."""

import subprocess
import sys
from pathlib import Path


def test_a_scratch_folder_is_removed_when_the_process_exits():
    code = ("from workbook.storage.files import scratch_folder; from pathlib import Path; "
            "p = Path(scratch_folder('workbook-test-')); (p / 'events').write_text('x'); "
            "print(p)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    folder = Path(done.stdout.strip())
    assert folder.name.startswith("workbook-test-") and not folder.exists()
