"""Prefill and decode in two processes: rank 0 prefills, rank 1 decodes, blocks move between pools.

Per request, over torch.distributed point-to-point (gloo; every message is matched by tag):

    rank 0 (prefill)                                rank 1 (decode)
    prefill, sample the first token
    header [kind, index, prompt_len, first token, ──► plan_receive: the leading blocks it already
      blocks, full blocks, finished, max_new]          holds by key (shared), fresh ones for the
    prompt ids, keys of the full blocks          ──►   rest (-1: it can never fit; -2: not now)
                                                 ◄── how many leading blocks it holds
    K/V of the blocks it lacks (one tensor)      ──► receive: written into its own fresh block
    its blocks freed (cached for later prompts)        ids, adopted, the request decodes
    (on "not now": its blocks kept, asked again
     later, prefilling the others meanwhile)
    ...
    header with kind END                         ──► nothing more will come

Every gloo call on the decode side runs on one receiver thread, so the engine keeps decoding while a
transfer is in flight; the main loop gives each transfer a deadline. A transfer that misses it ends
its request with an error and frees its blocks (a late payload lands in a buffer nobody reads: its
tag is its own); a prefill rank that dies closes the connection, and every request it still owed
ends with an error while the ones already received finish. A decode pool with no room is
backpressure, not a fault: its "not now" keeps every gloo call short however long the pool stays
full, so no timeout mistakes it for a dead peer.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from l1_contiguous import InputError
from l2_paged import OutOfBlocksError, blocks_needed
from l5_eviction import WorkItem
from l5_eviction.lifecycle import State
from l8_prefix import chain_keys

from .connector import KvConnector, read_block, write_block
from .tiers import KEY_BYTES

PREFILL_RANK, DECODE_RANK = 0, 1
NOT_NOW_WAIT_S, MAX_NOT_NOW_WAIT_S = 0.01, 0.2  # the prefill rank's backoff while the decode rank is full
HEADER, REPLY, PAYLOAD_BASE = 0, 1, 100  # tags; a payload's tag is PAYLOAD_BASE + the request's index
KIND_END, KIND_REQUEST = 0, 1
HEADER_LEN = 8
REFUSED = -1  # the decode side's reply when the request can never fit its pool
NOT_NOW = -2  # its reply when the request does not fit now: ask again later (backpressure, not an error)


def short_reason(exc: BaseException) -> str:
    """gloo's error in one short line: its first sentence, without the source path in brackets."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    text = text.split(". This is typically")[0]
    return f"{type(exc).__name__}: {text.split('] ', 1)[-1] if text.startswith('[') else text}"


class PeerLostError(RuntimeError):
    """The other rank closed the connection or did not answer in time."""


class TransferError(RuntimeError):
    """What arrived for a request is not what its header announced."""


@dataclass
class Header:
    index: int
    prompt_ids: list[int]
    first_token: int
    num_blocks: int  # blocks holding the prompt's K/V, the partial last one included
    keys: list[bytes]  # keys of its full blocks
    finished: bool  # the first token ended it (eos, or max_new_tokens 1): no K/V to send
    max_new_tokens: int


@dataclass
class DataPath:
    """Where K/V payloads travel. gloo (the default group): through host memory, each payload with a
    tag of its own. NCCL (a second group, one GPU per rank): device to device; NCCL has no tags, but
    a pair's messages arrive in order and each side sends and receives them in protocol order."""

    group: object = None  # None: the default (gloo) group
    device: str = "cpu"  # where payload tensors live

    def send(self, payload: torch.Tensor, peer: int, tag: int) -> None:
        if self.group is None:
            dist.send(payload, peer, tag=tag)
        else:
            dist.send(payload, peer, group=self.group)

    def recv(self, payload: torch.Tensor, peer: int, tag: int) -> None:
        if self.group is None:
            dist.recv(payload, peer, tag=tag)
            return
        torch.cuda.set_device(payload.device)  # the current device is per thread
        dist.recv(payload, peer, group=self.group)
        torch.cuda.current_stream(payload.device).synchronize()  # arrived before anyone reads it


START_TIMEOUT_S = 120.0  # for the ranks to meet: loading a model may take a while on either side


