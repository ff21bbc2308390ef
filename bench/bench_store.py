"""Benchmark: what the store and the row building cost a run, as a share of its wall time.

    python bench/bench_store.py [--steps 300]

Trains the default run (`qae train` at its defaults: built-in model and task, 300 steps, held-out evaluation every 25)
in a temporary folder, in this process, with the functions that build a step's rows and metrics wrapped in a timer
(`trainer.group_results`, `rows.group_rows`, `rows.rollout_rows`, `rows.step_metrics`). The store's own cost is the
run's `store_s` column: the CPU time of the writer thread, which saves each step's rows under pending/ and writes
the steps since its last write to DuckDB every few seconds, while the next step trains. Its CPU time is what it can
take from training on a busy machine (an upper bound: on a second core it overlaps for free).

The last line is (store CPU + row building) / wall time; the goal is at most 3%.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import qae_app.trainer as trainer_module
from qae_app.config import build_config
from qae_app.rundir import db_path
from qae_app.store_read import query


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    for name in ("group_results", "group_rows", "rollout_rows", "step_metrics"):  # as the trainer module calls them
        setattr(trainer_module, name, timed(name, getattr(trainer_module, name)))

    with tempfile.TemporaryDirectory() as runs_dir:
        cfg = build_config(run_name="store", steps=args.steps)
        trainer_module.Trainer(cfg, Path(runs_dir), cpu=True).fit()
        path = db_path(Path(runs_dir), "store")
        run = query(path, "SELECT wall_s, setup_s FROM runs").iloc[0]
        steps = query(path, "SELECT count(*) AS n, sum(store_s) AS store, median(store_s) AS median_store, "
                            "max(store_s) AS max_store, sum(step_s) AS step FROM steps").iloc[0]
        writes = query(path, "SELECT count(*) AS n FROM steps WHERE store_s > 0.01")["n"].item()
    rows_s = sum(spent.values())
    wall = run["wall_s"]
    print(f"{steps['n']} steps in {wall:.1f} s wall ({run['setup_s']:.1f} s start-up, {steps['step']:.1f} s of steps)")
    print(f"store (writer thread CPU): {steps['store']:.2f} s = {steps['store'] / wall:.1%} of the wall time; "
          f"median {steps['median_store'] * 1e3:.2f} ms a step (saving its rows), max "
          f"{steps['max_store'] * 1e3:.0f} ms, {writes} steps over 10 ms (the database writes)")
    print(f"row building: {rows_s:.2f} s = {rows_s / wall:.1%} ("
          + ", ".join(f"{name} {seconds * 1e3 / steps['n']:.2f} ms" for name, seconds in spent.items()) + " a step)")
    print(f"store + row building / wall time: {(steps['store'] + rows_s) / wall:.1%}")


if __name__ == "__main__":
    main()
