"""qae_app/analysis: comparing runs across seeds (qae compare's statistics) and the memory plan (qae plan).
The fixtures are tests/conftest.py's."""
