"""qae_app/evaluation: `qae eval` and its metrics (avg@k, pass@k, maj@k). The fixtures are tests/conftest.py's."""
