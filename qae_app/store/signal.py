"""Which reward component carries the signal: the `component_signal` rows of a step (or a preview) with several reward
components, from its groups' rewards, each component's weighted part of them, and the advantages.

A group has signal when its rewards differ. Per component (store.TABLES["component_signal"] defines the columns):

- `frac_differs`: the share of the step's groups in which the component's part differs between responses;
- `frac_signal`: the share of the step's groups whose signal exists because of it: their rewards differ, and without
  the component's part (the others, and the overlong penalty, alone) they would all be equal;
- `adv_share`: its share of the step's advantage mass. A trained group's mass is the sum of its |advantage|; each
  group's mass is split among the components by their share of its reward spread, sum over the responses of
  |part - the group's mean part| (the overlong penalty takes its own share, which no component row holds). A
  component that never differs within a group carries none of it.

Pure and torch-free, as store/rows.py: the preview, the trainer and a test compute the same rows from the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

from qae_app.core.errors import QAEUserError
from qae_app.store.rows import GroupResult

SAME_TOLERANCE = 1e-9  # rewards are sums of weighted parts in float: within this (relative) they are equal


def _equal(values: Sequence[float]) -> bool:
    scale = max(1.0, *(abs(v) for v in values))
    return max(values) - min(values) <= SAME_TOLERANCE * scale


def _spread(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return sum(abs(v - mean) for v in values)


def component_signal_rows(groups: Sequence[GroupResult], weights: dict[str, float]) -> list[dict]:
    """One row per reward component (in the order of the groups' `parts`) of these groups; [] when they carry no
    parts (a run without --reward). `weights`: each component's --reward-weights weight."""
    names = list(groups[0].parts) if groups else []
    if not names:
        return []
    n_groups = len(groups)
    differs = dict.fromkeys(names, 0)
    decisive = dict.fromkeys(names, 0)
    mass = dict.fromkeys(names, 0.0)
    total_mass = 0.0
    for g in groups:
        rewards = g.rewards
        signal = not _equal(rewards)
        spread = {name: _spread(g.parts[name]) for name in names}
        penalty = [r - sum(g.parts[name][i] for name in names) for i, r in enumerate(rewards)]
        whole_spread = sum(spread.values()) + _spread(penalty)
        for name in names:
            if not _equal(g.parts[name]):
                differs[name] += 1
            if signal and _equal([r - part for r, part in zip(rewards, g.parts[name], strict=True)]):
                decisive[name] += 1
        group_mass = 0.0 if g.filtered else sum(abs(a) for a in g.advantages)
        if group_mass and whole_spread:
            total_mass += group_mass
            for name in names:
                mass[name] += group_mass * spread[name] / whole_spread
    rows = []
    for name in names:
        values = [v for g in groups for v in g.components.get(name, ()) if v is not None]
        rows.append(
            {
                "name": name,
                "weight": weights.get(name),
                "value_mean": sum(values) / len(values) if values else None,
                "frac_differs": differs[name] / n_groups,
                "frac_signal": decisive[name] / n_groups,
                "adv_share": mass[name] / total_mass if total_mass else None,
            }
        )
    return rows


def groups_with_signal(group_idx: Sequence[int], rewards: Sequence[float]) -> dict[int, bool]:
    """group -> whether its rewards differ (the signal a preview's verdict counts), from its responses' rows."""
    seen: dict[int, list[float]] = {}
    for g, reward in zip(group_idx, rewards, strict=True):
        seen.setdefault(int(g), []).append(float(reward))
    return {g: not _equal(values) for g, values in seen.items()}


def primary_component(primary: str | None, rows: Sequence[dict]) -> str | None:
    """The primary reward component of `component_signal` rows: --primary-reward (`primary`), else the first;
    QAEUserError when --primary-reward names none of them (known only once the rewards scored: a function may return
    named parts)."""
    names = [row["name"] for row in rows]
    if primary is not None and names and primary not in names:
        raise QAEUserError(
            f"primary-reward: '{primary}' is not a component of this run's rewards ({', '.join(names)})"
            ". Name one of them (a reward's name, or one of a function's named parts)."
        )
    return primary or (names[0] if names else None)


def signal_sentence(rows: Sequence[dict], primary: str | None = None) -> str | None:
    """What the rows say in one clause, or None without components or without signal:
    'all signal comes from one_word (weight 0.2); antonym never differs within a group', or
    'signal by component (share of the advantage): antonym 70%, one_word 30%'. `primary`: the reward the task is
    (default: the first component), named when it carries none."""
    carrying = [row for row in rows if (row["adv_share"] or 0) > 0]
    if not carrying:
        return None
    primary = primary or rows[0]["name"]
    silent = [row["name"] for row in rows if row["frac_differs"] == 0]
    if len(carrying) == 1:
        only = carrying[0]
        said = f"all signal comes from {only['name']} (weight {only['weight']:g})"
    else:
        said = "signal by component (share of the advantage): " + ", ".join(
            f"{row['name']} {row['adv_share']:.0%}" for row in sorted(carrying, key=lambda r: -r["adv_share"])
        )
    if silent:
        said += (
            "; " + ", ".join(silent) + (" never differs" if len(silent) == 1 else " never differ") + " within a group"
        )
    if primary not in silent and all(row["name"] != primary for row in carrying):
        said += f"; {primary} carries none of it"
    return said
