"""Comparing the per-step metrics of two runs that must be the same run: resumed against uninterrupted, 2 processes
against 1, and so on; and what a killed run kept.

Every metric must agree to rtol 1e-5, except the statistics of the sampled tokens that the engine records in float32
while sampling (entropies, and the log-probs in cov_logp_adv): two processes computing the very same generate call
may differ in their last float32 digits there, because CPU kernels choose their reduction order by memory alignment,
which differs between a process that loaded its weights from a checkpoint and one that trained them in memory.
Measured: up to 2e-5 relative. Those get rtol 1e-4; a real difference (another sample, another update) moves them by
far more. The sampler-trainer mismatch metrics are differences of those float32 log-probs and the trainer's, so they
are that rounding itself (about 1e-6 nats, measured up to 1.5e-6 on CI); they get the same atol 1e-5.
"""

from pathlib import Path

import pandas as pd

from qae_app.store.reader import query, read_steps
from qae_app.store.run_folder import DB_FILE, PENDING_DIR
from qae_app.store.schema import PENDING_SUFFIX, STEP_METRICS, TIMING_METRICS, pending_write_from_json
from qae_app.train.update import MISMATCH_METRICS

SAMPLING_STATS = {
    "entropy",
    "entropy_pos",
    "entropy_neg",
    "cov_logp_adv",
    "dH",
    "dH_hard",
    "dH_easy",
    *MISMATCH_METRICS,
    *(name for name in STEP_METRICS if name.startswith("dH_") and "_from_" in name),
}
COMPARED = sorted(set(STEP_METRICS) - set(TIMING_METRICS))


def assert_same_metrics(want: pd.DataFrame, got: pd.DataFrame) -> None:
    """`want` and `got`: steps frames indexed by step."""
    for name in COMPARED:
        rtol, atol = (1e-4, 1e-5) if name in SAMPLING_STATS else (1e-5, 1e-6)
        pd.testing.assert_series_equal(want[name], got[name], check_names=False, rtol=rtol, atol=atol, obj=name)


# a rollout's statistics of its sampled tokens (the same float32 rounding as SAMPLING_STATS, per response)
ROLLOUT_SAMPLING_STATS = ("entropy", "logprob", "mismatch")


def assert_same_rollouts(want_db: Path, got_db: Path) -> None:
    """The groups and rollouts tables of two databases hold the same rows: every column exactly but the rollouts'
    sampling statistics, which get SAMPLING_STATS' tolerance (a NULL must stay a NULL)."""
    for table, order in (("groups", "step, group_idx"), ("rollouts", "step, group_idx, sample_idx")):
        sql = f"SELECT * EXCLUDE (run_id) FROM {table} ORDER BY {order}"
        want, got = query(want_db, sql), query(got_db, sql)
        inexact = [name for name in ROLLOUT_SAMPLING_STATS if table == "rollouts" and name in want.columns]
        pd.testing.assert_frame_equal(want.drop(columns=inexact), got.drop(columns=inexact), obj=table)
        for name in inexact:
            pd.testing.assert_series_equal(want[name], got[name], rtol=1e-4, atol=1e-5, obj=f"{table}.{name}")


def saved_steps(run_dir: Path) -> list[int]:
    """Steps whose rows wait under pending/ for the database (the trainer writes steps together every few seconds;
    the next writer of a killed run writes them)."""
    writes = [
        pending_write_from_json(path.read_text()) for path in sorted((run_dir / PENDING_DIR).glob(f"*{PENDING_SUFFIX}"))
    ]
    return [write.step for write in writes if write.kind == "step"]


def kept_steps(run_dir: Path) -> list[int]:
    """The steps a killed run kept: in its database or saved under pending/."""
    return sorted(set(read_steps(run_dir / DB_FILE)["step"].tolist()) | set(saved_steps(run_dir)))
