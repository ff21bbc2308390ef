"""Statistics for comparing runs across seeds: what `qae compare` and the dashboard's Compare page print.

A single run is one draw: two runs that differ by 0.02 in held-out accuracy say nothing until the seed-to-seed spread
is known. So runs are grouped by their config without the seed, each metric is reduced to one number per run, and a
group reports the mean over its runs with a 95% Student-t interval. Against a baseline group, runs are paired by seed
(the same seed gives both runs the same prompt order and the same start of the sampling stream), and the paired
difference gets its own interval and a two-sided paired t-test p-value.

Per-run metrics are defined once, in `RUN_METRICS`; each is computed from the run's `steps` frame (columns as
`schema.STEP_METRICS`, one row per step).

"The last 20% of steps" are the last ceil(0.2 n) of the n rows with a value (at least 2 when there are 2, so a slope
exists). Held-out rows are the rows whose `heldout_accuracy` is not null; with a single one the area is its value. A
caller that has the step-0 evaluation (in the `evals` table) adds it as a row with step 0, so the curve starts where
training did. A run without a value for a metric is left out of that metric's mean (its `n` says so).

Student-t quantiles and the CDF are computed here (regularized incomplete beta by Lentz's continued fraction, as in
Numerical Recipes 6.4) because scipy is not a dependency; tests hold them to table values to 1e-6.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from qae_app.analysis.differences import reads_k
from qae_app.analysis.settings import checked_settings
from qae_app.core import policy_losses
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import missing
from qae_app.store.labels import read_labels
from qae_app.store.reader import component_table, query, read_component_means, read_run, read_steps
from qae_app.store.run_folder import DB_FILE, list_run_dirs, read_run_file, recent_runs_text, validated_run_dir

# ---------------------------------------------------------------------------------------------------------------
# Which config keys make two runs "the same setup"

# Left out of the group key: they name, replicate or watch a run without changing what it trains or what its
# held-out accuracy measures.
IGNORED_CONFIG_KEYS: dict[str, str] = {
    "seed": "the replicate: runs differing only in seed form one group, and pairs are matched on it",
    "run_name": "an id",
    "checkpoint_every": "disk bookkeeping",
    "keep_checkpoints": "disk bookkeeping",
    "entropy_low": "only the threshold of a warning",
    "entropy_high": "only the threshold of a warning",
    "eval_every": "how often held-out accuracy is sampled, not what is trained (the curve is coarser or finer)",
    "eval_limit": "how many held-out problems are sampled (precision of each point, not the policy)",
    "eval_k": "samples per held-out problem (precision of each point, not the policy)",
    "verify_timeout_s": "a safety deadline for the math verifier; it changes a reward only when a verifier hangs",
    "sweep_id": "a label (qae sweep)",
    "sweep_name": "a label (qae sweep)",
    "store_responses": "how much response text the store keeps, not what is trained",
    "store_tokens": "which responses' per-token values the store keeps, not what is trained",
    "alerts": "only the levels of warnings",
    "primary_reward": "which reward the reward_signal alert calls the task: a warning, not what is trained",
    "distributed": "how it was launched (processes, sharding): DDP and FSDP2 make the same update",
    "vllm_sleep": "where vLLM's memory is during the update: the same samples and the same update",
    "vllm_gpu_memory": "how much of the GPU vLLM takes: memory, not what is trained",
    "report_to": "where the metrics are also sent (TensorBoard, MLflow, ...), not what is trained",
    "reward_files": "where the reward code lives and its sha256: `reward` names the rewards",
}
# Options added after runs were stored: a run without the key trained as with this value, so the value counts as absent
SAME_AS_ABSENT = {"reward": None, "reward_weights": None, **policy_losses.AS_BEFORE_THE_OPTIONS}
# Options only QAE reads: a mean-baseline run (grpo, rloo, ...) with another K is the same setup.
QAE_ONLY_KEYS = ("k", "quantile")


def group_key(config: dict) -> tuple:
    """The config without ignored keys (and without K and quantile for a mean-baseline estimator), hashable."""
    drop = set(IGNORED_CONFIG_KEYS)
    if not reads_k(config):
        drop.update(QAE_ONLY_KEYS)
    return tuple(
        sorted(
            (key, _hashable(value))
            for key, value in config.items()
            if key not in drop and not (key in SAME_AS_ABSENT and value == SAME_AS_ABSENT[key])
        )
    )


# `--group-by tags` (and the Training curves page's "Group by" tags): the runs' `qae tag` tags as a grouping key, one
# value per run: its set of tags
TAGS_KEY = "tags"
NO_TAGS = "(none)"


def tags_value(tags: list[str]) -> str:
    """A run's tags as one grouping value: sorted and joined by '+' ('baseline+paper'), NO_TAGS without any."""
    return "+".join(sorted(tags)) or NO_TAGS


