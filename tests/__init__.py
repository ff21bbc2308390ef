"""The tests, one folder per package they test (see tests/conftest.py). A package, so test modules in different
folders may share a name (each folder's test_bad_input.py) and helpers import as `tests.synthetic`,
`tests.same_steps`, `tests.dashboard.helpers`."""
