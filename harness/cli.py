"""What a smoke script needs before its heavy imports (torch, transformers): nothing heavy itself.

`starting()` wraps those imports, which take a second or more. A Ctrl-C then ends the process at
once with one line and exit 2 (the contract's "bad input or environment"), not a traceback and 130:
raising KeyboardInterrupt inside an extension's import can abort the interpreter instead.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager


def _exit_interrupted(signum, frame) -> None:
    print("error: interrupted (Ctrl-C) while starting; nothing was run", file=sys.stderr, flush=True)
    os._exit(2)


@contextmanager
def starting():
    previous = signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
