"""L11's probes (see probes.py: under the judge, imported in the worker, beside the server and its
engine loop). What changes how the engine thread runs (holding its first step, slowing each step)
must run in the thread's own process; the judge's functions can only be called while the judge
waits for a reply, and the engine thread calls whenever it likes. The stand-in engines that
`observe_step` reads are built here too: the worker may call the judge's objects, never read them."""

from __future__ import annotations

import time
from types import SimpleNamespace

from l5_eviction import State
from probes import Recorded


def load_tokenizer(model_dir):
    """The model's tokenizer, in the process of the code that is handed it (L11's StopMatcher): the
    server's own (harness.text_tokenizer), since the worker has no transformers."""
    from harness.text_tokenizer import load_tokenizer as load

    return load(model_dir)


def hold_until_queued(loop, count: int, limit_s: float = 60.0) -> None:
    """The engine thread takes no step until `count` requests are in the engine (or `limit_s` passes)."""
    real_step, deadline, started = loop._step, time.monotonic() + limit_s, []

    def step():
        if started or len(loop.engine.requests) >= count or time.monotonic() > deadline:
            started.append(True)
            real_step()
        else:
            time.sleep(0.005)  # back to the loop, which applies the next add

    loop._step = step


def hold_the_first_loop_until_queued(count: int) -> None:
    """The first EngineLoop started from now on holds its first step until `count` requests are in
    (a smoke script builds its loop itself); `EngineLoop.start` is restored by `release_loop_start`."""
    from l11_serve.loop import EngineLoop

    real_start = EngineLoop.start
    held = []

    def start(self, *args, **kwargs):
        if not held:
            hold_until_queued(self, count)
            held.append(self)
        return real_start(self, *args, **kwargs)

    start.real_start, start.held = real_start, held
    EngineLoop.start = start


def release_loop_start() -> bool:
    """Undo `hold_the_first_loop_until_queued`; whether a loop was held."""
    from l11_serve.loop import EngineLoop

    start = EngineLoop.start
    EngineLoop.start = start.real_start
    return bool(start.held)


def slow_steps(loop, seconds: float) -> None:
    """Each engine step waits `seconds` first (a wait long enough to observe on any machine)."""
    real_step = loop._step

    def step():
        time.sleep(seconds)
        real_step()

    loop._step = step


def fake_engine(running=(), waiting=(), swapped=(), requests=None, sharing=True) -> SimpleNamespace:
    """What observe_step reads of an engine, set by hand: a pool of 8 blocks, 3 used, 1 cached."""
    return SimpleNamespace(
        alloc=SimpleNamespace(num_blocks=8, num_used=3, num_free=5, cached_free={7: None}),
        scheduler=SimpleNamespace(running=list(running), waiting=list(waiting), swapped=list(swapped)),
        prefix=SimpleNamespace(prefill_tokens_total=0, prefix_hit_tokens=0),
        preemptor=SimpleNamespace(counters=SimpleNamespace(preempted_recompute=0, preempted_swap=0)),
        requests=requests or {}, sharing=sharing)


def fake_request(group: int, sample: int = 0, reason: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(group=group, sample_index=sample, finish_reason=reason,
                           state=State.FINISHED if reason else State.RUNNING)


def admit(engine, request_id: int, req) -> None:
    """A stand-in engine gains a running request (its dicts and lists stay in this process)."""
    engine.requests[request_id] = req
    engine.scheduler.running.append(req)


class CountingTokenizer:
    """The model's tokenizer, with every `decode` call's number of ids recorded (in the process of
    the StopMatcher that calls it): how a test sees that each token costs the decode of a few ids,
    not of the whole output."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, Recorded()

    def decode(self, ids, *args, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def counting_tokenizer(model_dir) -> CountingTokenizer:
    return CountingTokenizer(load_tokenizer(model_dir))
