"""Errors caused by what the user asked for, not by a bug: scripts print them in one line, exit 2."""


class InputError(ValueError):
    """Bad input: the message says what was wrong and how to fix it."""


class ModelLoadError(InputError):
    """The model folder cannot be used: missing files, another architecture, bad tensors."""


def short_repr(value) -> str:
    """repr(value), cut to 60 characters: what an error message quotes of a bad argument."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def one_line(exc: BaseException) -> str:
    """"Type: first line of the message": how one request's failure is reported without a traceback."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
