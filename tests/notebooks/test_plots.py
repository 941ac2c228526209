"""The notebooks' figures as a person reads them: a diverged tail marked, never setting the
scale of the curve it ends."""

import math

import pandas as pd
import pytest

from workbook.notebooks import plots

# a range test as a smoke pilot of the generation sample swept it (06, 20 updates): flat, a
# fall, then the loss leaves: 13.5, 11.8, 261 and one not finite
LOSSES = [5.73, 5.77, 5.66, 5.52, 5.60, 5.67, 5.65, 5.79, 5.66, 5.61, 5.79, 5.62, 5.15, 4.68,
          4.41, 3.56, 6.11, 13.48, 11.82, 260.9, math.nan]


def sweep(losses: list[float]) -> pd.DataFrame:
    smoothed, avg = [], 0.0
    for n, loss in enumerate(losses, 1):
        avg = 0.9 * avg + 0.1 * loss
        smoothed.append(avg / (1 - 0.9**n))
    return pd.DataFrame({"update": range(1, len(losses) + 1),
                         "lr": [1e-7 * 2.6**i for i in range(len(losses))],
                         "loss": losses, "smoothed": smoothed})


def off_scale(ax) -> int:
    marks = [line for line in ax.lines if line.get_label().startswith("loss off the scale")]
    return len(marks[0].get_xdata()) if marks else 0


@pytest.mark.planted
def test_a_diverged_tail_is_marked_and_a_loss_axis_stays_above_zero():
    ax = plots.range_test(sweep(LOSSES), 0.078, [0.026, 0.0087, 0.078]).axes[0]
    bottom, top = ax.get_ylim()
    assert 0 <= bottom <= 3.56 and 5.8 < top < 10, (bottom, top)
    assert off_scale(ax) == 4, "13.5, 11.8, 261 and the non-finite loss sit on the top edge"


@pytest.mark.twin
def test_a_loss_below_zero_is_shown_whole_and_a_calm_curve_has_no_marks():
    negative = [-1.0 - 0.1 * i for i in range(20)]  # minus a reward that rises
    ax = plots.range_test(sweep(negative), None, [1e-3]).axes[0]
    bottom, top = ax.get_ylim()
    assert bottom < min(negative) and top > max(sweep(negative).smoothed), (bottom, top)
    assert off_scale(ax) == 0
