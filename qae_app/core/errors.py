"""Errors a user can fix. The CLI prints their message and exits with code 2."""


class QAEUserError(Exception):
    """Bad input: the message names the field, the value and what to do instead."""
