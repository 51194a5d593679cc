"""Helpers for L11's tests: a server on the embedded model, SSE parsing, waiting for an idle engine."""

from __future__ import annotations

import json
import time

from l5_eviction import State

TIMEOUT_S = 60  # every HTTP call in L11's tests gives up after this; no test waits longer


def sse_chunks(lines) -> list[dict | str]:
    """The JSON objects of an SSE body, and the final "[DONE]" as a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(loop, timeout: float = TIMEOUT_S) -> None:
    """Until the engine holds no request and the loop no stream (aborts are applied between steps)."""
    deadline = time.monotonic() + timeout
    while loop.engine.requests or loop.streams or loop.engine.alloc.num_used:
        assert loop.error is None, f"the engine loop died: {loop.error!r}"
        assert time.monotonic() < deadline, (f"engine not idle after {timeout} s: {len(loop.engine.requests)} "
                                             f"requests, {loop.engine.alloc.num_used} blocks used")
        time.sleep(0.02)


def assert_no_leak(loop) -> None:
    """Every block free or cached-free, every reference count zero, the allocator's invariants hold."""
    engine, alloc = loop.engine, loop.engine.alloc
    alloc.check()
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks
    assert all(c == 0 for c in alloc.ref_count)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.swapped
    assert all(r.state is State.FINISHED for r in engine.requests.values())
    assert not loop.streams and loop.commands.empty()
