"""qae_app/cli: the commands as a user runs them (in-process with typer's CliRunner, or as processes), their
terminal views against the snapshots in snapshots/, and `qae sweep` / `qae compare`. The fixtures are
tests/conftest.py's."""
