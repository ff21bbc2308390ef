"""The results log: bench/harness.py's report() appends one well-formed JSON line (to a log in tmp_path, never the
real one), goals are compared as written, and a child's peak RSS is read from the kernel; bench/results.py shows the
latest entry of each name, and docs/performance.md is what it makes of bench/results.jsonl. No test here times
anything."""

import json
import re
import sys
from datetime import datetime
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402
import results  # noqa: E402

HELPERS = {"harness.py", "results.py", "hf_char_tokenizer.py", "roofline.py"}  # bench/ modules that are not benchmarks


def test_report_appends_one_well_formed_line(tmp_path):
    log = tmp_path / "results.jsonl"
    log.write_text('{"name": "earlier", "value": 1.0}\n')
    s = harness.spread([0.5, 0.2, 0.9, 0.4, 0.3])
    returned = harness.report(
        "vs_trl: qae/TRL step time per pair, arith G=4",
        s.median,
        "<= 0.8",
        unit="x",
        command="python bench/vs_trl.py --group-sizes 4",
        note="quiet",
        spread=s,
        log=log,
    )
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == {"name": "earlier", "value": 1.0}  # appended, not rewritten
    entry = json.loads(lines[1])
    assert entry == returned
    assert set(entry) == {
        "name",
        "value",
        "unit",
        "goal",
        "met",
        "date",
        "commit",
        "load",
        "machine",
        "command",
        "note",
        "spread",
    }
    assert (entry["name"], entry["value"], entry["unit"], entry["goal"], entry["met"], entry["note"]) == (
        "vs_trl: qae/TRL step time per pair, arith G=4",
        0.4,
        "x",
        "<= 0.8",
        True,
        "quiet",
    )
    assert entry["command"] == "python bench/vs_trl.py --group-sizes 4"
    assert entry["spread"] == {"middle_half": [0.3, 0.5], "min_max": [0.2, 0.9], "pairs": 5}
    assert datetime.strptime(entry["date"], "%Y-%m-%dT%H:%M:%SZ")  # UTC, ISO 8601
    if (harness.ROOT / ".git").exists():  # a git checkout (a worktree's .git is a file)
        assert re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", entry["commit"])
    assert len(entry["load"]) == 3 and all(x >= 0 for x in entry["load"])
    assert entry["machine"]["cores"] >= 1 and 1 <= entry["machine"]["usable_cores"] <= entry["machine"]["cores"]
    assert isinstance(entry["machine"]["cpu"], str)


def test_report_writes_where_the_environment_says_and_names_its_command(tmp_path, monkeypatch):
    log = tmp_path / "elsewhere" / "log.jsonl"
    monkeypatch.setenv(harness.RESULTS_ENV, str(log))
    monkeypatch.setattr(sys, "argv", [str(harness.ROOT / "bench" / "bench_cli.py"), "--runs", "5"])
    entry = harness.report("bench_cli: qae runs", 1.25, "< 1", unit="s")
    assert json.loads(log.read_text()) == entry
    assert (entry["met"], entry["command"], entry["note"]) == (False, "python bench/bench_cli.py --runs 5", None)
    assert "spread" not in entry


def test_goals_are_compared_as_written():
    assert harness.goal_met(0.48, "<= 0.8") and not harness.goal_met(0.81, "<= 0.8")
    assert harness.goal_met(0.8, "<= 0.8") and not harness.goal_met(0.8, "< 0.8")
    assert not harness.goal_met(11.8, ">= 30") and harness.goal_met(49.0, ">=30")
    assert harness.goal_met(0, "== 0") and harness.goal_met(2.5, "> 1e-3")
    assert harness.goal_met(0.8, "between 0.8 and 1.2") and not harness.goal_met(1.21, "between 0.8 and 1.2")
    assert harness.goal_met(0.72, None) is None
    with pytest.raises(ValueError, match="goal: 'at most 3%' is not a comparison with a number"):
        harness.goal_met(2.4, "at most 3%")


def test_a_value_the_log_cannot_hold_is_refused(tmp_path):
    log = tmp_path / "results.jsonl"
    with pytest.raises(ValueError, match="measured nan"):
        harness.report("x: y", float("nan"), None, unit="s", log=log)
    assert not log.exists()


def test_latest_is_the_newest_date_of_each_name_then_the_later_line():
    entries = [
        {"name": "a", "value": 1, "date": "2026-12-02"},
        {"name": "b", "value": 2, "date": None},
        {"name": "a", "value": 3, "date": "2026-11-30"},  # older, though later in the log
        {"name": "b", "value": 4, "date": "2026-12-01"},
        {"name": "a", "value": 5, "date": "2026-12-02"},  # same date as the first: the later line wins
        {"name": "c", "value": 6, "date": "2026-12-01T09:00:00Z"},
        {"name": "c", "value": 7, "date": "2026-12-01"},
    ]  # a date without a time is the older
    assert [(e["name"], e["value"]) for e in harness.latest(entries)] == [("a", 5), ("b", 4), ("c", 6)]


