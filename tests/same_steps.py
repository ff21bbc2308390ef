"""Comparing the per-step metrics of two runs that must be the same run: resumed against uninterrupted, 2 processes
against 1, and so on.

Every metric must agree to rtol 1e-5, except the statistics of the sampled tokens that the engine records in float32
while sampling (entropies, and the log-probs in cov_logp_adv): two processes computing the very same generate call
may differ in their last float32 digits there, because CPU kernels choose their reduction order by memory alignment,
which differs between a process that loaded its weights from a checkpoint and one that trained them in memory.
Measured: up to 2e-5 relative. Those get rtol 1e-4; a real difference (another sample, another update) moves them by
far more.
"""

import pandas as pd

from qae_app.store import STEP_METRICS, TIMING_METRICS

SAMPLING_STATS = {"entropy", "entropy_pos", "entropy_neg", "cov_logp_adv", "dH", "dH_hard", "dH_easy"}
COMPARED = sorted(set(STEP_METRICS) - set(TIMING_METRICS))


def assert_same_metrics(want: pd.DataFrame, got: pd.DataFrame) -> None:
    """`want` and `got`: steps frames indexed by step."""
    for name in COMPARED:
        rtol, atol = (1e-4, 1e-5) if name in SAMPLING_STATS else (1e-5, 1e-6)
        pd.testing.assert_series_equal(want[name], got[name], check_names=False, rtol=rtol, atol=atol, obj=name)
