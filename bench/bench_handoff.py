"""Benchmark: the store's work for one training step, its rows saved under pending/ with an fsync each step (as
before) against without one (synced before each checkpoint instead), the two sides alternating step by step.

    python bench/bench_handoff.py [--steps 200] [--group-size 4]

The rows are a real step's: one `qae train` step at the benchmark settings of bench/vs_trl.py (built-in model, 8 prompts
x --group-size, 8 new tokens, 1 thread) is trained and the tables `fit` hands the store are kept. Then two writers, each
on a run file of its own, take those rows step after step as the store's thread does for `fit`: the previous step's late
timings (`update_step`), the step's rows (`add_step`), `flush_when_due` (a database write when one is due, every few
seconds; else the rows are saved under pending/). "synced each step" is the writer with sync_each_spill on: every file
it saves is synced before its rename (both sides space their database writes by the same rule). A step's time is the
wall time of those three calls, on this thread (bench/vs_trl.py's qae step also waits for the store's thread to wake).
Printed: each side's median and mean ms a step (the mean includes the database writes), and the per-step ratio
(bench/harness.py: the order alternates pair by pair); the median ms a step synced before checkpoints and the ratio go
to the results log.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import alternate, describe, pair_ratios, report, spread

from qae_app.config import build_config
from qae_app.store.writer import RunWriter
from qae_app.train import trainer


class SyncedEachStep(RunWriter):
    """The writer with each saved write synced before its rename, instead of pending/ synced once per checkpoint."""

    sync_each_spill = True


def real_step_tables(group_size: int, runs_dir: Path) -> dict[str, list[dict]]:
    """The tables `fit` handed the store for step 1 of a real run at vs_trl.py's settings."""
    kept = {}
    step_tables = trainer.step_tables

    def keeping(*args, **kwargs):
        tables = step_tables(*args, **kwargs)
        kept.setdefault("tables", tables)
        return tables

    trainer.step_tables = keeping
    try:
        cfg = build_config(
            run_name="rows",
            steps=1,
            prompts_per_step=8,
            group_size=group_size,
            max_new_tokens=8,
            lora_rank=0,
            eval_every=0,
            checkpoint_every=0,
        )
        trainer.Trainer(cfg, runs_dir, cpu=True).fit()
    finally:
        trainer.step_tables = step_tables
    return kept["tables"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps each writer takes (pairs)")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt of the real step's rows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tables = real_step_tables(args.group_size, tmp)
        writers = {}
        for name, kind in (("synced", SyncedEachStep), ("unsynced", RunWriter)):
            writers[name] = kind(tmp / name / "qae.duckdb", name)
            writers[name].create_run(name, {}, "qae", 0.4, "builtin:tiny", "arith", 0)
        timings = {"write_s": 0.001, "checkpoint_s": 0.0, "step_s": 0.1, "store_s": 0.001}

        def side(name: str):
            def one_step(index: int) -> float:
                writer, step = writers[name], index + 1
                start = time.perf_counter()
                if step > 1:
                    writer.update_step(step - 1, **timings)
                writer.add_step(step, **tables)
                writer.flush_when_due()
                return time.perf_counter() - start

            return one_step

        synced, unsynced = alternate(side("synced"), side("unsynced"), args.steps)
        for writer in writers.values():
            writer.flush()
    rows = sum(len(records) for records in tables.values())
    print(
        f"{args.steps} steps each, a real step's rows at G={args.group_size} ({rows} rows), the two writers "
        "alternating step by step"
    )
    for name, times in (("synced each step (before)", synced), ("synced before checkpoints", unsynced)):
        print(
            f"  {name:26s} median {statistics.median(times) * 1e3:.2f} ms a step, mean "
            f"{statistics.mean(times) * 1e3:.2f} ms (database writes included), max {max(times) * 1e3:.0f} ms"
        )
    ratios = pair_ratios(unsynced, synced)
    print(f"after / before per step pair: {describe(ratios)}")
    report(
        f"bench_handoff: store work a step, synced before checkpoints, G={args.group_size}",
        round(statistics.median(unsynced) * 1e3, 3),
        None,
        unit="ms",
        note=f"median of {args.steps} steps; mean {statistics.mean(unsynced) * 1e3:.2f} ms (database writes "
        f"included); synced each step: median {statistics.median(synced) * 1e3:.2f} ms, mean "
        f"{statistics.mean(synced) * 1e3:.2f} ms. Issue 29's goal: the work outside the model at TRL's or "
        "below",
    )
    report(
        f"bench_handoff: synced before checkpoints / synced each step, per step pair, G={args.group_size}",
        round(spread(ratios).median, 4),
        None,
        unit="x",
        spread=spread(ratios),
    )


if __name__ == "__main__":
    main()