def test_a_broken_line_in_the_log_is_named(tmp_path):
    log = tmp_path / "results.jsonl"
    log.write_text('{"name": "a", "value": 1}\n\n{"name": \n')
    with pytest.raises(ValueError, match=r"results.jsonl:3: not a JSON line"):
        harness.read_results(log)


def test_peak_rss_of_a_child_is_what_it_held(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys\nblock = bytearray(64 * 2**20)\nblock[::4096] = b'x' * len(block[::4096])\n"
        "print('held', sys.argv[1:])\n"
    )
    peak, output = harness.peak_rss_of_child(str(script), ["--size", "64"])
    assert output == "held ['--size', '64', '--child']\n"
    assert peak >= 64 * 2**20


# ---- bench/results.py and docs/performance.md ----------------------------------------------------------------------


def test_the_page_is_what_the_renderer_makes_of_the_log():
    page = results.PAGE.read_text()
    assert results.render_page(page, harness.read_results(harness.RESULTS_LOG)) == page, (
        "docs/performance.md is out of date with bench/results.jsonl: run python bench/results.py render"
    )
    assert results.main(["check"]) == 0


def test_the_table_shows_the_latest_line_of_each_name():
    entries = [
        {
            "name": "bench_x: speed-up",
            "value": 0.6,
            "unit": "x",
            "goal": "<= 0.5",
            "met": False,
            "date": "2026-12-02T08:00:00Z",
            "commit": "abc1234",
            "load": [8.3, 5.0, 4.0],
            "machine": {"cores": 4, "usable_cores": 2, "cpu": "c"},
            "command": "python bench/bench_x.py",
            "note": None,
        },
        {
            "name": "bench_x: speed-up",
            "value": 0.2,
            "unit": "x",
            "goal": "<= 0.5",
            "met": True,
            "date": "2026-12-02T09:30:00Z",
            "commit": "def5678+dirty",
            "load": [1.25, 1.0, 1.0],
            "machine": {"cores": 4, "usable_cores": 2, "cpu": "c"},
            "command": "python bench/bench_x.py --a|b",
            "note": "quiet",
            "spread": {"middle_half": [0.18, 0.25], "min_max": [0.1, 0.3], "pairs": 20},
        },
        {
            "name": "bench_x: speed-up",
            "value": 0.9,
            "unit": "x",
            "goal": "<= 0.5",
            "met": False,
            "date": "2026-12-01",
            "commit": None,
            "load": "machine shared",
            "machine": {"cores": 2, "cpu": None},
            "command": "python bench/bench_x.py",
            "note": None,
            "source": "README before the results log",
        },
        {
            "name": "bench_x: size",
            "value": 1.5,
            "unit": "GB",
            "goal": None,
            "met": None,
            "date": None,
            "commit": None,
            "load": None,
            "machine": {},
            "command": None,
            "note": None,
        },
    ]
    table = results.render_table(entries).splitlines()
    rows = [line for line in table if line.startswith("| bench_x")]
    assert rows == [
        "| bench_x: size | **1.5 GB** |  |  | not stated | not stated | not stated |  |  |  |",
        "| bench_x: speed-up | **0.20x (middle half 0.18-0.25, min-max 0.10-0.30, 20 pairs)** | <= 0.5x | yes | "
        "2026-12-02 09:30 UTC | 1.2 on 2 cores | c | def5678+dirty | `python bench/bench_x.py --a\\|b` | quiet |",
    ]
    assert "The latest of each of 2 figures, out of 4 lines in the log." in table
    readme_row = results.row(entries[2])
    assert (readme_row[3], readme_row[5], readme_row[7]) == ("**no**", "machine shared", "README")


def test_every_line_names_its_cpu_and_the_flags_its_kernels_depend_on(tmp_path):
    """A figure of a matmul-bound benchmark means little without the CPU: report() records the model name and which
    of the bf16/AMX/AVX flags /proc/cpuinfo lists, and the page shows them."""
    cpuinfo = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum "
        "8480+\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile avx512_vnni\n"
    )
    assert harness.cpu_facts(cpuinfo) == (
        "Intel(R) Xeon(R) Platinum 8480+",
        ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"],
    )
    assert harness.cpu_facts("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n") == (None, ["asimd", "sve", "bf16"])
    entry = harness.report(
        "bench_x: speed", 1.0, None, unit="s", command="python bench/bench_x.py", log=tmp_path / "log.jsonl"
    )
    assert set(entry["machine"]) == {"cores", "usable_cores", "cpu", "cpu_flags"}
    assert set(entry["machine"]["cpu_flags"]) <= set(harness.CPU_FLAGS)
    label = harness.cpu_label({"cpu": "AMD EPYC 9R14", "cpu_flags": ["avx2", "avx512_bf16"]})
    assert label == "AMD EPYC 9R14 (avx2, avx512_bf16)" and results.row(entry)[6] == harness.cpu_label(entry["machine"])


