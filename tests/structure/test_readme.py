"""The README and docs/ stay true: CI runs the README's test command, the README's CLI table names every command,
docs/metrics.md's table is STEP_METRICS, docs/architecture.md names every module that exists and none that does not,
the README stays a front door (short, undated, linking every page), no link in README.md or docs/ is broken, and every
name a page writes as code (`qae_app.store.writer.RunWriter`, `score_batch`, `store/writer.py`) is one the code has."""

import ast
import os
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


def test_the_readmes_first_time_names_the_machine_it_was_measured_on():
    """How long `qae train` takes depends on the machine and its load (66 s on 2 idle cores, hours on 2 cores at load
    20): the README's time says for which, and where docs/training.md has the measurement."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    said = " ".join(line.lstrip("# ") for line in block.splitlines() if line.startswith("#"))
    assert "66 s on 2 idle CPU cores (AMD EPYC, docs/training.md)" in " ".join(said.split())
    assert "qae train` runs 300 steps in 66 s wall" in (ROOT / "docs" / "training.md").read_text()


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
    for line in lines[lines.index(header) + 2 :]:  # past the header and its |---| line
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
        for name, level in ALERT_LEVELS.items()
    ]


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
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.stem not in ("__init__", "__main__")
    }
    dashboard = {path.relative_to(ROOT).as_posix() for path in DASHBOARD.rglob("*.py") if path.stem != "__init__"}
    packages = {f"qae_app/{path.parent.name}/" for path in PACKAGE.glob("*/__init__.py")}
    assert sorted((modules | dashboard | packages) - named) == []
    gone = [
        name for name in named if name.endswith(".py") and not (PACKAGE / name).exists() and not (ROOT / name).exists()
    ]
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


# ---------------------------------------------------------------------------------------------------------------
# every name a page writes as code is one the code has

FILE_SUFFIXES = (
    ".lock",
    ".json",
    ".jsonl",
    ".duckdb",
    ".toml",
    ".yaml",
    ".yml",
    ".md",
    ".safetensors",
    ".parquet",
    ".csv",
    ".txt",
    ".gguf",
    ".pkl",
    ".pt",
    ".sh",
    ".png",
    ".log",
    ".bin",
    ".html",
    ".wandb",
    ".db",
)
# a table whose header's first cell names another project: that column holds the other project's names
OTHER_PROJECTS = ("verl", "TRL")
# "TRL's `log_extra` and `log_metric`": names another project's, up to the end of the clause
FOREIGN_NAMES = re.compile(r"\b(?:TRL|verl|accelerate|DeepSpeed|vLLM|transformers|peft|torch)'s\b[^.;:]*$")
SOURCE_DIRS = ("qae_app", "dashboard", "bench", "tests", "scripts", "examples", "configs", "recipes")


def page_code_spans(text: str) -> list[str]:
    """The inline code of a page, outside fenced blocks, the first column of a table of another project's names
    (`| verl | qae |`) and a clause that says whose they are ("TRL's `log_extra`")."""
    found, foreign_table = [], False
    for line in re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).splitlines():
        if line.startswith("|"):
            cells = line.split("|")
            foreign_table = foreign_table or cells[1].strip() in OTHER_PROJECTS
            line = "|".join(cells[2:]) if foreign_table else line
        else:
            foreign_table = False
        for match in re.finditer(r"`([^`\n]+)`", line):
            if not FOREIGN_NAMES.search(line[: match.start()]):
                found.append(match.group(1).strip().removesuffix("()"))
    return found


def _top_names(node) -> dict:
    """name -> its node (a def or class; None for a value) of a module's or class's body, `if`/`try` blocks
    included; a class's also the attributes its methods set on self."""
    names = {}
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[child.name] = child
        elif isinstance(child, (ast.Assign, ast.AnnAssign)):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            names.update((n.id, None) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name.split(".")[0], None) for a in child.names)
        elif isinstance(child, (ast.If, ast.Try, ast.With)):
            names.update(_top_names(child))
    if isinstance(node, ast.ClassDef):
        names.update(
            (n.attr, None)
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and n.attr not in names
        )
    return names