def picked_key(config: dict, tags: list[str], by: list[str]) -> tuple:
    """The values of the keys picked to group by (`tags`: the run's tags; a key the config lacks: '-'), hashable."""
    return tuple((key, _hashable(tags_value(tags) if key == TAGS_KEY else config.get(key, "-"))) for key in by)


def check_group_by(configs: list[dict], by: list[str]) -> None:
    known = {TAGS_KEY} | {key for config in configs for key in config}
    for key in by:
        if key not in known:
            raise QAEUserError(
                f"group-by: '{key}' is neither {TAGS_KEY} nor a config key of these runs. Use "
                f"{TAGS_KEY} (the runs' `qae tag` tags) or config keys, e.g. {TAGS_KEY} or "
                "estimator,k (`qae show RUN` lists a run's config)."
            )


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


# ---------------------------------------------------------------------------------------------------------------
# Student t: CDF and quantiles without scipy


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), Numerical Recipes 6.4."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))  # even step
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))  # odd step
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge for a={a}, b={b}, x={x}")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x = {x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast here; use the symmetry I_x(a,b) = 1 - I_1-x(b,a)
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df = {df}; Student's t needs df > 0")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def student_t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|): the two-sided p-value of a t statistic."""
    if math.isinf(t):
        return 0.0
    return regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def student_t_ppf(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on the CDF, to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p = {p} is outside (0, 1)")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_ppf(1.0 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        low, high = high, high * 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if student_t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


# ---------------------------------------------------------------------------------------------------------------
# Estimates across seeds

CONFIDENCE = 0.95
# Fewer seeds (or paired seeds) than this: no interval and no p-value is printed, by `qae compare` and the Compare
# page alike (`shown`). From 2 seeds a 95% t-interval spans +-12.7 standard errors, wider than most metrics can take.
MIN_SEEDS = 3
FEW_SEEDS = 5  # below this a 95% t-interval is wide (t_{0.975, 3} = 3.18 vs 1.96 for many seeds)


def sample_size_note(n: int) -> str | None:
    """What to tell the reader about n seeds: nothing from 5 on."""
    if n == 0:
        return (
            "n=0: nothing to estimate from (for a difference: no seed shared with the baseline; for a held-out "
            "metric: no evaluation)"
        )
    if n < 2:
        return f"n={n}: one seed, no interval; run more seeds (--seeds 3 or more) to tell a difference from noise"
    if n < MIN_SEEDS:
        return (
            f"n={n}: no interval (from 2 seeds a 95% t-interval spans +-{student_t_ppf(0.975, 1):.1f} standard "
            f"errors, wider than the metric can take); run {MIN_SEEDS} or more seeds"
        )
    if n < FEW_SEEDS:
        return f"n={n}: few seeds, the 95% interval is wide (t quantile {student_t_ppf(0.975, n - 1):.2f})"
    return None


@dataclass
class Estimate:
    """Mean of per-run values with a 95% Student-t interval; `low`/`high` are None when n < 2."""

    mean: float | None
    low: float | None
    high: float | None
    sd: float | None  # sample standard deviation (n - 1)
    n: int
    note: str | None = None


Bounds = tuple[float | None, float | None]  # the values a metric can take: (lowest, highest), None if open
UNBOUNDED: Bounds = (None, None)


def clip(value: float, bounds: Bounds) -> float:
    low, high = bounds
    if low is not None:
        value = max(value, low)
    return min(value, high) if high is not None else value


def mean_interval(values: list[float], bounds: Bounds = UNBOUNDED) -> Estimate:
    """Mean and 95% t-interval of the non-NaN values (runs without the metric are left out, and n says so), the
    interval cut at `bounds`, what the metric can take (a fraction's interval never leaves [0, 1])."""
    xs = [float(v) for v in values if not missing(v)]
    n = len(xs)
    if n == 0:
        return Estimate(None, None, None, None, 0, sample_size_note(0))
    mean = sum(xs) / n
    if n < 2:
        return Estimate(mean, None, None, None, 1, sample_size_note(1))
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = student_t_ppf(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n)
    return Estimate(mean, clip(mean - half, bounds), clip(mean + half, bounds), sd, n, sample_size_note(n))


def interval_missing(estimate: Estimate) -> str | None:
    """Why an estimate is shown without an interval, in a few words ('n=2: no interval'), or None when it has one
    worth reading. Fewer than `MIN_SEEDS` seeds give none (two give a t-interval of +-12.7 standard errors); seeds
    that tie give one of zero width, which would read as certainty."""
    if estimate.mean is None:
        return None
    if estimate.n < MIN_SEEDS:
        return f"n={estimate.n}: no interval"
    if estimate.sd == 0:
        return f"all {estimate.n} seeds tied: no spread to measure"
    return None


@dataclass(frozen=True)
class Shown:
    """What `qae compare` and the Compare page print of one estimate: both format this, so they print the same."""

    mean: float | None  # None: no value ('-')
    interval: tuple[float, float] | None  # (low, high), only from MIN_SEEDS seeds on and with a spread
    no_interval: str | None  # why there is none ('n=2: no interval'); None with an interval, or with one seed
    p_value: float | None  # a paired difference's two-sided p, only where its interval is shown


def shown(estimate: Estimate | None) -> Shown:
    """The one rule for printing an estimate or a paired difference: its mean; its interval and (for a difference)
    its p-value from `MIN_SEEDS` seeds on, else why not (`interval_missing`). With one seed the mean alone: the
    group's note says why."""
    if estimate is None or estimate.mean is None:
        return Shown(None, None, None, None)
    why = interval_missing(estimate)
    if why is not None:
        return Shown(estimate.mean, None, why if estimate.n >= 2 else None, None)
    return Shown(estimate.mean, (estimate.low, estimate.high), None, getattr(estimate, "p_value", None))


def estimate_json(estimate: Estimate) -> dict:
    """An estimate as `qae compare --json` prints it, under the same rule as the tables (`shown`): below
    `MIN_SEEDS` seeds, or with no spread, `low`, `high` and `p_value` are null and `no_interval` says why."""
    out = asdict(estimate)
    rule = shown(estimate)
    if rule.interval is None:
        out.update(low=None, high=None, **({"p_value": None} if "p_value" in out else {}))
    out["no_interval"] = rule.no_interval
    return out


@dataclass
class PairedDifference(Estimate):
    """Mean of (group - baseline) over seeds both have, its 95% interval, and the two-sided paired t-test p."""

    p_value: float | None = None
    seeds: list[int] = field(default_factory=list)  # the seeds paired
    pairs: list[tuple[int, str, str]] = field(default_factory=list)  # (seed, run, baseline run) for each pair


def paired_difference(
    values: dict[int, float], baseline: dict[int, float], bounds: Bounds = UNBOUNDED
) -> PairedDifference:
    """`values` and `baseline` map seed -> one run's metric (which takes values in `bounds`); only seeds present
    (and not NaN) in both are paired."""
    seeds = sorted(s for s in values.keys() & baseline.keys() if not missing(values[s]) and not missing(baseline[s]))
    diffs = [values[s] - baseline[s] for s in seeds]
    low, high = bounds
    spread = high - low if low is not None and high is not None else None  # a difference lies in [-spread, spread]
    base = mean_interval(diffs, (-spread, spread) if spread is not None else UNBOUNDED)
    p = None
    if base.n >= 2:
        if base.sd == 0:
            p = 1.0 if base.mean == 0 else 0.0  # every pair differs by the same amount: t is 0 or infinite
        else:
            p = student_t_two_sided_p(base.mean / (base.sd / math.sqrt(base.n)), base.n - 1)
    return PairedDifference(**asdict(base), p_value=p, seeds=seeds)


# ---------------------------------------------------------------------------------------------------------------
# Per-run metrics

LAST_FRACTION = 0.2

RUN_METRICS: dict[str, str] = {
    "final_heldout": "held-out accuracy at the last step that has one",
    "best_heldout": "highest held-out accuracy over the run",
    "auc_heldout": "area under the held-out curve (trapezoid over step) / step span: a mean accuracy",
    "entropy_last": "mean token entropy over the last 20% of steps",
    "entropy_slope": "least-squares slope of entropy against step over the last 20% of steps (nats per step)",
    "entropy_range": "highest minus lowest step entropy over the run (nats): how far entropy moved",
    "zero_adv": "mean fraction of zero-advantage (gated) responses over all steps",
    "zero_adv_last": "mean fraction of zero-advantage (gated) responses over the last 20% of steps",
    "dH_easy": "mean over steps of the whole update's entropy change on easy groups' responses (needs "
    "--log-entropy-delta; every group's gradient moves them: not which regime caused it)",
    "dH_hard": "mean over steps of the whole update's entropy change on hard groups' responses (needs "
    "--log-entropy-delta; as dH_easy)",
    "dH_from_easy": "mean over steps of the entropy change of all responses caused by the easy groups' update alone "
    "(needs --log-entropy-attribution; QAE: Prop. 4.2 predicts above dH_from_none)",
    "dH_from_hard": "mean over steps of the entropy change of all responses caused by the hard groups' update alone "
    "(needs --log-entropy-attribution; QAE: Prop. 4.2 predicts below dH_from_none)",
    "dH_from_none": "mean over steps of the entropy change of AdamW's drift alone (every advantage 0; needs "
    "--log-entropy-attribution): part of both regimes' updates",
    "step_s": "mean wall seconds per step",
}
FRACTION: Bounds = (0.0, 1.0)
NON_NEGATIVE: Bounds = (0.0, None)
# the values each run metric can take: its interval is cut there
RUN_METRIC_BOUNDS: dict[str, Bounds] = {
    "final_heldout": FRACTION,
    "best_heldout": FRACTION,
    "auc_heldout": FRACTION,
    "entropy_last": NON_NEGATIVE,
    "entropy_slope": UNBOUNDED,
    "entropy_range": NON_NEGATIVE,
    "zero_adv": FRACTION,
    "zero_adv_last": FRACTION,
    "dH_easy": UNBOUNDED,
    "dH_hard": UNBOUNDED,
    "dH_from_easy": UNBOUNDED,
    "dH_from_hard": UNBOUNDED,
    "dH_from_none": UNBOUNDED,
    "step_s": NON_NEGATIVE,
}
assert set(RUN_METRIC_BOUNDS) == set(RUN_METRICS)
COMPONENT_PREFIX = "reward:"  # a reward component's per-step mean in a run's steps frame: `reward:<name>` (load_run)


def component_metrics(runs: list[RunRecord]) -> dict[str, str]:
    """The run metric of each reward component the runs have (runs given --reward): its mean over the last 20% of
    steps, named as its column, `reward:<name>`."""
    found = sorted({c for run in runs for c in run.steps.columns if str(c).startswith(COMPONENT_PREFIX)})
    return {
        name: f"the reward component {name.removeprefix(COMPONENT_PREFIX)}: its mean per response over the last "
        "20% of steps"
        for name in found
    }


def _series(steps: pd.DataFrame, column: str) -> pd.DataFrame:
    """(step, value) rows where `column` has a value, in step order."""
    if column not in steps.columns:
        return pd.DataFrame({"step": [], "value": []})
    rows = steps[["step", column]].rename(columns={column: "value"}).dropna()
    return rows.sort_values("step").reset_index(drop=True)


def _last_fraction(rows: pd.DataFrame) -> pd.DataFrame:
    n = len(rows)
    keep = min(n, max(2, math.ceil(LAST_FRACTION * n)))
    return rows.iloc[n - keep :]


def area_under_curve(steps: list[float], values: list[float]) -> float:
    """Trapezoid area over the step span divided by the span: the curve's mean. One point: its value."""
    if not steps:
        return math.nan
    if len(steps) == 1 or steps[-1] == steps[0]:
        return float(values[-1])
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(steps) - 1))
    return area / (steps[-1] - steps[0])


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through (x, y); NaN with fewer than 2 distinct x."""
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def run_metrics(steps: pd.DataFrame) -> dict[str, float]:
    """Every `RUN_METRICS` value of one run (NaN where the run has no data for it)."""
    heldout = _series(steps, "heldout_accuracy")
    every_entropy = _series(steps, "entropy")["value"]
    entropy = _last_fraction(_series(steps, "entropy"))
    zero_adv = _series(steps, "frac_zero_adv")
    step_s = _series(steps, "step_s")
    delta = {
        name: _series(steps, name) for name in ("dH_easy", "dH_hard", "dH_from_easy", "dH_from_hard", "dH_from_none")
    }
    nan = math.nan
    return {
        "final_heldout": float(heldout["value"].iloc[-1]) if len(heldout) else nan,
        "best_heldout": float(heldout["value"].max()) if len(heldout) else nan,
        "auc_heldout": area_under_curve(heldout["step"].tolist(), heldout["value"].tolist()),
        "entropy_last": float(entropy["value"].mean()) if len(entropy) else nan,
        "entropy_slope": least_squares_slope(entropy["step"].tolist(), entropy["value"].tolist()),
        "entropy_range": float(every_entropy.max() - every_entropy.min()) if len(every_entropy) else nan,
        "zero_adv": float(zero_adv["value"].mean()) if len(zero_adv) else nan,
        "zero_adv_last": float(_last_fraction(zero_adv)["value"].mean()) if len(zero_adv) else nan,
        **{name: float(rows["value"].mean()) if len(rows) else nan for name, rows in delta.items()},
        "step_s": float(step_s["value"].mean()) if len(step_s) else nan,
        **{
            name: float(rows["value"].mean()) if len(rows) else nan
            for name, rows in (
                (name, _last_fraction(_series(steps, name)))
                for name in steps.columns
                if str(name).startswith(COMPONENT_PREFIX)
            )
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# Groups


@dataclass
class RunRecord:
    run_id: str
    config: dict  # the run's TrainConfig as stored (runs.config)
    seed: int
    steps: pd.DataFrame  # the run's steps table: step, heldout_accuracy, entropy, frac_zero_adv, step_s, ...
    status: str = "finished"  # as `qae runs` shows it: a group with unfinished runs says so
    stored_run_id: str | None = None  # the id in its database: another folder's name for a copied (`cp -r`) run
    tags: list[str] = field(default_factory=list)  # `qae tag`: a grouping key with --group-by tags

    @property
    def copy_of(self) -> str | None:
        """The run this folder was copied or renamed from (the id its database holds), None for an original."""
        return self.stored_run_id if self.stored_run_id not in (None, self.run_id) else None


@dataclass
class RunGroup:
    label: str  # the keys that differ between the compared groups, e.g. "estimator=qae, k=0.4"; "all" if none
    config: dict  # the shared config (group key as a dict)
    runs: list[RunRecord]  # one per seed: n is the number of distinct seeds
    metrics: dict[str, Estimate] = field(default_factory=dict)  # RUN_METRICS name -> across-seed estimate
    per_run: dict[str, dict[int, float]] = field(default_factory=dict)  # name -> seed -> value
    excluded: dict[str, str] = field(default_factory=dict)  # run id -> why it is not counted (a copy, a seed again)

    @property
    def seeds(self) -> list[int]:
        return sorted(r.seed for r in self.runs)

    def run_of_seed(self) -> dict[int, str]:
        """seed -> the run counted (and paired) for it."""
        return {run.seed: run.run_id for run in self.runs}

    def note(self) -> str | None:
        notes = [
            f"not counted: {', '.join(f'{run_id} ({why})' for run_id, why in self.excluded.items())}"
            if self.excluded
            else None,
            sample_size_note(len(self.runs)),
        ]
        return "; ".join(note for note in notes if note) or None

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "config": self.config,
            "n": len(self.runs),
            "seeds": self.seeds,
            "runs": [r.run_id for r in self.runs],
            "statuses": {r.run_id: r.status for r in self.runs},
            "excluded": self.excluded,
            "note": self.note(),
            "metrics": {name: estimate_json(e) for name, e in self.metrics.items()},
        }


def one_run_per_seed(runs: list[RunRecord]) -> tuple[list[RunRecord], dict[str, str]]:
    """The runs to count, one per seed, and why each other run is not counted. Two runs of one config and seed are
    one draw, not two (the seed fixes the prompts and the sampling stream): a `cp -r` backup of a run would otherwise
    double its seed and shrink the interval on identical data. Kept for a seed: the original (its folder is the id
    its database holds) over a copy, then the first given; a copy named alone is counted, as it was picked."""
    kept: dict[int, RunRecord] = {}
    for run in sorted(runs, key=lambda run: run.copy_of is not None):  # (stable: originals first, else as given)
        kept.setdefault(run.seed, run)
    excluded = {}
    for run in runs:
        counted = kept[run.seed]
        if counted is run:
            continue
        if run.copy_of is not None and run.copy_of in (counted.run_id, counted.stored_run_id):
            excluded[run.run_id] = f"a copy of {counted.run_id}, seed {run.seed}: counted once"
        else:
            excluded[run.run_id] = f"seed {run.seed} again: {counted.run_id} is counted for it"
    return [run for run in runs if kept[run.seed] is run], excluded


def label_value(config: dict, name: str) -> object:
    """A key's value as a group's label shows it: a key `group_key` dropped as its absent value says that value (a
    clip run says policy_loss=clip), and an absent or unset one '-' (kl_cov has no clip_low), never Python's None."""
    value = config.get(name, SAME_AS_ABSENT.get(name))
    return "-" if value is None else value


