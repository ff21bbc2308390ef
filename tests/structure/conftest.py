"""The repository as a whole rather than one package: the package layers (which imports which), the README kept
true, and the bench/ helper the benchmarks report with. The fixtures are tests/conftest.py's."""
