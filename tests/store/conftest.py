"""qae_app/store: the DuckDB run file, the trainer's hand-off of rows, the run folder (liveness, locks, checkpoints,
resume) read as data only, and the faults of the machine under it. The fixtures (tiny_run: a real finished run) are
tests/conftest.py's."""
