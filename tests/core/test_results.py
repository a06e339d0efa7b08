"""The "versus the baseline" cell both the experiment tables and the report print."""

from assay.core.results import versus_baseline


def test_versus_baseline_formats_mean_and_seeds_won():
    assert versus_baseline({"mean": -0.01354, "wins": 3, "of": 3}) == "-0.0135 (3/3)"
    assert versus_baseline({"mean": 0.2, "wins": 0, "of": 2}) == "+0.2000 (0/2)"


def test_versus_baseline_dash_where_absent_or_nan():
    assert versus_baseline(None) == "–"
    assert versus_baseline({"mean": None, "wins": 0, "of": 3}) == "–"
    assert versus_baseline({"mean": float("nan"), "wins": 0, "of": 3}) == "–"
