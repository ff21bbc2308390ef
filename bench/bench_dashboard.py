"""How long each dashboard page takes to draw for a 1,000-step run with 128,000 rollouts, on 2 cores.

The run is written synthetically through the real store (tests/synthetic.py: 16 prompts x 8 responses a step, an
evaluation of 30 problems x 4 samples every 50 steps), then every page is run with Streamlit's AppTest, which
executes the page's script as the server does (reads, figures, tables) without a browser:

- cold: caches cleared first, as when a new step of a live run arrives (every reader's cache key changes);
- warm: the same page again with the caches filled (a rerun after a widget change).

    python bench/bench_dashboard.py [--keep DIR] [--repeats N]
    python bench/bench_dashboard.py --paper-scale   # one step of 512 x 16 responses of 2-12k characters (~60 MB)

`--paper-scale` writes one step at the paper's size (bench/bench_store.py's synthetic step, through the real writer)
and times the pages that read a step's responses.

Goal: every page under 3 s cold. The last line names the worst page, which goes to the results log (bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGES = ["runs", "curves", "distributions", "rollouts", "prompts", "evals", "eval_samples"]
PAPER_SCALE_PAGES = ["rollouts", "distributions"]  # the pages that read a step's responses
GOAL_S = 3.0
STEPS, PROMPTS, GROUP = 1000, 16, 8


def build(runs_dir: Path) -> None:
    from tests.synthetic import write_run

    if (runs_dir / "big" / "qae.duckdb").exists():
        print(f"reusing {runs_dir / 'big'}")
        return
    t0 = time.perf_counter()
    write_run(
        runs_dir,
        "big",
        steps=STEPS,
        prompts_per_step=PROMPTS,
        group_size=GROUP,
        n_prompts=2000,
        eval_every=50,
        eval_problems=30,
        eval_k=4,
        seed=0,
    )
    print(f"wrote {STEPS} steps x {PROMPTS * GROUP} rollouts in {time.perf_counter() - t0:.0f} s")


def build_paper_scale(runs_dir: Path) -> None:
    """One step of 512 prompts x 16 responses of 2-12k characters, written as the trainer's writer writes it."""
    import random

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_store import MATH_DATA, paper_step

    from qae_app.store.run_folder import db_path
    from qae_app.store.writer import RunWriter

    if (runs_dir / "big" / "qae.duckdb").exists():
        print(f"reusing {runs_dir / 'big'}")
        return
    t0 = time.perf_counter()
    rows = [json.loads(line) for line in (MATH_DATA / "math500.jsonl").read_text().splitlines() if line.strip()]
    words = " ".join(row.get("solution", "") + " " + row.get("problem", "") for row in rows).split()
    writer = RunWriter(db_path(runs_dir, "big"), "big")
    writer.create_run("big", {"steps": 1}, "qae", 0.4, "bench", "bench", 0)
    tables, chars = paper_step(random.Random(0), words, 1)
    writer.add_step(1, **tables)
    assert writer.wait_until_written(timeout_s=600)
    writer.update_run(status="finished")
    print(
        f"wrote one step of {len(tables['rollouts'])} responses, {chars / 1e6:.0f} MB of text, in "
        f"{time.perf_counter() - t0:.0f} s"
    )


def render(page: str, cold: bool) -> float:
    """Seconds to run `page` (sidebar included) for the big run."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=300)
    at.query_params["run"] = ["big"]
    at.run()
    if cold:
        st.cache_data.clear()
    t0 = time.perf_counter()
    at.switch_page(f"views/{page}.py").run()
    seconds = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"{page}: {[e.value for e in at.exception]}")
    return seconds


def main() -> None:
    logging.disable(logging.WARNING)  # AppTest outside a server warns about its missing runtime at every run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="Folder for the runs (kept, and reused when it holds the run).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per page (the median is printed).")
    parser.add_argument(
        "--paper-scale",
        action="store_true",
        help="One step of 512 x 16 responses of 2-12k characters; times the pages that read it.",
    )
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 2:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    print(f"cores: {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}")
    runs_dir = args.keep or Path(tempfile.mkdtemp(prefix="qae-bench-dashboard-"))
    (build_paper_scale if args.paper_scale else build)(runs_dir)
    os.environ["QAE_RUNS_DIR"] = str(runs_dir)
    render("runs", cold=True)  # imports and the first run of the app, not counted
    results, warm_s = {}, {}
    print(f"{'page':<15}{'cold s':>8}{'warm s':>8}")
    for page in PAPER_SCALE_PAGES if args.paper_scale else PAGES:
        cold = statistics.median(render(page, cold=True) for _ in range(args.repeats))
        warm = statistics.median(render(page, cold=False) for _ in range(args.repeats))
        results[page], warm_s[page] = cold, warm
        print(f"{page:<15}{cold:>8.2f}{warm:>8.2f}", flush=True)
    worst = max(results, key=results.get)
    verdict = "under" if results[worst] < GOAL_S else "OVER"
    print(f"worst page: {worst} {results[worst]:.2f} s cold ({verdict} the {GOAL_S:g} s goal)")
    run = "paper-scale step (512 x 16 responses of 2-12k characters)" if args.paper_scale else f"{STEPS:,}-step run"
    report(
        f"bench_dashboard: slowest page cold, {run}",
        round(results[worst], 3),
        f"< {GOAL_S:g}",
        unit="s",
        note=f"{worst}; cold / warm s, medians of {args.repeats}: "
        + ", ".join(f"{page} {results[page]:.2f} / {warm_s[page]:.2f}" for page in results),
    )


if __name__ == "__main__":
    main()
