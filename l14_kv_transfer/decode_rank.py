"""Rank 1's loop: headers answered, payloads received into fresh blocks, requests decoded.

The decode loop gives each transfer a deadline. A transfer that misses it ends its request with an
error and frees its blocks (a late payload lands in a buffer nobody reads: its tag is its own); a
prefill rank that dies closes the connection, and every request it still owed ends with an error
while the ones already received finish. A decode pool with no room is backpressure, not a fault:
its "not now" keeps every gloo call short however long the pool stays full, so no timeout mistakes
it for a dead peer. What lands where is pd.py's (`plan_receive`, `receive`).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import torch

from l1_contiguous import InputError
from l2_paged import OutOfBlocksError, blocks_needed
from l5_eviction.lifecycle import State
from l8_prefix import chain_keys

from .messages import NOT_NOW, PREFILL_RANK, REFUSED, Header, TransferError
from .pd import plan_receive, receive
from .transport import DataPath, Receiver


@dataclass
class DecodeOutcome:
    index: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class DecodeRank:
    """The decode side's main loop around an engine; see the module's docstring."""

    def __init__(self, engine, num_expected: int, transfer_timeout_s: float = 30.0, peer: int = PREFILL_RANK,
                 data: DataPath | None = None):
        self.engine, self.peer, self.timeout = engine, peer, transfer_timeout_s
        self.data = data or DataPath()
        self.outcomes = {i: DecodeOutcome(i) for i in range(num_expected)}
        self.requests: dict[int, object] = {}  # index -> engine request
        self.pending: dict[int, tuple[float, Header, list[int], list[int]]] = {}  # index -> deadline, ...
        self.backlog: list[Header] = []  # headers waiting for this loop's answer
        self.stream_over = False
        self.lost = False
        self.blocks_received = self.bytes_received = self.blocks_already_held = self.not_now = 0
        self.no_room_since: dict[int, float] = {}  # index -> when it was first told "not now"
        self.longest_wait_for_room = 0.0
        self.transfer_seconds: list[float] = []
        self.received_past_a_late_one = 0  # payloads installed while an earlier request's was still due
        self.steps: list[tuple[float, int]] = []  # (seconds, tokens decoded) of each engine step

    def run(self) -> dict[int, DecodeOutcome]:
        engine = self.engine
        block_bytes = engine.pool.bytes_per_block(engine.model.config, engine.alloc.block_size, engine.model.dtype)
        self.wire = Receiver(self.data, self.peer, block_bytes)
        self.wire.start()
        while True:
            try:
                # decoding: take only what is there; idle: wait a little for the next message
                message = self.wire.inbox.get(timeout=0 if self.engine.scheduler.running else 0.01)
                self._handle(message)
                continue
            except queue.Empty:
                pass
            self._admit_backlog()
            self._expire(time.monotonic())
            if self.engine.scheduler.running or self.engine.scheduler.waiting:
                start = time.perf_counter()
                record = self.engine.step()
                self.steps.append((time.perf_counter() - start, record.decode_tokens))
                self._collect()
            elif self.stream_over and not self.pending and not self.backlog:
                break
        self._collect()
        for outcome in self.outcomes.values():
            if outcome.finish_reason is None:
                outcome.finish_reason, outcome.error = "error", "the prefill rank never sent it"
        return self.outcomes

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "header":
            header = message[1]
            if header is None:
                self.stream_over = True
            elif self.lost:  # given up on already: its outcome stays an error
                if not header.finished:
                    self.wire.decisions.put(REFUSED)
            elif header.finished:
                self.outcomes[header.index] = DecodeOutcome(header.index, [header.first_token], "length")
            else:
                self.backlog.append(header)
                self._admit_backlog()
        elif kind == "payload":
            self._install(message[1], message[2])
        else:
            self._lose(f"lost the prefill rank ({message[1]})")

    def _admit_backlog(self) -> None:
        """Reply to the oldest header (the prefill rank waits for the reply): how many leading
        blocks this pool holds, REFUSED if the request can never run here, or NOT_NOW if its
        blocks do not fit yet (the prefill rank keeps them and asks again: backpressure)."""
        while self.backlog:
            header = self.backlog[0]
            alloc = self.engine.alloc
            own_keys = chain_keys(header.prompt_ids, alloc.block_size)
            if own_keys != header.keys:
                self._refuse(header, "the prefill rank's block keys differ from ours (same block size on both?)")
                continue
            if header.num_blocks != blocks_needed(len(header.prompt_ids), alloc.block_size):
                self._refuse(header, f"{header.num_blocks} blocks cannot hold a prompt of {len(header.prompt_ids)} "
                                     f"tokens in blocks of {alloc.block_size}")
                continue
            try:  # the engine's own rule: its prompt and every token it may decode must fit the pool
                self.engine.scheduler.check(self.engine.request_cls(header.prompt_ids, header.max_new_tokens,
                                                                    request_id=header.index))
            except InputError as exc:
                self._refuse(header, str(exc))
                continue
            self.backlog.pop(0)
            try:
                held, fresh = plan_receive(alloc, header.keys, header.num_blocks)
            except OutOfBlocksError:
                self.not_now += 1
                self.no_room_since.setdefault(header.index, time.monotonic())
                self.wire.decisions.put(NOT_NOW)
                continue
            waited = time.monotonic() - self.no_room_since.pop(header.index, time.monotonic())
            self.longest_wait_for_room = max(self.longest_wait_for_room, waited)
            self.pending[header.index] = (time.monotonic() + self.timeout, header, held, fresh)
            self.blocks_already_held += len(held)
            self.wire.decisions.put(len(held))

    def _refuse(self, header: Header, why: str) -> None:
        self.backlog.pop(0)
        self.outcomes[header.index] = DecodeOutcome(header.index, [], "error", why)
        self.wire.decisions.put(REFUSED)

    def _install(self, index: int, payload: torch.Tensor) -> None:
        if index not in self.pending:
            return  # it timed out meanwhile: its blocks are gone, and so is its request
        self.received_past_a_late_one += next(iter(self.pending)) != index  # pending is in admission order
        entry = self.pending.pop(index)
        deadline, header, held, fresh = entry
        try:
            self.requests[index] = receive(self.engine, header, held, fresh, payload)
        except (TransferError, InputError) as exc:
            self.engine.alloc.free(held + fresh)
            self.outcomes[index] = DecodeOutcome(index, [], "error", str(exc))
            return
        self.blocks_received += len(fresh)
        self.bytes_received += payload.numel()
        self.transfer_seconds.append(self.timeout - (deadline - time.monotonic()))

    def _expire(self, now: float) -> None:
        for index, (deadline, header, held, fresh) in list(self.pending.items()):
            if now > deadline:
                del self.pending[index]
                self.engine.alloc.free(held + fresh)
                self.outcomes[index] = DecodeOutcome(index, [], "error",
                                                     f"transfer timed out after {self.timeout:g} s")

    def _lose(self, why: str) -> None:
        """The prefill rank is gone: whatever it still owed ends with an error, blocks freed."""
        self.stream_over = self.lost = True
        for index, (_, _, held, fresh) in list(self.pending.items()):
            self.engine.alloc.free(held + fresh)
            del self.pending[index]
        self.backlog.clear()
        for index, outcome in self.outcomes.items():
            if index not in self.requests and outcome.finish_reason is None:
                outcome.finish_reason, outcome.error = "error", why

    def _collect(self) -> None:
        for index, req in self.requests.items():
            if req.state is State.FINISHED:
                out = self.outcomes[index]
                out.output_ids, out.finish_reason, out.error = list(req.output_ids), req.finish_reason, req.error

    def figures(self) -> dict:
        s = self.engine.summary()
        return {"blocks_received": self.blocks_received, "bytes_received": self.bytes_received,
                "blocks_already_held": self.blocks_already_held, "not_now_replies": self.not_now,
                "received_past_a_late_one": self.received_past_a_late_one,
                "longest_wait_for_room_s": round(self.longest_wait_for_room, 3),
                "decode_prefill_tokens_computed": s["prefill_tokens_computed"] + s["tokens_recomputed"],
                "errors": sum(o.finish_reason == "error" for o in self.outcomes.values())}
