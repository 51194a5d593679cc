"""Tiers behind the device pool: blocks kept by their chained key (L8's `block_key`), LRU per tier.

    device pool (L8)  ──save──►  tier 0: CPU memory  ──spill──►  tier 1: files  ──►  dropped
         ▲                            │                               │
         └──────── load ◄─────────────┴───────────── load ◄───────────┘   (and promoted to tier 0)

A block in a tier is one tensor `[2, num_layers, block_size, H_kv, D]` (K then V, every layer): the
unit a pool reads and writes. Its key says which tokens, after which prefix, for which model and
cache format (the connector's identity, connector.py) it holds, so any pool (this one later,
another process's) can tell whether it needs it without reading it.

A block that cannot be served (its file missing, cut short, or failing its header or checksum)
raises BlockLoadError and is dropped from its tier: the caller recomputes it. Nothing is served
that was not written whole under that key.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from l1_contiguous import InputError

KEY_BYTES = 16  # l8_prefix.block_key's digest
FILE_MAGIC = "kvblock/2"  # the first word of a block file's header


class BlockLoadError(Exception):
    """A stored block that must not be served: gone, cut short, or not what its header says."""


def checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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

    def discard(self, key: bytes) -> None:
        """Forget a block that failed to load (no eviction: nothing goes down a tier)."""
        if key in self.order:
            del self.order[key]
            self._delete(key)

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
    """Blocks as files `<folder>/<key hex>.kv`: a header line (format, key, dtype, shape, checksum
    of the payload), then the payload's raw bytes.

    - A read checks all of it: a missing, cut, renamed or altered file raises BlockLoadError,
      never gives data.
    - A write goes to a temporary name of its own and is renamed into place, so a reader (this
      process or another sharing the folder) sees the whole file or none; a write that fails (a
      full disk) removes its temporary file and raises OSError.
    - Opened on a folder that already holds blocks (an earlier run's, another process's), it
      indexes them, least recently written first, up to its capacity: a persistent tier.
    - A block another process deleted is a miss (`in` looks at the folder), and a load of it that
      races the deletion raises BlockLoadError like any bad block.
    """

    name = "file"

    def __init__(self, capacity: int, folder: str | Path):
        super().__init__(capacity)
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise InputError(f"{self.folder} is a file; the file tier needs a folder (give another --tier-dir)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.indexed_at_open = self._index_folder()

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.kv"

    def __contains__(self, key: bytes) -> bool:
        return key in self.order and self.path(key).is_file()

    def put(self, key, kv):
        # The block this put evicts is read to go one tier down; if another process deleted its file,
        # forget it (and the next oldest, while gone) instead: one look at the folder, not one a block.
        while self.capacity and len(self.order) >= self.capacity and key not in self.order:
            oldest = next(iter(self.order))
            if self.path(oldest).is_file():
                break
            del self.order[oldest]
        return super().put(key, kv)

    def _index_folder(self) -> int:
        """Index the blocks already in the folder whose header names their file's key (the rest
        are left alone: another run may be writing them); the most recently written are kept."""
        found = []
        for path in self.folder.glob("*.kv"):
            try:
                key = bytes.fromhex(path.stem)
                with open(path, "rb") as f:
                    header = parse_header(f.readline())
                when = path.stat().st_mtime_ns
            except (ValueError, OSError, BlockLoadError):
                continue
            if len(key) == KEY_BYTES and header["key"] == key:
                found.append((when, key))
        kept = sorted(found)[max(0, len(found) - self.capacity):] if self.capacity else []
        for _, key in kept:
            self.order[key] = None
        return len(kept)

    def _write(self, key, kv):
        payload = kv.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        header = (f"{FILE_MAGIC} {key.hex()} {str(kv.dtype).removeprefix('torch.')} "
                  f"{'x'.join(map(str, kv.shape))} {checksum(payload)}\n").encode()
        tmp = self.folder / f".{key.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk, an interrupt: nothing partial stays
            raise

    def _read(self, key):
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise BlockLoadError(f"{path}: {exc.strerror or exc}") from None
        line, _, payload = data.partition(b"\n")
        header = parse_header(line + b"\n")
        if header["key"] != key:
            raise BlockLoadError(f"{path} holds the block of key {header['key'].hex()}")
        expected = header["dtype"].itemsize * int(torch.Size(header["shape"]).numel())
        if len(payload) != expected:
            raise BlockLoadError(f"{path} holds {len(payload)} bytes, its header says {expected}")
        if checksum(payload) != header["checksum"]:
            raise BlockLoadError(f"{path}: the payload's checksum is not its header's")
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(header["dtype"]).view(header["shape"])

    def _delete(self, key):
        self.path(key).unlink(missing_ok=True)  # another process sharing the folder may have deleted it


def parse_header(line: bytes) -> dict:
    """A block file's header line as {key, dtype, shape, checksum}; BlockLoadError if it is not one."""
    try:
        magic, key, dtype_name, dims, digest = line.decode("ascii").split()
        dtype = getattr(torch, dtype_name)
        if magic != FILE_MAGIC or not line.endswith(b"\n") or not isinstance(dtype, torch.dtype):
            raise ValueError
        return {"key": bytes.fromhex(key), "dtype": dtype, "shape": tuple(int(d) for d in dims.split("x")),
                "checksum": digest}
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise BlockLoadError(f"not a block header: {line[:80]!r}") from None


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
        self.load_errors = 0  # stored copies that failed to load, dropped

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
        """The block from the nearest tier holding it (KeyError if none); promoted to tier 0. A
        copy that fails to load is dropped from its tier and counted, and the next tier holding
        the key is tried; BlockLoadError if none could serve it."""
        failed = None
        for i, tier in enumerate(self.tiers):
            if key not in tier:
                continue
            try:
                kv = tier.get(key)
            except BlockLoadError as exc:
                tier.discard(key)
                self.load_errors += 1
                failed = exc
                continue
            self.loads_by_tier[i] += 1
            if i > 0:
                self.save(key, kv)
            return kv
        if failed is not None:
            raise failed
        raise KeyError(key)

    def __contains__(self, key: bytes) -> bool:
        return any(key in t for t in self.tiers)

    def counters(self) -> dict:
        out = {"blocks_dropped": self.dropped, "block_load_errors": self.load_errors}
        for i, t in enumerate(self.tiers):
            out.update({f"{t.name}_blocks": len(t), f"{t.name}_capacity": t.capacity,
                        f"{t.name}_bytes_written": t.bytes_written, f"{t.name}_bytes_read": t.bytes_read,
                        f"{t.name}_evictions": t.evictions, f"{t.name}_blocks_loaded": self.loads_by_tier[i]})
            if isinstance(t, FileTier):
                out["file_blocks_found_at_open"] = t.indexed_at_open
        return out
