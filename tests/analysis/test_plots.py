"""The figures draw what they are given: the bench's figure as a PNG, without a display."""
import matplotlib
import numpy as np
import pytest

from specjax.analysis import alpha, plots, predicted_al

matplotlib.use("Agg")


def test_the_bench_figure_is_a_png_with_one_line_and_two_bars_per_method(tmp_path):
    rows = [dict(label="ngram D=4", ar=[0.7, 0.5, 0.3, 0.2], speedup=1.3, decode_speedup=1.5),
            dict(label="eagle3 D=4", ar=[0.8, 0.6, 0.4, 0.3], speedup=1.6, decode_speedup=1.9)]
    fig = plots.spec_figure(rows, "title")
    left, right = fig.axes
    assert [line.get_label() for line in left.get_lines()] == ["ngram D=4", "eagle3 D=4"]
    assert left.get_lines()[1].get_ydata().tolist() == [0.8, 0.6, 0.4, 0.3]
    assert sorted(round(b.get_width(), 2) for b in right.patches) == [1.3, 1.5, 1.6, 1.9]
    fig.savefig(tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_al_vs_depth_draws_the_measured_points_and_the_formula():
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ar = [0.8, 0.6, 0.45, 0.3]
    plots.plot_al_vs_depth(ax, [1, 2, 4], [1.8, 2.4, 3.1], ar)
    measured, formula, cut = ax.get_lines()
    assert measured.get_ydata().tolist() == [1.8, 2.4, 3.1]
    assert formula.get_ydata() == pytest.approx(predicted_al(alpha(ar), np.array([1, 2, 4])))
    assert cut.get_ydata() == pytest.approx([1.8, 2.4, 3.15])
    plt.close(fig)
