"""The memory prediction on the standard torch.nn building blocks people use (convolutions with
batch norm, LSTM, GRU, multi-head attention over embeddings): every phase within 2% of the
measured CPU peak, or a 'not predicted' row that says why - never a silent miss. (On the CPU,
convolution and LSTM kernels allocate workspace that fake tensors do not see: a real run of a
small configuration finds those phases: listed, or - a few percent off - sized from its
measured ratio with the margin said, never guessed.)"""

import pytest

import workbook as wb
from examples.module_families import FAMILIES, family_task
from workbook.notebooks.gates import GateRun, GateSettings
from workbook.training.loop import UpdateShape
from workbook.training.predict import compare, predict


@pytest.mark.parametrize("name", FAMILIES)
def test_standard_modules_are_predicted_within_two_percent_or_say_why(name, tmp_path):
    task = family_task(name)
    data = wb.prepare(task)
    settings = GateSettings(UpdateShape(4, 2), eval_batch=4, input_updates=1)
    measured = GateRun(task, settings, data.train, data.validation, tmp_path).run().table()
    check = compare(predict(task, data.train, data.validation, settings.plan()), measured)
    predicted = check[check.note == ""]
    assert (predicted.error_pct.abs() < 2).all(), check
    scaled = check[check.note.str.startswith("sized from the measured ratio")]
    # a phase a few percent off (MHA's backward at +3.8%) is sized from the real run's ratio
    # plus a 2% margin: within that margin of the measured peak, and never under it by more
    assert (scaled.error_pct.abs() < 4).all(), scaled
    for note in check.note[(check.note != "") & ~check.index.isin(scaled.index)]:
        assert note.startswith("not predicted: ") and ("fused inference kernel" in note or
                                                       "fake tensors do not see" in note)
    if name == "gru":  # GRU's kernels hide nothing: every phase is predicted
        assert len(predicted) == 5, check