def group_runs(runs: list[RunRecord], by: list[str] | None = None) -> list[RunGroup]:
    """Runs grouped by `group_key` (or by the values of the keys in `by`: config keys and `tags`), in the order each
    group's first run appears; each group summarised on every RUN_METRICS metric and every reward component any of
    the runs has."""
    metrics = {**RUN_METRICS, **component_metrics(runs)}
    by_key: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        by_key.setdefault(picked_key(run.config, run.tags, by) if by else group_key(run.config), []).append(run)
    keys = list(by_key)
    # a key names the groups when they disagree on it; a mean-baseline group has no K by design, which does not
    # count as disagreeing (a K that is absent for any other reason, e.g. an older config, does)
    values: dict[str, set] = {}
    for key in keys:
        config = dict(key)
        for name in {name for k in keys for name, _ in k}:
            if name in config or not (name in QAE_ONLY_KEYS and not reads_k(config)):
                values.setdefault(name, set()).add(config.get(name, "<unset>"))
    varying = sorted(name for name, seen in values.items() if len(seen) > 1)
    varying.sort(key=lambda name: name != "estimator")  # the estimator first: "estimator=qae, k=0.4"
    groups = []
    for key in keys:
        config = dict(key)
        label = (
            ", ".join(
                f"{name}={label_value(config, name)}" for name in varying if name in config or name not in QAE_ONLY_KEYS
            )
            or "all"
        )
        counted, excluded = one_run_per_seed(by_key[key])
        group = RunGroup(label=label, config=config, runs=counted, excluded=excluded)
        per_run_rows = [(run.seed, run_metrics(run.steps)) for run in group.runs]
        for name in metrics:
            values = [row.get(name, math.nan) for _, row in per_run_rows]
            group.metrics[name] = mean_interval(values, RUN_METRIC_BOUNDS.get(name, UNBOUNDED))
            group.per_run[name] = {seed: row.get(name, math.nan) for seed, row in per_run_rows}
        groups.append(group)
    return groups


