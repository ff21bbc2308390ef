"""The entropy band: a `warnings` row when the smoothed token entropy leaves it (collapse or explosion risk), with
the way K steers it back."""

from __future__ import annotations

import math

from qae_app.config import TrainConfig
from qae_app.core import names
from qae_app.core.names import ENTROPY_BAND_FACTOR, entropy_band
from qae_app.train.trainer_state import TrainerState

ENTROPY_EMA_ALPHA = 0.1  # smoothing of the entropy that the band warnings watch (about the last 10 steps)


def entropy_warning(state: TrainerState, entropy: float, cfg: TrainConfig) -> dict | None:
    """A `warnings` row when the smoothed entropy leaves the band: once per crossing, not every noisy step. Follows
    the step's entropy in `state` (entropy_start, entropy_ema, entropy_zone)."""
    if math.isnan(entropy):
        return None
    if state.entropy_start is None:
        state.entropy_start = entropy
    ema = (
        entropy
        if state.entropy_ema is None
        else (ENTROPY_EMA_ALPHA * entropy + (1 - ENTROPY_EMA_ALPHA) * state.entropy_ema)
    )
    state.entropy_ema = ema
    low, high = entropy_band(cfg.entropy_low, cfg.entropy_high, state.entropy_start)
    zone = "low" if ema < low else "high" if ema > high else "ok"
    crossed = zone != state.entropy_zone and zone != "ok"
    state.entropy_zone = zone
    if not crossed:
        return None
    # the K the advice starts from: for QAE, the K in use; a mean baseline reads no K, so its advice starts from the
    # --k its options give (DEFAULT_K for auto): the K a QAE run on the same options would train with
    k = state.k or names.DEFAULT_K
    start = state.entropy_start
    if zone == "low":
        bound = f"{low:.3g}" + (
            "" if cfg.entropy_low is not None else f" (the starting {start:.3g} / {ENTROPY_BAND_FACTOR:g})"
        )
        message = (
            f"entropy (smoothed) {ema:.3f} fell below {bound}: collapse risk. Raise --k (e.g. "
            f"{min(k + 0.1, 0.9):.1f}) so more prompts are 'easy' and failures are pushed down, which "
            "raises entropy."
        )
    else:
        bound = f"{high:.3g}" + (
            "" if cfg.entropy_high is not None else f" (the starting {start:.3g} x {ENTROPY_BAND_FACTOR:g})"
        )
        message = (
            f"entropy (smoothed) {ema:.3f} rose above {bound}: explosion risk. Lower --k (e.g. "
            f"{max(k - 0.1, 0.1):.1f}) so more prompts are 'hard' and only successes are reinforced, "
            "which lowers entropy."
        )
    return {"kind": f"entropy_{zone}", "message": message}
