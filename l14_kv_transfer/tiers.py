"""Tiers behind the device pool: blocks kept by their chained key (L8's `block_key`), LRU per tier.

    device pool (L8)  ──save──►  tier 0: CPU memory  ──spill──►  tier 1: files  ──►  dropped
         ▲                            │                               │
         └──────── load ◄─────────────┴───────────── load ◄───────────┘   (and promoted to tier 0)

A block in a tier is one tensor `[2, num_layers, block_size, H_kv, D]` (K then V, every layer): the
unit a pool reads and writes. Its key says which tokens, after which prefix, it holds, so any pool
(this one later, another process's) can tell whether it needs it without reading it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import torch

from l1_contiguous import InputError

KEY_BYTES = 16  # l8_prefix.block_key's digest


class LruTier:
    """Up to `capacity` blocks by key; `put` past capacity evicts the least recently used.
    `get` and `put` both count as a use. Subclasses say where the bytes live (`_write`, `_read`,
    `_delete`); this class keeps the order and the counters."""

    name = "tier"

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InputError(f"a tier's capacity is a number of blocks >= 0, got {capacity!r}")
        self.capacity = capacity
        self.order: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.bytes_written = self.bytes_read = self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)

    def get(self, key: bytes) -> torch.Tensor:
        """The block stored under `key` (KeyError if absent); it becomes the most recently used."""
        # BEGIN SOLUTION
        if key not in self.order:
            raise KeyError(key)
        kv = self._read(key)
        self.order.move_to_end(key)
        self.bytes_read += kv.numel() * kv.element_size()
        return kv
        # END SOLUTION

    def put(self, key: bytes, kv: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Store `kv` under `key` as the most recently used block. Returns the (key, block) pairs
        evicted to stay within capacity, least recently used first; a key already held is only
        touched (its bytes are the same: equal keys mean equal prefixes). Capacity 0 keeps nothing:
        the block itself comes back as evicted."""
        # BEGIN SOLUTION
        if key in self.order:
            self.order.move_to_end(key)
            return []
        if self.capacity == 0:
            return [(key, kv)]
        evicted = []
        while len(self.order) >= self.capacity:
            old = next(iter(self.order))
            evicted.append((old, self._read(old)))
            self._delete(old)
            del self.order[old]
            self.evictions += 1
        self._write(key, kv)
        self.order[key] = None
        self.bytes_written += kv.numel() * kv.element_size()
        return evicted
        # END SOLUTION

    def clear(self) -> None:
        for key in list(self.order):
            self._delete(key)
        self.order.clear()

    # where the bytes live
    def _write(self, key: bytes, kv: torch.Tensor) -> None:
        raise NotImplementedError

    def _read(self, key: bytes) -> torch.Tensor:
        raise NotImplementedError

    def _delete(self, key: bytes) -> None:
        raise NotImplementedError


class CpuTier(LruTier):
    """Blocks in host memory (pinned when the pool is on a GPU, so copies to it can overlap)."""

    name = "cpu"

    def __init__(self, capacity: int, pin: bool = False):
        super().__init__(capacity)
        self.pin = pin
        self.blocks: dict[bytes, torch.Tensor] = {}

    def _write(self, key, kv):
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.pin)
        host.copy_(kv)  # a copy: the pool's block will be reused, the tier's must not change
        self.blocks[key] = host

    def _read(self, key):
        return self.blocks[key]

    def _delete(self, key):
        del self.blocks[key]


class FileTier(LruTier):
    """Blocks as files `<folder>/<key hex>.kv`: a small header (dtype, shape) then the raw bytes.
    Written to a temporary name and renamed, so a crash mid-write never leaves a file that reads
    as a block; a file whose size disagrees with its header raises OSError, never gives data."""

    name = "file"

    def __init__(self, capacity: int, folder: str | Path):
        super().__init__(capacity)
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise InputError(f"{self.folder} is a file; the file tier needs a folder (give another --tier-dir)")
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def _write(self, key, kv):
        header = f"{str(kv.dtype).removeprefix('torch.')} {' '.join(map(str, kv.shape))}\n".encode()
        tmp = self.path(key).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(kv.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, self.path(key))

    def _read(self, key):
        data = self.path(key).read_bytes()
        head, _, body = data.partition(b"\n")
        dtype_name, *dims = head.decode().split()
        dtype, shape = getattr(torch, dtype_name), tuple(int(d) for d in dims)
        expected = dtype.itemsize * int(torch.Size(shape).numel())
        if len(body) != expected:
            raise OSError(f"{self.path(key)} holds {len(body)} bytes, its header says {expected}")
        return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).view(shape)

    def _delete(self, key):
        self.path(key).unlink(missing_ok=True)


class TieredStore:
    """Tiers nearest first. A block is saved into tier 0; what a tier evicts goes one tier down;
    what the last tier evicts is dropped. A load takes the block from the nearest tier that holds it
    and, if that is not tier 0, puts it back in tier 0 (it is in use again)."""

    def __init__(self, tiers: list[LruTier]):
        if not tiers:
            raise InputError("a tiered store needs at least one tier")
        self.tiers = tiers
        self.loads_by_tier = [0] * len(tiers)  # blocks loaded from each tier
        self.dropped = 0  # blocks evicted from the last tier

    def match(self, keys: list[bytes]) -> list[int]:
        """For the longest run of `keys` from the first that some tier holds: the index of the
        nearest tier holding each. Changes nothing (no recency, no counter): the scheduler may ask
        again next step about the same request."""
        # BEGIN SOLUTION
        found = []
        for key in keys:
            tier = next((i for i, t in enumerate(self.tiers) if key in t), None)
            if tier is None:
                break
            found.append(tier)
        return found
        # END SOLUTION

    def save(self, key: bytes, kv: torch.Tensor) -> None:
        """Put a block in tier 0 and push what each tier evicts one tier down."""
        # BEGIN SOLUTION
        moving = [(key, kv)]
        for tier in self.tiers:
            evicted = []
            for k, block in moving:
                evicted += tier.put(k, block)
            moving = evicted
            if not moving:
                return
        self.dropped += len(moving)
        # END SOLUTION

    def load(self, key: bytes) -> torch.Tensor:
        """The block from the nearest tier holding it (KeyError if none); promoted to tier 0."""
        for i, tier in enumerate(self.tiers):
            if key in tier:
                kv = tier.get(key)
                self.loads_by_tier[i] += 1
                if i > 0:
                    self.save(key, kv)
                return kv
        raise KeyError(key)

    def __contains__(self, key: bytes) -> bool:
        return any(key in t for t in self.tiers)

    def counters(self) -> dict:
        out = {"blocks_dropped": self.dropped}
        for i, t in enumerate(self.tiers):
            out.update({f"{t.name}_blocks": len(t), f"{t.name}_capacity": t.capacity,
                        f"{t.name}_bytes_written": t.bytes_written, f"{t.name}_bytes_read": t.bytes_read,
                        f"{t.name}_evictions": t.evictions, f"{t.name}_blocks_loaded": self.loads_by_tier[i]})
        return out