def find_group(groups: list[RunGroup], name: str) -> RunGroup:
    """The group whose label is `name`, or the only one with `name` as the value of a varying key ('grpo')."""
    exact = [g for g in groups if g.label == name]
    if exact:
        return exact[0]
    matches = [g for g in groups if any(part.split("=", 1)[-1] == name for part in g.label.split(", "))]
    if len(matches) == 1:
        return matches[0]
    labels = "; ".join(g.label for g in groups)
    why = "matches several groups" if matches else "matches no group"
    raise QAEUserError(f"baseline: '{name}' {why}. Pass a group's label or a value only it has: {labels}.")


def compare_to_baseline(groups: list[RunGroup], baseline: RunGroup) -> dict[str, dict[str, PairedDifference]]:
    """label -> metric -> paired difference (group - baseline) over the seeds both groups ran."""
    differences = {}
    for group in groups:
        if group is baseline:
            continue
        differences[group.label] = {}
        runs, base_runs = group.run_of_seed(), baseline.run_of_seed()
        for name in group.metrics:
            difference = paired_difference(
                group.per_run[name], baseline.per_run[name], RUN_METRIC_BOUNDS.get(name, UNBOUNDED)
            )
            difference.pairs = [(seed, runs[seed], base_runs[seed]) for seed in difference.seeds]
            differences[group.label][name] = difference
    return differences


