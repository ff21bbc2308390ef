"""The tests, one folder per package they test (see tests/conftest.py). A package, so test modules in different
folders may share a name (each folder's test_bad_input.py) and helpers import as `tests.synthetic`,
`tests.same_steps`, `tests.dashboard.helpers`."""

import functools

import typer.testing

# typer's CliRunner builds the app's click command on every invoke: 0.17 s of the 0.25 s an in-process `qae runs`
# takes, over the ~2,400 commands of the plant matrix alone. `qae` builds it once per process, and so do the tests
# (a click command keeps no state between invocations; each gets its own context).
typer.testing._get_command = functools.cache(typer.testing._get_command)
