"""The arithmetic of L8's fake model (tests/test_l8_property.py), in a module of its own: the test
computes its expected ids with it, and the fake forward (tests/probes_l8.py, which runs where the
engine runs: in the worker when judged) writes and checks K with it. Each process imports its
own copy, so the expected ids never come from the worker."""

from __future__ import annotations

import struct
import zlib

FAKE_VOCAB, FAKE_EOS = 16, 0


def _crc(tokens) -> int:
    return zlib.crc32(struct.pack(f"<{len(tokens)}q", *tokens))


def fingerprint(tokens) -> float:
    """A float32-exact number naming a whole token prefix: the fake 'K' of its last token."""
    return (_crc(tokens) % 2**24) / 2**24


def next_token(tokens) -> int:
    return _crc([7, *tokens]) % FAKE_VOCAB