# ---------------------------------------------------------------------------------------------------------------
# Runs from the runs dir, and the whole comparison


def in_sweep(config: dict, sweep: str) -> bool:
    """Whether a run's config marks it as a point of the sweep with this id or name."""
    return sweep in (config.get("sweep_id"), config.get("sweep_name"))


def load_run(runs_dir: Path, run_id: str) -> RunRecord:
    """A stored run as a RunRecord: its config, seed and steps, with the step-0 held-out evaluation (from `evals`)
    added as a step-0 row so curves start where training did."""
    path = validated_run_dir(runs_dir, run_id) / DB_FILE
    if not path.exists():
        raise QAEUserError(
            f"run: no run '{run_id}' in {runs_dir} (runs there, last written first: "
            f"{recent_runs_text(runs_dir)}). See `qae runs`."
        )
    row = read_run(path)
    config = checked_settings(row, path)
    steps = read_steps(path)
    components = component_table(read_component_means(path))  # (a run given --reward: each component's mean)
    if len(components.columns) > 1:
        steps = steps.merge(components, on="step", how="left")
    start = query(
        path,
        "SELECT value FROM evals WHERE step = 0 AND metric = 'avg@k' AND subset = 'all' AND source = 'train' LIMIT 1",
    )
    if len(start) and (steps.empty or 0 not in set(steps["step"])):
        steps = pd.concat(
            [pd.DataFrame({"step": [0], "heldout_accuracy": [float(start["value"].iloc[0])]}), steps], ignore_index=True
        )
    return RunRecord(
        run_id=run_id,
        config=config,
        seed=int(config.get("seed", row.get("seed") or 0)),
        steps=steps,
        status=row["status"],
        stored_run_id=row.get("stored_run_id"),
        tags=read_labels(path.parent).tags,
    )


