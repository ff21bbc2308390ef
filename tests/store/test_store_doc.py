"""docs/store.md's "Querying runs yourself" stays true: each of its Python blocks runs against a real run's database
(the 6-step tiny run, copied to runs/demo/ as the page names it), and prints the columns the page shows under it."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "store.md"
SECTION = "## Querying runs yourself"


def doc_queries() -> list[tuple[str, str]]:
    """(code, shown output) of each ```python block of the section and the ```text block after it."""
    text = DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.find("\n## ", len(SECTION))]
    pairs = re.findall(r"```python\n(.*?)```\n+(?:.*?\n)*?```text\n(.*?)```", section, flags=re.S)
    return pairs


def columns_shown(output: str) -> list[str]:
    """The column names in a printed table: DuckDB's and polars' boxes, or pandas' header line."""
    for line in output.splitlines():
        words = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", line)
        if len(words) >= 2 and not line.startswith("shape"):
            return words
    return []


def test_the_page_has_its_three_queries():
    codes = [code for code, _ in doc_queries()]
    assert len(codes) == 3
    assert "duckdb" in codes[0] and ".df()" in codes[1] and "polars" in codes[2]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["duckdb", "pandas", "polars"])
def test_each_query_runs_on_a_real_run_and_prints_the_columns_shown(index, tiny_run, tmp_path, monkeypatch):
    code, shown = doc_queries()[index]
    if "import polars" in code:
        pytest.importorskip("polars", reason="polars is not installed (the page's third query uses it)")
    runs_dir, run_id = tiny_run
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    shutil.copy(runs_dir / run_id / "qae.duckdb", tmp_path / "runs" / "demo" / "qae.duckdb")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"docs/store.md query {index + 1}", "exec"), {})
    assert columns_shown(shown) and columns_shown(printed.getvalue()) == columns_shown(shown), printed.getvalue()
