"""The dashboard's Compare page (AppTest) on real DuckDB run files written through `store.RunWriter` with known values:
a sweep of 2 estimators x 3 seeds and runs outside it. The table's intervals and paired differences, the curves'
bands and the URL's choices are checked against hand computations; the curve aggregation on its own too."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from test_dashboard import charts

T_975_2 = 4.3026527  # Student t, 97.5% quantile, 2 degrees of freedom (table value)


# ---------------------------------------------------------------------------------------------------------------
# the curve aggregation


def test_across_seeds_by_hand():
    curves = [pd.DataFrame({"step": [0, 1, 2], "value": [0.2, 0.8, 1.0]}),
              pd.DataFrame({"step": [0, 1, 2], "value": [0.2, 0.9, None]}),  # no value at step 2
              pd.DataFrame({"step": [0, 1], "value": [0.2, 1.0]})]
    out = charts.across_seeds(curves).set_index("step")
    assert out["n"].tolist() == [3, 3, 1]
    assert out["mean"].tolist() == pytest.approx([0.2, 0.9, 1.0])
    # step 1: 0.8, 0.9, 1.0 -> sd 0.1, half-width t_{0.975,2} * 0.1 / sqrt(3); step 0: no spread; step 2: one run
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert out.loc[1, "low"] == pytest.approx(0.9 - half, abs=1e-6)
    assert out.loc[1, "high"] == pytest.approx(0.9 + half, abs=1e-6)
    assert out.loc[0, "low"] == pytest.approx(0.2) and out.loc[0, "high"] == pytest.approx(0.2)
    assert math.isnan(out.loc[2, "low"]) and math.isnan(out.loc[2, "high"])
    spread = charts.across_seeds(curves, "min-max").set_index("step")
    assert spread.loc[1, ["low", "high"]].tolist() == pytest.approx([0.8, 1.0])
    assert math.isnan(spread.loc[2, "low"])
    # two runs: t_{0.975,1} = 12.706: values 1 and 2 give 1.5 +- 12.706 * 0.7071 / 1.4142
    two = charts.across_seeds([pd.DataFrame({"step": [5], "value": [1.0]}), pd.DataFrame({"step": [5],
                                                                                           "value": [2.0]})])
    assert two["low"].iloc[0] == pytest.approx(1.5 - 12.7062047 * 0.5, abs=1e-6)
    assert charts.across_seeds([]).empty
    with pytest.raises(ValueError, match="band"):
        charts.across_seeds(curves, "sd")