def load_runs(runs_dir: Path, run_ids: list[str] | None = None, sweep: str | None = None) -> list[RunRecord]:
    """The runs named, or every run of a sweep (by id or name), in the order given / by name."""
    if bool(run_ids) == bool(sweep):
        raise QAEUserError("compare: pass run ids or --sweep ID (one of them), e.g. `qae compare --sweep study`.")
    repeated = sorted({run_id for run_id in run_ids or [] if run_ids.count(run_id) > 1})
    if repeated:
        raise QAEUserError(
            f"runs: {', '.join(repr(r) for r in repeated)} is named more than once. Name each run "
            "once: a group's seeds are different runs (same config, another --seed)."
        )
    if sweep:
        run_ids = []
        for folder in list_run_dirs(runs_dir):
            config_file = folder / "config.json"
            try:
                config = json.loads(read_run_file(config_file))
            except (OSError, ValueError, RecursionError, QAEUserError):  # unreadable or planted: not a sweep's run
                continue
            if not isinstance(config, dict):
                continue
            if in_sweep(config, sweep):
                run_ids.append(folder.name)
        if not run_ids:
            raise QAEUserError(
                f"sweep: no run in {runs_dir} belongs to sweep '{sweep}'. `qae runs` lists the runs; "
                "a sweep's runs carry its id and name."
            )
    return [load_run(runs_dir, run_id) for run_id in run_ids]