def test_a_withdrawn_figure_keeps_its_value_and_loses_its_verdict_until_measured_again(tmp_path, monkeypatch):
    log = tmp_path / "results.jsonl"
    monkeypatch.setenv(harness.RESULTS_ENV, str(log))
    name = "bench_x: share of the limit"
    harness.report(name, 0.71, ">= 0.6", unit="of the limit", command="python bench/bench_x.py")
    assert results.main(["withdraw", "bench_x: no such figure", "--reason", "r", "--command", "c"]) == 2
    assert (
        results.main(
            [
                "withdraw",
                name,
                "--reason",
                "judged against the float32 rate",
                "--command",
                "python bench/bench_x.py --roofline",
            ]
        )
        == 0
    )
    entries = harness.read_results(log)
    assert [e.get("withdrawn") for e in entries] == [None, name] and harness.latest(entries) == entries[:1]
    cells = results.row(entries[0], harness.withdrawals(entries)[name])
    assert (cells[1], cells[3]) == ("**0.71 of the limit**", "withdrawn")
    assert cells[9].startswith(f"withdrawn {entries[1]['date'][:10]}: judged against the float32 rate")
    table = results.render_table(entries)
    assert "| withdrawn |" in table and "| yes |" not in table
    later = dict(entries[0], date="2999-01-01T00:00:00Z", value=0.3, met=False)  # measured again after it
    assert results.row(later, harness.withdrawals(entries)[name])[3] == "**no**"


def test_render_replaces_only_the_generated_block_and_check_sees_a_new_line(tmp_path, monkeypatch):
    log, page = tmp_path / "results.jsonl", tmp_path / "performance.md"
    monkeypatch.setenv(harness.RESULTS_ENV, str(log))
    assert (
        results.main(
            ["record", "test suite: python -m pytest", "15.8", "--unit", "min", "--command", "python -m pytest"]
        )
        == 0
    )
    page.write_text(f"# Performance\n\nabove\n\n{results.BEGIN}\nold table\n{results.END}\n\nbelow\n")
    paths = ["--log", str(log), "--page", str(page)]
    assert results.main([*paths, "check"]) == 1
    assert results.main([*paths, "render"]) == 0
    text = page.read_text()
    assert text.startswith("# Performance\n\nabove\n\n" + results.BEGIN) and text.endswith(results.END + "\n\nbelow\n")
    assert "old table" not in text and "| test suite: python -m pytest | **15.8 min** |" in text
    assert results.main([*paths, "check"]) == 0
    harness.report("bench_cli: qae --help", 0.4, None, unit="s", command="python bench/bench_cli.py")
    assert results.main([*paths, "check"]) == 1


def test_a_page_without_its_markers_is_refused():
    with pytest.raises(SystemExit, match="markers are missing or out of order"):
        results.render_page(f"# Performance\n{results.END}\n{results.BEGIN}\n", [])


def test_every_line_of_the_log_is_well_formed_and_names_a_benchmark():
    benchmarks = {path.stem for path in BENCH.glob("*.py") if path.name not in HELPERS} | {"test suite"}
    entries = harness.read_results(harness.RESULTS_LOG)
    for number, entry in enumerate(entries, start=1):
        where = f"bench/results.jsonl:{number}"
        if "withdrawn" in entry:  # a withdrawal names a figure logged before it, says why, when and by whom
            assert set(entry) == {"withdrawn", "reason", "date", "commit", "machine", "command"}, where
            assert entry["withdrawn"] in {e.get("name") for e in entries[: number - 1]} and entry["reason"], where
            continue
        assert set(entry) >= {"name", "value", "unit", "goal", "met", "date", "commit", "load", "machine", "command"}, (
            where
        )
        assert entry["name"].split(":")[0] in benchmarks, where
        assert isinstance(entry["value"], float) and entry["unit"], where
        assert entry["met"] == harness.goal_met(entry["value"], entry["goal"]), where
        if entry.get("source"):  # copied from the README: no commit, the README's words for the load
            assert entry["source"] == "README before the results log" and entry["commit"] is None, where


def test_every_benchmark_reports_and_is_in_the_index():
    index = (BENCH / "README.md").read_text()
    for path in sorted(BENCH.glob("*.py")):
        assert f"`{path.name}`" in index, f"bench/README.md does not list {path.name}"
        if path.name not in HELPERS:
            assert re.search(r"\breport(_result)?\(", path.read_text()), f"{path.name} never calls report()"
