"""Errors caused by what the user asked for, not by a bug: scripts print them in one line, exit 2."""


class InputError(ValueError):
    """Bad input: the message says what was wrong and how to fix it."""


class ModelLoadError(InputError):
    """The model folder cannot be used: missing files, another architecture, bad tensors."""
