"""Built-in sample tasks: `workbook.samples.generation:task` and
`workbook.samples.classification:task`. They use the same contract as a user's task, and
what only they need: the byte `tokenizer` and `ghost_batch_norm` (both public as
`wb.tokenizer`, `wb.ghost_batch_norm`)."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "data_samples"
