"""What every script needs before its heavy imports (torch, transformers): nothing heavy itself.

`starting()` wraps those imports, which take a second or more. A Ctrl-C then ends the process at
once with one line and exit 2 (the contract's "bad input or environment"), not a traceback and 130:
raising KeyboardInterrupt inside an extension's import can abort the interpreter instead.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Callable


_interrupt_received = False
_interrupt_signal = signal.SIGINT  # which one arrived last


def _raise_interrupt(signum, frame) -> None:
    """SIGINT/SIGTERM: remember it, then raise KeyboardInterrupt as Python's own handler does.
    Remembering matters because C code can swallow the KeyboardInterrupt and raise its own error
    instead (torch building a tensor inside safetensors' loader says "could not determine the
    shape of object type ..."): after a Ctrl-C, that error is the Ctrl-C, not a corrupt file."""
    global _interrupt_received, _interrupt_signal
    _interrupt_received, _interrupt_signal = True, signum
    raise KeyboardInterrupt


def watch_interrupts() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt, and `interrupt_received()` says one came."""
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)


def interrupt_received() -> bool:
    """Whether a Ctrl-C or SIGTERM arrived since `watch_interrupts()`."""
    return _interrupt_received


def interruption(signum: int | None = None) -> str:
    """How the error line names the interrupt: a SIGTERM is not a Ctrl-C (under torchrun it is
    the launcher stopping this rank because another one ended)."""
    signum = _interrupt_signal if signum is None else signum
    if signum != signal.SIGTERM:
        return "interrupted (Ctrl-C)"
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for every rank it starts
        return "interrupted (SIGTERM from torchrun: another rank ended, see its lines, or torchrun was stopped)"
    return "interrupted (SIGTERM)"


def _exit_interrupted(signum, frame) -> None:
    say_error(f"{interruption(signum)} while starting; nothing was run")
    os._exit(2)


def exit_interrupted(message: str) -> None:
    """One line, then exit 2 at once. Not `return 2`: if the KeyboardInterrupt passed through code
    that `exec` ran from a string (dataclasses and namedtuples build their methods that way, often
    during a lazy import), CPython remembers it and, at exit, kills itself with SIGINT (status -2)
    even though the exception was caught."""
    try:
        sys.stdout.flush()  # os._exit skips the interpreter's own flush
    except (OSError, ValueError):
        pass
    say_error(message)
    os._exit(2)


def exit_now(status: int) -> None:
    """Exit with `status` at once, output flushed, without the interpreter's teardown: for a process
    whose other threads may sit in a C call that teardown would abort under (a gloo receive)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def guard_startup() -> None:
    """From here until `run_main` starts the work, Ctrl-C (or SIGTERM) ends the process at once
    with one line and exit 2: for scripts whose heavy imports follow at module level."""
    signal.signal(signal.SIGINT, _exit_interrupted)
    signal.signal(signal.SIGTERM, _exit_interrupted)


@contextmanager
def starting():
    previous = signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def sane_streams() -> None:
    """Make printing safe whatever the caller did: a closed stdout or stderr (`>&-`) becomes
    /dev/null (the exit status still tells the result), and characters the terminal's encoding
    lacks (PYTHONIOENCODING=ascii) are escaped instead of raising UnicodeEncodeError."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w"))
        elif hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


def say_error(message: str) -> None:
    """`error: message` on stderr; if even that fails (stderr on a full disk), stay silent: the
    exit status still says 2."""
    try:  # one write: two processes sharing a pipe (torchrun's ranks) never cut each other's line
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (`error: ... (see --help)`), exit 2."""

    def error(self, message):
        say_error(f"{message} (see --help)")
        raise SystemExit(2)


ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOMEM}


def run_main(main: Callable[[], int | None], what: str = "nothing was written") -> int:
    """Run a script's `main` under the exit-code contract: its status; on Ctrl-C (or SIGTERM) one
    line and 2; bad input (an InputError, wherever the work raised it) one line and 2; a full disk
    or a permission problem one line and 2; a closed stdout quietly; any other exception its
    traceback and 3 (a bug)."""
    sane_streams()
    watch_interrupts()
    try:
        status = main()
        sys.stdout.flush()
        return status or 0
    except KeyboardInterrupt:
        exit_interrupted(f"{interruption()}; {what}")
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            return _internal_error(exc, what)
        _quiet_stdout()
        where = f" ({exc.filename})" if exc.filename else ""
        say_error(f"{exc.strerror}{where}; free some space or fix the permissions, then run again")
        return 2
    except Exception as exc:
        if _is_input_error(exc) and not _interrupt_received:  # after a Ctrl-C, any error is the Ctrl-C
            say_error(str(exc))
            return 2
        return _internal_error(exc, what)


def _is_input_error(exc: BaseException) -> bool:
    """Is `exc` the lessons' InputError (bad input, its message says what to fix)? Looked up, not
    imported: this module stays light, and an InputError can only come from a loaded module."""
    errors = sys.modules.get("l1_contiguous.errors")
    return errors is not None and isinstance(exc, errors.InputError)


def _internal_error(exc: BaseException, what: str) -> int:
    """A bug: its traceback and 3. Unless a Ctrl-C caused it: Python wraps a KeyboardInterrupt
    raised inside some hooks (a class body's `__set_name__` during torch's import) in a RuntimeError,
    and C code can swallow it and raise an error of its own (`interrupt_received`)."""
    if _interrupt_received:
        exit_interrupted(f"{interruption()}; {what}")
    cause, seen = exc, set()
    while cause is not None and id(cause) not in seen:  # a chain can loop back on itself
        if isinstance(cause, KeyboardInterrupt):
            exit_interrupted(f"{interruption()}; {what}")
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    traceback.print_exception(exc)
    return 3


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's own flush at exit cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass


def positive_ints(args, names: list[str], parser_error: Callable[[str], None]) -> None:
    """Every option in `names` that is set must be an int >= 1."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser_error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
