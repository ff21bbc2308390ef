"""The README and docs/ stay true: CI runs the README's test command, the README's CLI table names every command,
docs/metrics.md's table is STEP_METRICS, docs/architecture.md names every module that exists and none that does not,
the README stays a front door (short, undated, linking every page), and no link in README.md or docs/ is broken."""

import re
from pathlib import Path

from qae_app.cli.main import app
from qae_app.store.schema import STEP_METRICS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PACKAGE = ROOT / "qae_app"
DASHBOARD = ROOT / "dashboard"
README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_install_and_train_then_install_and_test():
    train, test = readme_commands()[:2]
    assert train.endswith("&& qae train")
    assert "pip install torch==2.13.0 && pip install -e ." in train
    assert test.endswith("python -m pytest") and "'.[dev]'" in test


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def table_rows(text: str, header: str) -> list[tuple[str, str]]:
    """The rows of the Markdown table whose header line is `header`, as (name, text): each row must read
    | `name` | text |."""
    lines = text.splitlines()
    assert lines.count(header) == 1, f"{header!r} heads {lines.count(header)} tables"
    rows = []
    for line in lines[lines.index(header) + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        row = re.fullmatch(r"\| `(\w+)` \| (.+?) \|", line)
        assert row, f"not a | `name` | text | row: {line}"
        rows.append(row.groups())
    return rows


def test_metrics_page_table_is_step_metrics_row_for_row():
    rows = table_rows((DOCS / "metrics.md").read_text(), "| metric | definition |")
    assert rows == list(STEP_METRICS.items())


def test_metrics_page_tables_are_the_alerts_and_their_levels():
    from qae_app.core.alert_levels import ALERT_LEVELS, ALERTS

    text = (DOCS / "metrics.md").read_text()
    assert table_rows(text, "| alert | fires when |") == list(ALERTS.items())
    assert table_rows(text, "| level | default | meaning |") == [
        (name, f"{level.default:g} | {level.help} (from {level.low:g} to {level.high:g})")
        for name, level in ALERT_LEVELS.items()]


def test_cli_table_names_every_command():
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        assert f"`qae {name}" in README, name


def code_spans(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def test_architecture_page_names_every_package_and_module():
    """Modules of qae_app as `package/module.py` (relative to qae_app/, `config.py` at its top), the dashboard's as
    `dashboard/...py`; packages as `qae_app/package/`. A .py path the page names must exist (under qae_app/ or the
    repository), so a module that is renamed or removed cannot linger there."""
    named = code_spans((DOCS / "architecture.md").read_text())
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if path.stem not in ("__init__", "__main__")}
    dashboard = {path.relative_to(ROOT).as_posix() for path in DASHBOARD.rglob("*.py") if path.stem != "__init__"}
    packages = {f"qae_app/{path.parent.name}/" for path in PACKAGE.glob("*/__init__.py")}
    assert sorted((modules | dashboard | packages) - named) == []
    gone = [name for name in named if name.endswith(".py") and not (PACKAGE / name).exists()
            and not (ROOT / name).exists()]
    assert gone == []


def test_readme_is_a_front_door_of_at_most_250_lines():
    assert len(README.splitlines()) <= README_MAX_LINES


def test_readme_has_no_dated_figure():
    """Figures measured on a day belong on a docs page, with that day and the command that measured them."""
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", README) == []


def test_readme_links_every_docs_page():
    linked = {target.split("#")[0] for target in links(README)}
    assert sorted(f"docs/{page.name}" for page in DOCS.glob("*.md") if f"docs/{page.name}" not in linked) == []


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code, where brackets and hashes are not Markdown."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def links(text: str) -> list[str]:
    """The targets of the Markdown links and images in `text`."""
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of `text`: lowercased, punctuation dropped, spaces as hyphens, a repeated
    one numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_relative_link_resolves():
    """Each relative link of README.md and docs/*.md names an existing file, and its #anchor a heading there."""
    broken = []
    for page in PAGES:
        for target in links(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in anchors(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
