"""qae_app/core: what the terminal and the dashboard share (the formatting of numbers, durations and a run's
setup). The fixtures are tests/conftest.py's."""
