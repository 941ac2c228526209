"""Built-in sample tasks: `workbook.samples.generation:task` and
`workbook.samples.classification:task`. They use the same contract as a user's task."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "data_samples"
