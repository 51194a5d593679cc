"""The engine loop (lesson L11, §2.2 "One engine, one thread"): the only code that touches the engine.

    HTTP handlers (asyncio thread)              engine thread
    ─────────────────────────────               ───────────────────────────────────────
    submit(item) ──► commands queue ──────────► add_request  (InputError → the handler's future)
    abort(group) ──► commands queue ──────────► abort every unfinished sample of the group
                                                step()   (the forward: seconds of torch, GIL released)
    stream.events ◄── call_soon_threadsafe ◄─── publish: each request's new tokens, finish reasons
    snapshot (read) ◄──────────────────────────  one dict replaced after each step (pool, counts)

The engine is not thread-safe and a step takes milliseconds to seconds, so it runs on its own
thread: the asyncio loop keeps accepting connections and writing tokens while a step computes.
Commands are applied only between steps, which is where continuous batching lets requests join
and leave. When there is no work the thread sleeps on the queue instead of spinning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from l1_contiguous import InputError
from l5_eviction import RequestTooLargeError, State

from .engine import ServeEngine, ServeItem
from .metrics import ServeMetrics

log = logging.getLogger("l11_serve")


@dataclass
class Update:
    """What one step did for one sample of a stream."""

    index: int  # sample index (the choice's index in the response)
    token_ids: list[int]
    finish_reason: str | None = None  # the engine's: eos, stop, length, aborted, error
    logprobs: list = field(default_factory=list)  # a TokenLogprob per id, when the request asked
    prompt_logprobs: list | None = None  # in a sample's first update, when it scored its prompt


@dataclass
class Stream:
    """One HTTP request as the engine thread sees it: n samples under one group id."""

    item: ServeItem
    events: asyncio.Queue  # lists of Update, one list per step (read on the asyncio thread)
    loop: asyncio.AbstractEventLoop
    arrived_at: float = field(default_factory=time.monotonic)
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # -> group id
    group: int = -1
    sent: dict[int, int] = field(default_factory=dict)  # request id -> tokens already published
    finished: set[int] = field(default_factory=set)  # sample indices that finished

    def push(self, updates: list[Update]) -> None:  # from the engine thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, updates)


class EngineLoop:
    def __init__(self, engine: ServeEngine, metrics: ServeMetrics | None = None):
        self.engine, self.metrics = engine, metrics or ServeMetrics()
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[int, Stream] = {}  # group -> stream (engine thread only)
        self.snapshot: dict = self._snapshot()
        self.generated = 0  # tokens published since start (the page's headline)
        self.error: BaseException | None = None  # set if the thread died (a bug): /health says so
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---------------------------------------------------------------- called from the asyncio thread

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def submit(self, item: ServeItem) -> Stream:
        return self.submit_batch([item])[0]

    def submit_batch(self, items: list[ServeItem]) -> list[Stream]:
        """One request's prompts (a batch): the engine thread admits all of them or none, between
        two steps, so a refused batch never decodes a token."""
        streams = [Stream(item, asyncio.Queue(), asyncio.get_running_loop()) for item in items]
        self.commands.put(("add", streams))
        return streams

    def pool_view(self) -> concurrent.futures.Future:
        """The last snapshot with `blocks` (every block's state) added: built by the engine thread
        between two steps, only when someone asks (it walks every block in Python)."""
        view: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():  # no engine thread to race with: read it here
            self._answer_pool(view)
        else:
            self.commands.put(("pool", view))
        return view

    def abort(self, stream: Stream, index: int | None = None, reason: str = "aborted") -> None:
        """Abort sample `index` of the stream, or all of them (None): blocks go back before the next step.
        `reason` is the finish reason the engine books ("stop": the app found a stop string)."""
        self.commands.put(("abort", stream, index, reason))

    def request_stop(self) -> None:
        """After the current step the thread aborts every request (each stream ends, "abort") and exits."""
        self._stop.set()
        self.commands.put(("wake",))

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(wait=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self._stop.is_set():
                    self._step()
            self._abort_all("aborted")
        except BaseException as exc:  # a bug: every stream ends with "error", /health turns 503
            log.exception("engine loop died")
            self.error = exc
            for stream in self.streams.values():
                stream.push([Update(i, [], "error") for i in range(stream.item.n) if i not in stream.finished])
            self.streams.clear()

    def _apply_commands(self, wait: bool) -> None:
        try:
            command = self.commands.get(timeout=0.5) if wait else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command[0] == "add":
                self._add(command[1])
            elif command[0] == "abort":
                self._abort(*command[1:])
            elif command[0] == "pool":
                self._answer_pool(command[1])
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
        self._publish({})

    def _add(self, streams: list[Stream]) -> None:
        added = []
        for k, stream in enumerate(streams):
            try:
                req = self.engine.add_request(stream.item)
            except (InputError, RequestTooLargeError) as exc:
                for taken in added:  # take the batch's earlier prompts back: they never run (their
                    self._abort_group(taken, None)  # streams were never registered: nothing is published)
                refusal = InputError(f"prompt[{k}]: {exc}" if len(streams) > 1 else str(exc))
                for each in streams:
                    each.accepted.set_exception(refusal)
                return
            stream.group = req.group
            added.append(stream)
        for stream in streams:
            self.streams[stream.group] = stream
            self.metrics.prompt_tokens.inc(len(stream.item.prompt_ids))
            stream.accepted.set_result(stream.group)

    def _abort(self, stream: Stream, index: int | None, reason: str) -> None:
        """`_abort_group`, then the samples it ended get `reason` (the engine says "aborted"): a
        sample that ended on a stop string is counted as `stop` in requests_finished_total."""
        running = [r for r in self.engine.requests.values()
                   if r.group == stream.group and r.state is not State.FINISHED]
        self._abort_group(stream, index)
        for req in running:
            if req.state is State.FINISHED and req.finish_reason == "aborted":
                req.finish_reason = reason

    def _abort_group(self, stream: Stream, index: int | None) -> None:
        """Abort the stream's unfinished samples (one sample if `index` is given); every block they hold
        goes back to the pool (a cached prefix block stays cached), and a parent's pending forks are
        never made. The stream is told, once, through `_publish`."""
        # BEGIN SOLUTION
        for req in list(self.engine.requests.values()):
            if req.group == stream.group and req.state is not State.FINISHED \
                    and (index is None or req.sample_index == index):
                self.engine.abort(req.request_id)
        # END SOLUTION

    def _step(self) -> None:
        try:
            self.engine.step()
        except (RuntimeError, ValueError):  # the step was rolled back: fail its requests, not the server
            log.exception("engine step failed; its requests are aborted")
            for stream in list(self.streams.values()):
                self._abort_group(stream, None)
                stream.push([Update(i, [], "error") for i in range(stream.item.n) if i not in stream.finished])
                stream.finished.update(range(stream.item.n))
        self._publish(self._new_tokens())

    def _new_tokens(self) -> dict[int, int]:
        return {rid: len(r.output_ids) - self.streams[r.group].sent.get(rid, 0)
                for rid, r in self.engine.requests.items()
                if r.group in self.streams and len(r.output_ids) > self.streams[r.group].sent.get(rid, 0)}

    def _publish(self, new_tokens: dict[int, int]) -> None:
        """Hand each stream what its samples made; book metrics; forget finished requests and streams."""
        now = time.monotonic()
        self.generated += sum(new_tokens.values())
        arrived = {g: s.arrived_at for g, s in self.streams.items()}
        self.metrics.observe_step(self.engine, new_tokens, arrived, now)
        updates: dict[int, list[Update]] = {}
        for rid, req in self.engine.requests.items():
            stream = self.streams.get(req.group)
            if stream is None or req.sample_index in stream.finished:
                continue
            sent = stream.sent.get(rid, 0)
            reason = req.finish_reason if req.state is State.FINISHED else None
            if len(req.output_ids) > sent or reason:
                scores = req.prompt_token_logprobs if sent == 0 and req.scores_prompt else None
                updates.setdefault(req.group, []).append(
                    Update(req.sample_index, req.output_ids[sent:], reason, req.token_logprobs[sent:], scores))
                stream.sent[rid] = len(req.output_ids)
                if reason:
                    stream.finished.add(req.sample_index)
                    if rid not in new_tokens:
                        self.metrics.request_gone(req)
        for group, batch in updates.items():
            self.streams[group].push(batch)
        for req in self.engine.forget_finished():
            stream = self.streams.get(req.group)
            if stream is not None and len(stream.finished) == stream.item.n:
                del self.streams[req.group]
        self.snapshot = self._snapshot()

    def _abort_all(self, reason: str) -> None:
        for stream in list(self.streams.values()):
            self._abort_group(stream, None)
            stream.push([Update(i, [], reason) for i in range(stream.item.n) if i not in stream.finished])
        self.streams.clear()
        self.engine.forget_finished()
        self.snapshot = self._snapshot()
        while True:  # requests that never reached the engine
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "pool":
                self._answer_pool(command[1])
            for stream in command[1] if command[0] == "add" else []:
                if not stream.accepted.done():
                    stream.accepted.set_exception(InputError("the server is shutting down; try again later"))

    def _snapshot(self) -> dict:
        """The state the live page and /metrics readers see: built here, read anywhere (replaced whole)."""
        e, a = self.engine, self.engine.alloc
        s = e.scheduler
        return {
            "step": e.now, "block_size": a.block_size, "num_blocks": a.num_blocks,
            "running": [_describe(r) for r in s.running],
            "waiting": [_describe(r) for r in [*s.waiting, *s.swapped]],
            "blocks_used": a.num_used, "blocks_free": a.num_free, "blocks_cached": len(a.cached_free),
            "usage": a.num_used / a.num_blocks,
            "hit_rate": e.prefix.prefix_hit_tokens / e.prefix.prefill_tokens_total if e.prefix.prefill_tokens_total else 0.0,
            "prefix_hit_tokens": e.prefix.prefix_hit_tokens,
            "preemptions": e.preemptor.counters.preempted_recompute + e.preemptor.counters.preempted_swap,
            "generation_tokens": getattr(self, "generated", 0),
        }


    def _pool_view(self) -> dict:
        return {**self.snapshot, "blocks": self.engine.pool_state()}

    def _answer_pool(self, view: concurrent.futures.Future) -> None:
        if view.set_running_or_notify_cancel():  # False: the poller gave up waiting (a long step)
            view.set_result(self._pool_view())


def _describe(req) -> dict:
    return {"id": req.request_id, "group": req.group, "sample": req.sample_index, "prompt_tokens": len(req.prompt_ids),
            "output_tokens": len(req.output_ids), "blocks": len(req.blocks), "state": req.state.value}
