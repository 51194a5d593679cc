"""Two ways to take a running request's blocks away, and to bring it back.

recompute: free the blocks; later prefill prompt + generated tokens again (costs compute).
swap:      copy the blocks' K/V to host memory, free them; later allocate fresh blocks (any ids)
           and copy the K/V back (costs two copies over PCIe and host memory, no compute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from l2_paged import BlockAllocator, blocks_needed, release, reserve
from l3_block_kernel import BlockKvPool

from .lifecycle import EngineRequest, State, SwappedKv

MODES = ("recompute", "swap")


@dataclass
class PreemptCounters:
    preempted_recompute: int = 0
    preempted_swap: int = 0
    tokens_recomputed: int = 0  # K/V entries dropped that must be computed again
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0


class Preemptor:
    def __init__(self, pool: BlockKvPool, alloc: BlockAllocator, mode: str = "recompute"):
        if mode not in MODES:
            raise ValueError(f"unknown preemption mode {mode!r}; choose recompute or swap")
        self.pool, self.alloc, self.mode = pool, alloc, mode
        self.counters = PreemptCounters()
        self._events: list[int] = []  # request ids preempted since the last take_events()

    def preempt(self, req: EngineRequest) -> None:
        req.num_preemptions += 1
        self._events.append(req.request_id)
        if self.mode == "swap" and req.cur_len > 0:
            self.swap_out(req)
        else:
            self.drop_for_recompute(req)

    def take_events(self) -> list[int]:
        events, self._events = self._events, []
        return events

    def drop_for_recompute(self, req: EngineRequest) -> None:
        # BEGIN SOLUTION
        self.counters.preempted_recompute += 1
        self.counters.tokens_recomputed += req.cur_len
        release(req, self.alloc)
        req.cur_len = 0
        req.state = State.WAITING
        # END SOLUTION

    def swap_out(self, req: EngineRequest) -> None:
        # BEGIN SOLUTION
        trim(req, self.alloc)  # only blocks holding K/V travel
        ids = torch.tensor(req.blocks, dtype=torch.int64, device=self.pool.K[0].device)
        pin = ids.is_cuda  # pinned host memory makes the copy back asynchronous-capable and faster
        req.swapped = SwappedKv(k=[to_host(kb[ids], pin) for kb in self.pool.k_blocks],
                                v=[to_host(vb[ids], pin) for vb in self.pool.v_blocks])
        self.counters.preempted_swap += 1
        self.counters.bytes_swapped_out += req.swapped.nbytes
        release(req, self.alloc)
        req.state = State.SWAPPED
        # END SOLUTION

    def blocks_to_swap_in(self, req: EngineRequest) -> int:
        return blocks_needed(req.cur_len, self.alloc.block_size)

    def swap_in(self, req: EngineRequest) -> None:
        """Allocate fresh blocks (OutOfBlocksError leaves everything as it was) and copy K/V back."""
        # BEGIN SOLUTION
        reserve(req, self.alloc, req.cur_len)
        ids = torch.tensor(req.blocks, dtype=torch.int64, device=self.pool.K[0].device)
        for layer, (k, v) in enumerate(zip(req.swapped.k, req.swapped.v)):
            self.pool.k_blocks[layer][ids] = k.to(ids.device, non_blocking=True)
            self.pool.v_blocks[layer][ids] = v.to(ids.device, non_blocking=True)
        self.counters.bytes_swapped_in += req.swapped.nbytes
        req.swapped = None
        req.state = State.RUNNING
        # END SOLUTION

    def discard(self, req: EngineRequest) -> None:
        """Abort: drop whatever the request holds, in the pool or on the host."""
        if req.blocks:
            release(req, self.alloc)
        req.swapped = None


def trim(req: EngineRequest, alloc: BlockAllocator) -> None:
    """Free blocks reserved beyond the positions that hold K/V (swap_out: only those travel)."""
    keep = blocks_needed(req.cur_len, alloc.block_size)
    if len(req.blocks) > keep:
        alloc.free(req.blocks[keep:])
        del req.blocks[keep:]
        del req.slot_indices[keep * alloc.block_size:]


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """`t` is a fresh gather of the victim's blocks; on a CPU pool it already is the host copy."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t)
    return host
