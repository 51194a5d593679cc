"""Prefill and decode in two processes: rank 0 prefills, rank 1 decodes, blocks move between pools.

What moves and where it lands is here; how the bytes travel (gloo or NCCL, the threads that keep
both engines computing while K/V is on the wire) is transport.py's. Per request: rank 0 prefills
and samples the first token; its header (prompt, first token, block keys) reaches rank 1, which
answers with how many leading blocks it already holds (`plan_receive`: shared by key), or "not now"
while its pool has no room (backpressure: rank 0 keeps the blocks, goes on prefilling others and
asks again), or "never" (the request cannot fit); rank 0 sends the K/V of the blocks rank 1 lacks,
and rank 1 writes them into its own block ids and adopts the request, which decodes there
(`receive`); rank 1's loop around them, with its deadlines, is decode_rank.py.
"""

from __future__ import annotations

import time

import torch

from l2_paged import OutOfBlocksError
from l5_eviction import WorkItem
from l8_prefix import chain_keys

from .connector import KvConnector, read_block, write_block
from .messages import DECODE_RANK, NOT_NOW, PAYLOAD_BASE, REFUSED, Header, TransferError, ask
from .transport import DataPath, Sender


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
    """Prefill side: a finished request's blocks are kept (`request_finished` says so) and handed to
    a sender thread (transport.Sender); `get_finished` names the requests whose blocks may go: those
    whose K/V has been copied out of the pool for the wire (or was refused). The engine's step never
    waits for the wire."""

    def __init__(self, pool, block_size: int, max_new_of: dict[int, int], peer: int = DECODE_RANK,
                 stall: dict[int, float] | None = None, on_sent=None, data: DataPath | None = None):
        super().__init__()
        self.pool, self.block_size, self.max_new_of, self.peer = pool, block_size, max_new_of, peer
        self.data = data or DataPath()
        self.stall = stall or {}  # request index -> seconds its payload is held back (a fault to inject)
        self.on_sent = on_sent  # callable(index, blocks in its table, bytes sent so far), e.g. to print progress
        self.sender = Sender(self.offer, lambda req: req.request_id)
        self.blocks_sent = self.bytes_sent = self.blocks_skipped = self.not_now = 0
        self.send_seconds = 0.0

    def request_finished(self, req) -> bool:
        self.sender.put(req)
        return True

    def get_finished(self) -> set[int]:
        return self.sender.take_done()

    def offer(self, req) -> bool:
        """On the sender thread: the header, then (unless refused) the K/V of the blocks the decode
        rank lacks. False: it said "not now"; the request keeps its blocks and is offered again."""
        start = time.perf_counter()
        max_new = self.max_new_of[req.request_id]
        finished = req.finish_reason in ("eos", "stop") or max_new == 1
        header = Header(req.request_id, req.prompt_ids, req.output_ids[0], len(req.blocks),
                        chain_keys(req.prompt_ids, self.block_size), finished, max_new)
        held = ask(header, self.peer)
        if held == NOT_NOW:
            self.not_now += 1
        else:
            missing = req.blocks[held:] if held != REFUSED and not finished else []
            payload = pack_blocks(self.pool, missing, self.data.device)  # a copy: the blocks may go now
            self.blocks_sent += len(missing)
            self.blocks_skipped += max(held, 0)
            stall = self.stall.get(req.request_id, 0) if missing else 0
            if stall and not self.data.ordered:  # gloo: tagged, so the requests behind it go on
                self.sender.later(stall, lambda: self.send_payload(header, payload))
            else:
                time.sleep(stall)  # NCCL keeps protocol order: the ones behind it wait too
                self.send_payload(header, payload)
        self.send_seconds += time.perf_counter() - start
        return held != NOT_NOW

    def send_payload(self, header: Header, payload: torch.Tensor) -> None:
        if payload.numel():  # none when refused, finished, or every block already held there
            self.data.send(payload, self.peer, PAYLOAD_BASE + header.index)
        self.bytes_sent += payload.numel()
        if self.on_sent is not None:
            self.on_sent(header.index, header.num_blocks, self.bytes_sent)


def prefill_items(items: list[WorkItem]) -> list[WorkItem]:
    """What the prefill rank runs: each prompt for its first token only."""
    return [WorkItem(list(w.prompt_ids), 1, w.arrival_step, w.priority, tuple(w.stop_token_ids)) for w in items]


def run_prefill_rank(engine, items: list[WorkItem], idle_wait_s: float = 0.005) -> dict:
    """Prefill every item on `engine` (an OffloadEngine whose connector is a PdSendConnector): each
    finished request goes to the sender thread and its blocks are freed once its K/V is copied out;
    then the end of the stream. While the decode rank has no room, the requests it was offered keep
    their blocks and this rank goes on prefilling the others. Figures for the report, with how much
    of the computing happened while a transfer was on the wire."""
    connector = engine.connector
    for item in prefill_items(items):
        engine.add_request(item)
    busy = busy_while_sending = 0.0
    while engine.has_unfinished() or connector.sender.busy:
        engine.skip_idle_steps()
        sending, start = connector.sender.in_transfer, time.perf_counter()
        record = engine.step() if engine.has_unfinished() else None
        if record is not None and record.prefill_tokens + record.decode_tokens:
            busy += time.perf_counter() - start
            busy_while_sending += (time.perf_counter() - start) * (sending or connector.sender.in_transfer)
            continue
        time.sleep(idle_wait_s)  # nothing to compute: waiting for the sender (or for room on the decode rank)
        engine.release_finished()
    connector.sender.close(connector.peer)
    return {"blocks_sent": connector.blocks_sent, "blocks_not_sent_already_held": connector.blocks_skipped,
            "bytes_sent": connector.bytes_sent, "send_seconds": round(connector.send_seconds, 4),
            "not_now_replies": connector.not_now, "step_seconds_computing": round(busy, 4),
            "step_seconds_while_sending": round(busy_while_sending, 4),
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
