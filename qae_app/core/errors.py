"""Errors a user can fix. The CLI prints their message and exits with code 2."""


class QAEUserError(Exception):
    """Bad input: the message names the field, the value and what to do instead."""


class SaidByTheMainProcess(QAEUserError):
    """An error every process of an `accelerate launch` ends with, which the main process reports: the others exit 2
    without a word, so the user reads it once, not once per process."""