def _has_path(path: Path, attributes: list[str]) -> bool:
    node = ast.parse(path.read_text())
    for name in attributes:
        if node is None:  # an attribute of a value: not followed further
            return True
        names = _top_names(node)
        if name not in names:
            return False
        node = names[name]
    return True


def our_module_files() -> dict[str, list[Path]]:
    """module basename -> its files, qae_app's and the dashboard's."""
    files: dict[str, list[Path]] = {}
    for path in [*PACKAGE.rglob("*.py"), *DASHBOARD.rglob("*.py")]:
        if path.stem not in ("__init__", "__main__"):
            files.setdefault(path.stem, []).append(path)
    return files


def dotted_name_problem(dotted: str, modules: dict[str, list[Path]]) -> str | None:
    """Why `qae_app.store.writer.RunWriter`, `store.writer`, `writer.RunWriter` or `config.TrainConfig.validate` names
    nothing of ours (None when it does, or when its first part is not ours: `torch.quantile`)."""
    parts = dotted.split(".")
    ours = parts[0] == "qae_app"
    parts = parts[1:] if ours else parts
    if parts and parts[0] == "dashboard":  # installed as qae_app.dashboard
        parts, folder = parts[1:], DASHBOARD
    else:
        folder = PACKAGE
    if not parts:
        return None
    if (folder / parts[0]).is_dir():  # a package: its module, then the names in it
        if len(parts) == 1:
            return None
        path = folder / parts[0] / f"{parts[1]}.py"
        return None if path.exists() and _has_path(path, parts[2:]) else "no such module or name"
    if (folder / f"{parts[0]}.py").exists() and (ours or parts[0] == "config"):
        return None if _has_path(folder / f"{parts[0]}.py", parts[1:]) else "no such name"
    if len(modules.get(parts[0], [])) == 1:  # a module by its own name: `names.REGIMES`
        return None if _has_path(modules[parts[0]][0], parts[1:]) else "no such name"
    return "no such module" if ours else None


def project_python_files() -> set[str]:
    """Every .py file of the checkout, as a path from its root, but for hidden folders and run folders: pruned while
    walking, because the environments in the checkout (.venv, .venv-vllm: ~100,000 files) took 80 s to walk."""
    files = set()
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name != "runs"]
        files.update((Path(folder) / name).relative_to(ROOT).as_posix() for name in names if name.endswith(".py"))
    return files


def test_every_name_a_page_writes_as_code_is_in_the_code():
    """README.md and docs/*.md: a backticked `qae_app....` name, or a dotted name starting with one of qae's packages
    or modules, resolves to a module and the names in it; a backticked `path.py` exists; a backticked snake_case or
    CamelCase name (`score_batch`, `RunWriter`) is in the code or its configs. Another project's names (the first
    column of a `| verl | qae |` table, an installed module's file name) are theirs."""
    import importlib.util

    modules = our_module_files()
    tracked = [
        path
        for folder in SOURCE_DIRS
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in (".py", ".toml", ".yaml", ".yml")
    ]
    words = {word for path in tracked for word in re.findall(r"\w+", path.read_text(errors="replace"))}
    files = project_python_files()
    unknown = []
    for page in PAGES:
        for span in page_code_spans(page.read_text()):
            if re.fullmatch(r"[\w./-]+\.py", span):
                stem = Path(span).stem
                if any(f == span or f.endswith("/" + span) or f == f"qae_app/{span}" for f in files):
                    continue
                if not (stem.isupper() or importlib.util.find_spec(stem) is not None):  # PATH.py, click.py
                    unknown.append(f"{page.name}: {span} (no such file)")
            elif span.endswith(FILE_SUFFIXES):
                continue
            elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", span):
                if problem := dotted_name_problem(span, modules):
                    unknown.append(f"{page.name}: {span} ({problem})")
            elif re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+|[A-Z][a-z0-9]+([A-Z][a-z0-9]*)+", span):
                if span not in words:
                    unknown.append(f"{page.name}: {span} (nowhere in the code)")
    assert unknown == []