@dataclass
class Comparison:
    groups: list[RunGroup]
    baseline: RunGroup | None = None
    differences: dict[str, dict[str, PairedDifference]] = field(default_factory=dict)  # label -> metric -> diff
    left_out: dict[str, str] = field(default_factory=dict)  # run id -> why it is in no group
    metrics: dict[str, str] = field(default_factory=lambda: dict(RUN_METRICS))  # name -> definition, in order

    def to_dict(self) -> dict:
        """Everything `qae compare --json` prints: per group its runs, n, note and metric estimates; against the
        baseline, per group and metric the paired difference."""
        return {
            "metrics": self.metrics,
            "groups": [group.to_dict() for group in self.groups],
            "baseline": self.baseline.label if self.baseline else None,
            "differences": {
                label: {name: estimate_json(d) for name, d in diffs.items()}
                for label, diffs in self.differences.items()
            },
            "left_out": self.left_out,
        }


def has_training_step(run: RunRecord) -> bool:
    return not run.steps.empty and bool((run.steps["step"] > 0).any())


def compare_runs(runs: list[RunRecord], baseline: str | None = None, group_by: list[str] | None = None) -> Comparison:
    """The runs grouped (by config without the seed, or by the keys in `group_by`: config keys and `tags`) and
    summarised, a run without a training step left out (killed before its first step, or not started: at most its
    step-0 evaluation, which as a seed would pull its group towards the untrained model)."""
    if group_by:
        check_group_by([run.config for run in runs], group_by)
    left_out = {run.run_id: "no training step yet" for run in runs if not has_training_step(run)}
    counted = [run for run in runs if run.run_id not in left_out]
    groups = group_runs(counted, group_by)
    metrics = {**RUN_METRICS, **component_metrics(counted)}
    if baseline is None:
        return Comparison(groups, left_out=left_out, metrics=metrics)
    base = find_group(groups, baseline)
    return Comparison(groups, base, compare_to_baseline(groups, base), left_out, metrics)
