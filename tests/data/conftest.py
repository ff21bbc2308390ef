"""qae_app/data: the math data files and the built-in tasks (arith, add, chain). The fixtures (math_data: the
real math files) are tests/conftest.py's."""