def init_group(transfer_timeout_s: float, backend: str = "gloo") -> DataPath:
    """Join the two-process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_*): gloo for
    the control messages, and for the payloads gloo or (one GPU per rank) NCCL. gloo's own timeout
    is generous (START_TIMEOUT_S, or 4 transfer timeouts if longer): it covers start-up, where a
    rank may still be loading its model, and a peer that hangs without closing its connection; a
    transfer's deadline is the decode side's own, much shorter."""
    timeout = datetime.timedelta(seconds=max(START_TIMEOUT_S, 4 * transfer_timeout_s))
    if backend == "nccl":
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "2")):
            raise InputError("--dist-backend nccl needs one GPU per rank; with fewer use gloo (K/V staged "
                             "through host memory)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif backend != "gloo":
        raise InputError(f"unknown --dist-backend {backend!r}; choose gloo or nccl")
    dist.init_process_group("gloo", timeout=timeout)
    if backend == "nccl":
        return DataPath(dist.new_group(backend="nccl", timeout=timeout), f"cuda:{torch.cuda.current_device()}")
    return DataPath()


def agree_on_config(config: dict) -> None:
    """Both ranks call this once, right after init_group, with what must be equal on both sides
    (the model's identity, dtype, block size, the workload): InputError on both, naming the first
    difference, before any K/V moves. The configs cross as JSON text, never as pickles: a rank
    does not run what its peer sends."""
    mine = torch.frombuffer(bytearray(json.dumps(config, sort_keys=True).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([mine.numel()]))
    longest = int(max(sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    both = [torch.zeros(longest, dtype=torch.uint8) for _ in range(2)]
    dist.all_gather(both, padded)
    configs = [json.loads(t[:int(n)].numpy().tobytes()) for t, n in zip(both, sizes)]
    for key in config:
        if configs[0].get(key) != configs[1].get(key):
            raise InputError(f"the two ranks were started differently: {key} is {configs[0].get(key)} on rank 0 "
                             f"and {configs[1].get(key)} on rank 1; start both with the same options")


# ---------------------------------------------------------------- the wire

def send_header(h: Header, peer: int) -> None:
    dist.send(torch.tensor([KIND_REQUEST, h.index, len(h.prompt_ids), h.first_token, h.num_blocks, len(h.keys),
                            int(h.finished), h.max_new_tokens], dtype=torch.int64), peer, tag=HEADER)
    dist.send(torch.tensor(h.prompt_ids, dtype=torch.int64), peer, tag=HEADER)
    if h.keys:
        dist.send(torch.frombuffer(bytearray(b"".join(h.keys)), dtype=torch.uint8), peer, tag=HEADER)


def send_end(peer: int) -> None:
    dist.send(torch.zeros(HEADER_LEN, dtype=torch.int64), peer, tag=HEADER)


def recv_header(peer: int) -> Header | None:
    """The next header, or None at the end of the stream."""
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    dist.recv(head, peer, tag=HEADER)
    kind, index, prompt_len, first, num_blocks, num_keys, finished, max_new = head.tolist()
    if kind == KIND_END:
        return None
    ids = torch.zeros(prompt_len, dtype=torch.int64)
    dist.recv(ids, peer, tag=HEADER)
    keys = []
    if num_keys:
        raw = torch.zeros(num_keys * KEY_BYTES, dtype=torch.uint8)
        dist.recv(raw, peer, tag=HEADER)
        data = raw.numpy().tobytes()
        keys = [data[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(num_keys)]
    return Header(index, ids.tolist(), first, num_blocks, keys, bool(finished), max_new)


def pack_blocks(pool, blocks: list[int], device: str = "cpu") -> torch.Tensor:
    """The K/V of `blocks` as one byte tensor on `device`: [n, 2, num_layers, block_size, H_kv, D] in
    the pool's dtype, seen as uint8 (the wire moves bytes; bf16 included)."""
    if not blocks:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.stack([read_block(pool, b) for b in blocks]).to(device).contiguous().view(torch.uint8).flatten()


def unpack_blocks(pool, payload: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Inverse of pack_blocks: [n, 2, num_layers, block_size, H_kv, D] in the pool's dtype."""
    k = pool.k_blocks[0]
    shape = (num_blocks, 2, len(pool.k_blocks), *k.shape[1:])
    return payload.view(k.dtype).view(shape)


# ---------------------------------------------------------------- rank 0: prefill and send

class PdSendConnector(KvConnector):
    """Prefill side: a finished request's blocks are kept (`request_finished` says so) until they
    have been sent; `get_finished` sends what is queued and names the requests whose blocks may go."""

    def __init__(self, pool, block_size: int, max_new_of: dict[int, int], peer: int = DECODE_RANK,
                 stall: dict[int, float] | None = None, on_sent=None, data: DataPath | None = None):
        super().__init__()
        self.pool, self.block_size, self.max_new_of, self.peer = pool, block_size, max_new_of, peer
        self.data = data or DataPath()
        self.stall = stall or {}  # request index -> seconds to wait before its K/V (a fault to inject)
        self.on_sent = on_sent  # callable(index, blocks sent, bytes sent), e.g. to print progress
        self.queued: list = []
        self.blocks_sent = self.bytes_sent = self.blocks_skipped = self.not_now = 0
        self.send_seconds = 0.0

    def request_finished(self, req) -> bool:
        self.queued.append(req)
        return True

    def get_finished(self) -> set[int]:
        """Send the queued requests in order; stop at one the decode side has no room for yet (it
        stays queued, and so do those after it, for a later step). The ids sent (or refused)."""
        done = set()
        while self.queued:
            if not self.send(self.queued[0]):
                break
            done.add(self.queued.pop(0).request_id)
        return done

    def send(self, req) -> bool:
        """False: the decode rank said "not now"; the request keeps its blocks and is asked about again."""
        try:
            return self._send(req)
        except RuntimeError as exc:  # gloo: connection closed, or no answer within its timeout
            raise PeerLostError(f"lost the decode rank while sending request {req.request_id} "
                                f"({short_reason(exc)})") from None

    def _send(self, req) -> bool:
        start = time.perf_counter()
        first = req.output_ids[0]
        finished = req.finish_reason in ("eos", "stop") or self.max_new_of[req.request_id] == 1
        keys = chain_keys(req.prompt_ids, self.block_size)
        header = Header(req.request_id, req.prompt_ids, first, len(req.blocks), keys, finished,
                        self.max_new_of[req.request_id])
        send_header(header, self.peer)
        if not finished:
            reply = torch.zeros(1, dtype=torch.int64)
            dist.recv(reply, self.peer, tag=REPLY)
            held = int(reply)
            if held == NOT_NOW:
                self.not_now += 1
                self.send_seconds += time.perf_counter() - start
                return False
            if held != REFUSED:
                missing = req.blocks[held:]
                payload = pack_blocks(self.pool, missing, self.data.device)
                time.sleep(self.stall.get(req.request_id, 0))
                if missing:
                    self.data.send(payload, self.peer, PAYLOAD_BASE + req.request_id)
                self.blocks_sent += len(missing)
                self.blocks_skipped += held
                self.bytes_sent += payload.numel()
        self.send_seconds += time.perf_counter() - start
        if self.on_sent is not None:
            self.on_sent(req.request_id, header.num_blocks, self.bytes_sent)
        return True


def prefill_items(items: list[WorkItem]) -> list[WorkItem]:
    """What the prefill rank runs: each prompt for its first token only."""
    return [WorkItem(list(w.prompt_ids), 1, w.arrival_step, w.priority, tuple(w.stop_token_ids)) for w in items]


def run_prefill_rank(engine, items: list[WorkItem]) -> dict:
    """Prefill every item on `engine` (an OffloadEngine whose connector is a PdSendConnector),
    sending each as it finishes (each step ends with its finished requests sent: OffloadEngine.step);
    then the end of the stream. While the decode rank has no room, the requests it is asked about
    keep their blocks and this rank goes on prefilling the others; with nothing left to compute it
    waits a little and asks again. Figures for the report."""
    connector = engine.connector
    for item in prefill_items(items):
        engine.add_request(item)
    wait, busy = NOT_NOW_WAIT_S, 0.0
    while engine.has_unfinished() or connector.queued:
        start = time.perf_counter()
        record = engine.step() if engine.has_unfinished() else None
        if record is not None and record.prefill_tokens + record.decode_tokens:
            busy += time.perf_counter() - start
            wait = NOT_NOW_WAIT_S
            continue
        time.sleep(wait)  # nothing computed: the pool is full of blocks the decode rank has no room for yet
        wait = min(2 * wait, MAX_NOT_NOW_WAIT_S)
        engine.release_finished()
    send_end(connector.peer)
    return {"blocks_sent": connector.blocks_sent, "blocks_not_sent_already_held": connector.blocks_skipped,
            "bytes_sent": connector.bytes_sent, "send_seconds": round(connector.send_seconds, 4),
            "not_now_replies": connector.not_now, "step_seconds_computing": round(busy, 4),
            "prefill_tokens_computed": engine.summary()["prefill_tokens_computed"]}


# ---------------------------------------------------------------- rank 1: receive and decode

def plan_receive(alloc, keys: list[bytes], num_blocks: int) -> tuple[list[int], list[int]]:
    """Blocks for a request arriving with `num_blocks` blocks, the first len(keys) of them full and
    named by `keys`: (held, fresh). `held` is the longest leading run this pool already holds by key
    (each now referenced once more); `fresh` are new blocks for the rest, which will be received.
    All or nothing: OutOfBlocksError leaves the allocator as it was."""
    # BEGIN SOLUTION
    held = alloc.lookup(keys)[:num_blocks]
    alloc.acquire(held)
    try:
        fresh = alloc.alloc_blocks(num_blocks - len(held))
    except OutOfBlocksError:
        alloc.free(held)
        raise
    return held, fresh
    # END SOLUTION


def receive(engine, header: Header, held: list[int], fresh: list[int], payload: torch.Tensor):
    """The decode side's last step for one request: `payload` (pack_blocks' bytes, as they came off
    the wire) is the K/V of the blocks this pool lacked, in order, for the `fresh` blocks
    plan_receive gave it; `held` are the leading blocks it already had. Returns the engine's
    request, running from the prefill rank's first token (`engine.adopt_running`), its blocks
    `held + fresh`. A payload that is not exactly `len(fresh)` blocks of this pool (uint8 bytes,
    `bytes_per_block` of them a block) raises TransferError, and then nothing was written or
    adopted."""
    # BEGIN SOLUTION
    expected = len(fresh) * engine.pool.bytes_per_block(engine.model.config, engine.alloc.block_size,
                                                        engine.model.dtype)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise TransferError(f"request {header.index}: {payload.numel()} bytes of {payload.dtype} arrived "
                            f"for {len(fresh)} blocks of {expected // max(len(fresh), 1)} bytes")
    for block, kv in zip(fresh, unpack_blocks(engine.pool, payload, len(fresh))):
        write_block(engine.pool, block, kv)
    item = WorkItem(header.prompt_ids, header.max_new_tokens, engine.now)
    return engine.adopt_running(item, held + fresh, header.first_token)
    # END SOLUTION


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
        self.inbox: queue.Queue = queue.Queue()  # from the receiver thread
        self.decisions: queue.Queue = queue.Queue()  # to it: blocks to receive, or REFUSED
        self.pending: dict[int, tuple[float, Header, list[int], list[int]]] = {}  # index -> deadline, ...
        self.backlog: list[Header] = []  # headers waiting for this loop's answer
        self.stream_over = False
        self.lost = False
        self.blocks_received = self.bytes_received = self.blocks_already_held = self.not_now = 0
        self.no_room_since: dict[int, float] = {}  # index -> when it was first told "not now"
        self.longest_wait_for_room = 0.0
        self.transfer_seconds: list[float] = []
        self.steps: list[tuple[float, int]] = []  # (seconds, tokens decoded) of each engine step

    # the receiver thread: every gloo call of this rank
    def _receive(self) -> None:
        engine = self.engine
        block_bytes = engine.pool.bytes_per_block(engine.model.config, engine.alloc.block_size, engine.model.dtype)
        try:
            while True:
                header = recv_header(self.peer)
                self.inbox.put(("header", header))
                if header is None:
                    return
                if header.finished:
                    continue
                held = self.decisions.get()
                dist.send(torch.tensor([held], dtype=torch.int64), self.peer, tag=REPLY)
                if held in (REFUSED, NOT_NOW):
                    continue
                n = header.num_blocks - held
                payload = torch.empty(n * block_bytes, dtype=torch.uint8, device=self.data.device)
                if n:
                    self.data.recv(payload, self.peer, PAYLOAD_BASE + header.index)
                self.inbox.put(("payload", header.index, payload))
        except Exception as exc:  # the prefill rank is gone (connection closed) or silent past gloo's timeout
            self.inbox.put(("lost", short_reason(exc)))

    def run(self) -> dict[int, DecodeOutcome]:
        threading.Thread(target=self._receive, daemon=True).start()
        while True:
            try:
                # decoding: take only what is there; idle: wait a little for the next message
                message = self.inbox.get(timeout=0 if self.engine.scheduler.running else 0.01)
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
                    self.decisions.put(REFUSED)
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
                self.decisions.put(NOT_NOW)
                continue
            waited = time.monotonic() - self.no_room_since.pop(header.index, time.monotonic())
            self.longest_wait_for_room = max(self.longest_wait_for_room, waited)
            self.pending[header.index] = (time.monotonic() + self.timeout, header, held, fresh)
            self.blocks_already_held += len(held)
            self.decisions.put(len(held))

    def _refuse(self, header: Header, why: str) -> None:
        self.backlog.pop(0)
        self.outcomes[header.index] = DecodeOutcome(header.index, [], "error", why)
        self.decisions.put(REFUSED)

    def _install(self, index: int, payload: torch.Tensor) -> None:
        entry = self.pending.pop(index, None)
        if entry is None:
            return  # it timed out meanwhile: its blocks are gone, and so is its request
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
                "longest_wait_for_room_s": round(self.longest_wait_for_room, 3),
                "decode_prefill_tokens_computed": s["prefill_tokens_computed"] + s["tokens_recomputed"],
                "errors": sum(o.finish_reason == "error" for o in self.outcomes.values())}
