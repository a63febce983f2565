"""The learning curve: held-out success with its noise band, training success, statuses stacked."""

import math

import pytest

from agentrl.trainer.report import plot_curve

RECORDS = [
    {"iteration": 0, "success_rate": 0.25, "statuses": {"completed": 3, "max_turns": 1}},
    {"iteration": 1, "success_rate": 0.5, "statuses": {"completed": 2, "timeout": 2}, "eval_success": 0.5},
    {"iteration": 2, "success_rate": 0.75, "statuses": {"completed": 4}},
]


def test_curve_has_held_out_band_and_stacked_statuses(tmp_path, drawn):
    path = plot_curve(RECORDS, tmp_path / "curve.png", before=0.2, after=0.8, n_eval=25)
    assert path and (tmp_path / "curve.png").stat().st_size > 0
    top, bottom = drawn[0].axes
    held = next(line for line in top.get_lines() if "held-out" in line.get_label())
    # before RL at 0 updates, the mid-run evaluation after update 2, the final one after all 3
    assert list(held.get_xdata()) == [0, 2, 3]
    assert list(held.get_ydata()) == [0.2, 0.5, 0.8]
    band = top.collections[0].get_paths()[0].vertices
    at_zero = band[band[:, 0] == 0][:, 1]
    se = math.sqrt(0.2 * 0.8 / 25)
    assert min(at_zero) == pytest.approx(0.2 - se) and max(at_zero) == pytest.approx(0.2 + se)
    heights = {}
    for bar in bottom.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        heights[x] = heights.get(x, 0) + bar.get_height()
    assert heights == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0})
    labels = {text.get_text() for text in bottom.get_legend().get_texts()}
    assert labels == {"completed", "max_turns", "timeout"}


def test_curve_without_task_count_or_records(tmp_path, drawn):
    assert plot_curve([], tmp_path / "empty.png", before=0.0, after=0.0)
    top, _ = drawn[0].axes
    assert not top.collections  # no band without the number of held-out tasks
