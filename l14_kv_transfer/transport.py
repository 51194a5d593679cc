"""The wire between the prefill rank and the decode rank: provided, not graded. pd.py decides what
K/V moves and where it lands; this module (with messages.py, what each message holds) moves bytes
and never touches a pool.

Per request, over torch.distributed point-to-point (gloo; every message is matched by tag):

    rank 0 (prefill: a sender thread)               rank 1 (decode: a receiver thread)
    header [kind, index, prompt_len, first token, ──► the decode loop decides: how many leading
      blocks, full blocks, finished, max_new]          blocks it holds, REFUSED (-1: it can never
    prompt ids, keys of the full blocks          ──►   fit) or NOT_NOW (-2: no room yet)
                                                 ◄── that reply
    K/V of the blocks it lacks (one tensor)      ──► received by a waiter of its own
    (NOT_NOW: ask again later, backing off)
    ...
    header with kind END                         ──► nothing more will come

Both sides keep the engine's thread out of gloo: the prefill rank's step never waits for a send,
the decode rank's step never waits for a receive. A payload is received by a waiter thread of its
own, so one late payload never holds the headers behind it.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from l1_contiguous import InputError

from .messages import NOT_NOW, PAYLOAD_BASE, REFUSED, REPLY, PeerLostError, recv_header, send_end

NOT_NOW_WAIT_S, MAX_NOT_NOW_WAIT_S = 0.01, 0.2  # the sender's backoff while the decode rank is full
START_TIMEOUT_S = 120.0  # for the ranks to meet: loading a model may take a while on either side


def short_reason(exc: BaseException) -> str:
    """gloo's error in one short line: its first sentence, without the source path in brackets."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    text = text.split(". This is typically")[0]
    return f"{type(exc).__name__}: {text.split('] ', 1)[-1] if text.startswith('[') else text}"


@dataclass
class DataPath:
    """Where K/V payloads travel. gloo (the default group): through host memory, each payload with a
    tag of its own, so payloads may arrive in any order. NCCL (a second group, one GPU per rank):
    device to device; NCCL has no tags, but a pair's messages arrive in order, so `ordered` is True
    and each side sends and posts its receives in protocol order."""

    group: object = None  # None: the default (gloo) group
    device: str = "cpu"  # where payload tensors live

    @property
    def ordered(self) -> bool:
        return self.group is not None

    def send(self, payload: torch.Tensor, peer: int, tag: int) -> None:
        if self.group is None:
            dist.send(payload, peer, tag=tag)
        else:
            dist.send(payload, peer, group=self.group)

    def irecv(self, payload: torch.Tensor, peer: int, tag: int):
        """Post the receive and return at once; `wait` it (in a thread of its own: gloo's receives
        complete only in wait)."""
        if self.group is None:
            return dist.irecv(payload, peer, tag=tag)
        torch.cuda.set_device(payload.device)  # the current device is per thread
        return dist.irecv(payload, peer, group=self.group)

    def wait(self, work, payload: torch.Tensor) -> None:
        work.wait()
        if self.group is not None:
            torch.cuda.set_device(payload.device)
            torch.cuda.current_stream(payload.device).synchronize()  # arrived before anyone reads it


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


# ---------------------------------------------------------------- rank 0's side

class Sender:
    """A thread that offers jobs to the decode rank one at a time, in order, with
    `offer(job) -> bool` (False: "not now", offered again after a backoff, the jobs behind it
    waiting). Whoever queued them polls `take_done()` for the ids offered (sent or refused) and
    `busy` for whether any is still on its way; a gloo failure surfaces there as PeerLostError."""

    def __init__(self, offer: Callable[[object], bool], job_id: Callable[[object], int]):
        self.offer, self.job_id = offer, job_id
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.unfinished = 0  # queued and not yet taken back through take_done
        self.failure: PeerLostError | None = None
        self.in_transfer = False  # the thread is inside an offer (utilisation is measured against it)
        self.late: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def put(self, job) -> None:
        self.unfinished += 1
        self.jobs.put(job)

    @property
    def busy(self) -> bool:
        return self.unfinished > 0

    def take_done(self) -> set[int]:
        if self.failure is not None:
            raise self.failure
        done = set()
        while True:
            try:
                done.add(self.done.get_nowait())
            except queue.Empty:
                break
        self.unfinished -= len(done)
        return done

    def later(self, delay_s: float, send: Callable[[], None]) -> None:
        """Run `send` after `delay_s` on a thread of its own (a late payload: the jobs behind it go on)."""
        def run():
            time.sleep(delay_s)
            self._guarded(send)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.late.append(thread)

    def close(self, peer: int) -> None:
        """After the last job: wait for every send, then tell the decode rank nothing more will come."""
        self.jobs.put(None)
        self.thread.join()
        for thread in self.late:
            thread.join()
        if self.failure is not None:
            raise self.failure
        self._guarded(lambda: send_end(peer))
        if self.failure is not None:
            raise self.failure

    def _loop(self) -> None:
        while self.failure is None:
            job = self.jobs.get()
            if job is None:
                return
            wait = NOT_NOW_WAIT_S
            while self.failure is None:
                self.in_transfer = True
                offered = self._guarded(lambda: self.offer(job))
                self.in_transfer = False
                if offered:
                    self.done.put(self.job_id(job))
                    break
                time.sleep(wait)  # "not now": the decode rank's pool is full; the engine computes meanwhile
                wait = min(2 * wait, MAX_NOT_NOW_WAIT_S)

    def _guarded(self, call: Callable[[], object]):
        try:
            return call()
        except RuntimeError as exc:  # gloo: connection closed, or no answer within its timeout
            self.failure = PeerLostError(f"lost the decode rank ({short_reason(exc)})")
            return None


# ---------------------------------------------------------------- rank 1's side

class Receiver:
    """The decode rank's every gloo call, on threads: a receiver thread takes each header and puts
    ("header", Header | None) on `inbox`; for a header that is not finished it waits for the
    decode loop's answer on `decisions` (blocks held, REFUSED or NOT_NOW), replies, and for the
    blocks to come posts their receive; a waiter thread per payload puts ("payload", index, bytes)
    on `inbox` when it lands. A peer that is gone puts ("lost", why)."""

    def __init__(self, data: DataPath, peer: int, block_bytes: int):
        self.data, self.peer, self.block_bytes = data, peer, block_bytes
        self.inbox: queue.Queue = queue.Queue()
        self.decisions: queue.Queue = queue.Queue()

    def start(self) -> None:
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
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
                if held not in (REFUSED, NOT_NOW):
                    self._expect_payload(header.index, header.num_blocks - held)
        except Exception as exc:  # the prefill rank is gone (connection closed) or silent past gloo's timeout
            self.inbox.put(("lost", short_reason(exc)))

    def _expect_payload(self, index: int, num_blocks: int) -> None:
        payload = torch.empty(num_blocks * self.block_bytes, dtype=torch.uint8, device=self.data.device)
        if not num_blocks:
            self.inbox.put(("payload", index, payload))
            return
        work = self.data.irecv(payload, self.peer, PAYLOAD_BASE + index)

        def wait():
            try:
                self.data.wait(work, payload)
                self.inbox.put(("payload", index, payload))
            except Exception as exc:
                self.inbox.put(("lost", short_reason(exc)))
        threading.Thread(target=wait, daemon=True).start()
