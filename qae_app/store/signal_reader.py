"""The readers of what shows reward hacking: which reward component carries a run's signal (`component_signal`), each
response's sampler/trainer gap (`rollouts.mismatch`) and every token's numbers (`token_values`). As store/reader.py's:
read-only, one query, let go at once; a file from before a table or column reads as empty (a reader never migrates)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qae_app.store.reader import SQL_HAS_TABLE, open_reader, pandas

if TYPE_CHECKING:
    import pandas as pd

SIGNAL_COLUMNS = ["step", "name", "weight", "value_mean", "frac_differs", "frac_signal", "adv_share"]
SQL_SIGNAL = f"SELECT {', '.join(SIGNAL_COLUMNS)} FROM component_signal ORDER BY step, rowid"
SQL_HAS_COLUMN = """
    SELECT count(*) FROM duckdb_columns()
    WHERE database_name = current_database() AND table_name = ? AND column_name = ?
"""
TOKEN_COLUMNS = ["group_idx", "sample_idx", "tokens", "logprob", "entropy", "old_logprob"]
SQL_TOKENS = f"""
    SELECT {", ".join(TOKEN_COLUMNS)} FROM token_values
    WHERE step = ? AND (? IS NULL OR list_contains(?, group_idx::BIGINT * 1000000 + sample_idx))
    ORDER BY group_idx, sample_idx
"""
SQL_MISMATCH = "SELECT group_idx, sample_idx, mismatch FROM rollouts WHERE step = ? ORDER BY group_idx, sample_idx"
SQL_TOKEN_STEPS = "SELECT DISTINCT step FROM token_values ORDER BY step"


def read_component_signal(path: Path) -> pd.DataFrame:
    """SIGNAL_COLUMNS of every step (a run given --reward; else empty), components in their order."""
    with open_reader(path) as con:
        if not con.execute(SQL_HAS_TABLE, ["component_signal"]).fetchone()[0]:
            return pandas().DataFrame(columns=SIGNAL_COLUMNS)
        return con.execute(SQL_SIGNAL).df()


def signal_table(signal: pd.DataFrame, column: str = "adv_share", prefix: str = "signal:") -> pd.DataFrame:
    """One row per step, a column per component (`<prefix><name>`) holding its `column`."""
    if signal.empty:
        return pandas().DataFrame({"step": []})
    wide = signal.pivot(index="step", columns="name", values=column)
    wide = wide[list(dict.fromkeys(signal["name"]))]  # (the components in the run's order)
    wide.columns = [f"{prefix}{name}" for name in wide.columns]
    return wide.reset_index()


def read_token_values(path: Path, step: int, responses: list[tuple[int, int]] | None = None) -> pd.DataFrame:
    """TOKEN_COLUMNS of one step's kept responses (`responses`: only these (group_idx, sample_idx)); each list holds a
    value per response token. Empty for a file from before the table."""
    keys = None if responses is None else [int(g) * 1_000_000 + int(i) for g, i in responses]
    with open_reader(path) as con:
        if not con.execute(SQL_HAS_TABLE, ["token_values"]).fetchone()[0]:
            return pandas().DataFrame(columns=TOKEN_COLUMNS)
        return con.execute(SQL_TOKENS, [step, keys, keys]).df()


def read_token_steps(path: Path) -> list[int]:
    """The steps with per-token values stored."""
    with open_reader(path) as con:
        if not con.execute(SQL_HAS_TABLE, ["token_values"]).fetchone()[0]:
            return []
        return [int(step) for (step,) in con.execute(SQL_TOKEN_STEPS).fetchall()]


def read_response_mismatch(path: Path, step: int) -> pd.DataFrame:
    """group_idx, sample_idx, mismatch (mean |old - sampler| log-prob per token) of one step's responses; NULLs for a
    file from before the column."""
    with open_reader(path) as con:
        if not con.execute(SQL_HAS_COLUMN, ["rollouts", "mismatch"]).fetchone()[0]:
            frame = con.execute("SELECT group_idx, sample_idx FROM rollouts WHERE step = ? ORDER BY ALL", [step]).df()
            return frame.assign(mismatch=float("nan"))
        return con.execute(SQL_MISMATCH, [step]).df()
