"""The registry's picture: τ and simulated acceptance across versions, points missing where a version
has no figure, the current version starred."""

from __future__ import annotations

from pictures import colour_pixels

from tasks.common.plots import ESTIMATED, MEASURED, acceptance_across_versions


def test_each_series_is_drawn_where_it_has_figures(tmp_path):
    both = acceptance_across_versions([1, 2, 3], [2.0, None, 2.2], [1.9, 2.1, None], 2, tmp_path / "both.png")
    simulated_only = acceptance_across_versions([1, 2], [None, None], [1.9, 2.1], 2, tmp_path / "simulated.png")
    assert colour_pixels(both, MEASURED) > 100 and colour_pixels(both, ESTIMATED) > 500  # two dots; a line
    assert colour_pixels(simulated_only, MEASURED) == 0 and colour_pixels(simulated_only, ESTIMATED) > 500
    assert not list(tmp_path.glob(".tmp-*"))
