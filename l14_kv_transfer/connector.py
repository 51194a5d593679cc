"""The connector: what the engine asks of anything that holds K/V outside its pool.

One step, in order (the names are vLLM's KV connector's, whose shape this follows):

    scheduler side                                   worker side
    ──────────────                                   ───────────
    admit a waiting request:
      get_num_new_matched_tokens(req, device_hits)   (no side effect: it may be asked every step)
      ... blocks reserved for hits + external + new ...
      update_state_after_alloc(req, external)        (now the load is promised)
    build_connector_meta(plan)  ────────────────►    start_load_kv(meta, pool)    before the forward
                                                     forward
                                                     wait_for_save(meta, pool)    after the forward
    a request finishes:
      request_finished(req) -> keep its blocks?      get_finished() -> ids whose blocks may go

Loads here are synchronous copies, so "start" returns with the blocks in place; an engine that
overlaps them with the forward waits per layer before reading it (vLLM's `wait_for_layer_load`).
A load that fails (a block gone, cut or altered) is not an error of the step: `take_load_failures`
names each request's first position that must be computed after all, and the engine recomputes
from there (vLLM's `get_block_ids_with_load_errors`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

import torch

from l8_prefix import chain_keys, tagged_key

from .tiers import BlockLoadError, TieredStore

MODES = ("write-through", "write-back")


@dataclass
class LoadJob:
    request_id: int
    blocks: list[int]  # the request's own block ids, to be filled ...
    keys: list[bytes]  # ... with the blocks stored under these keys, in order
    first_position: int = 0  # the token position the first of them starts at


@dataclass
class ConnectorMeta:
    """What the worker does this step: loads before the forward, saves (block id, key) after it."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class ConnectorCounters:
    tokens_loaded: int = 0  # prompt tokens whose K/V came from outside instead of being computed
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    blocks_saved: int = 0
    bytes_saved: int = 0
    blocks_failed: int = 0  # loads that failed: those blocks were computed instead
    save_errors: int = 0  # saves the store could not take (a full disk): the block is just not kept


class KvConnector:
    """No external K/V: every call is a no-op. The engine calls these whatever the connector."""

    def __init__(self):
        self.counters = ConnectorCounters()

    # scheduler side
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, plan) -> ConnectorMeta:
        return ConnectorMeta()

    def request_finished(self, req) -> bool:
        """True: the request's blocks must outlive it until `get_finished` names it (a send)."""
        return False

    # worker side
    def start_load_kv(self, meta: ConnectorMeta, pool) -> None:
        pass

    def wait_for_save(self, meta: ConnectorMeta, pool) -> None:
        pass

    def get_finished(self) -> set[int]:
        return set()

    def take_load_failures(self) -> dict[int, int]:
        """Request id -> the first position whose K/V this step's loads could not provide; cleared."""
        return {}

    def on_device_evict(self, block: int, key: bytes, pool) -> None:
        """The pool is about to reuse a cached free block (write-back saves it here)."""


def kv_identity(model, block_size: int, dtype: torch.dtype, cache_tag: bytes = b"") -> bytes:
    """What a block's bytes are K/V of: the model (its config, and its weights' sum and sum of
    squares: any change of weights changes them, and packing a layer's matrices does not), the
    pool's dtype and block size, and a cache format's tag (L12's scales). A store shared by
    several pools serves a block only to a pool of equal identity (`OffloadConnector.store_key`)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str).encode())
    with torch.no_grad():
        sums = [(p.double().sum().item(), p.double().square().sum().item()) for p in model.parameters()]
    h.update(repr([round(sum(s for s, _ in sums), 6), round(sum(q for _, q in sums), 6)]).encode())
    h.update(f"{dtype} {block_size}".encode() + cache_tag)
    return h.digest()


def block_shape(cfg, block_size: int) -> tuple[int, ...]:
    """The shape of one block as read_block gives it: [2, num_layers, block_size, H_kv, D]."""
    return (2, cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)


def read_block(pool, block: int) -> torch.Tensor:
    """One block of the pool, every layer: [2, num_layers, block_size, H_kv, D] (a copy)."""
    return torch.stack([torch.stack([kb[block] for kb in pool.k_blocks]),
                        torch.stack([vb[block] for vb in pool.v_blocks])])


def write_block(pool, block: int, kv: torch.Tensor) -> None:
    """Fill one block of the pool from a [2, num_layers, block_size, H_kv, D] tensor (any device)."""
    for layer, (kb, vb) in enumerate(zip(pool.k_blocks, pool.v_blocks)):
        kb[block].copy_(kv[0, layer])
        vb[block].copy_(kv[1, layer])


class OffloadConnector(KvConnector):
    """Full blocks kept in a TieredStore under their chained keys, and loaded back on a prefix hit
    that the device pool no longer has. write-through: a block is saved as soon as it is full;
    write-back: only when the device pool evicts it (cheaper while it stays, lost if the process
    ends)."""

    def __init__(self, store: TieredStore, block_size: int, mode: str = "write-through", identity: bytes = b"",
                 block_shape: tuple | None = None, dtype: torch.dtype | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown offload mode {mode!r}; choose {' or '.join(MODES)}")
        super().__init__()
        self.store, self.block_size, self.mode = store, block_size, mode
        self.identity = identity  # kv_identity(...): the model and cache format the K/V belongs to
        self.block_shape, self.dtype = block_shape, dtype  # what a loaded block must be (None: unchecked)
        self.pending_loads: dict[int, LoadJob] = {}  # promised by update_state_after_alloc
        self.load_failures: dict[int, int] = {}  # request id -> first position to compute after all

    def store_key(self, key: bytes) -> bytes:
        """An L8 block key as the store knows it: inside this connector's identity, so a block of
        another model, dtype, block size or cache tag never matches."""
        return tagged_key(self.identity, key) if self.identity else key

    def store_keys(self, tokens: list[int]) -> list[bytes]:
        """The store's keys of every full block of `tokens`."""
        return [self.store_key(k) for k in chain_keys(tokens, self.block_size)]

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        """Prompt tokens past the `num_computed_tokens` the device already holds whose blocks the
        store holds: whole blocks, a run from the first missing one, never the block of the
        request's last token (it must be computed to give logits). Changes nothing. The store
        knows blocks by this connector's keys (`store_keys`), not by L8's plain ones."""
        # BEGIN SOLUTION
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0
        keys = self.store_keys(req.tokens[:-1])
        return len(self.store.match(keys[num_computed_tokens // bs:])) * bs
        # END SOLUTION

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        """The request was admitted with `num_external_tokens` to load (its cur_len already counts
        them, its blocks cover them): remember which of its blocks get which keys."""
        if not num_external_tokens:
            return
        bs = self.block_size
        end = req.cur_len // bs  # the loaded run ends where the device's hits + external end
        first = end - num_external_tokens // bs
        keys = self.store_keys(req.tokens[:end * bs])[first:]
        self.pending_loads[req.request_id] = LoadJob(req.request_id, req.blocks[first:end], keys, first * bs)

    def build_connector_meta(self, plan) -> ConnectorMeta:
        """This step's work: the loads promised for requests in the plan, and (write-through) a save
        for every block the forward fills completely that the store does not hold yet, under the
        store's key for it (`store_keys`)."""
        # BEGIN SOLUTION
        meta = ConnectorMeta()
        bs = self.block_size
        for req, n in plan:
            job = self.pending_loads.pop(req.request_id, None)
            if job is not None:
                meta.loads.append(job)
            if self.mode != "write-through":
                continue
            first, end = req.cur_len // bs, (req.cur_len + n) // bs  # blocks full after this step
            if end <= first:
                continue
            keys = self.store_keys(req.tokens[:end * bs])
            meta.saves += [(req.blocks[i], keys[i]) for i in range(first, end) if keys[i] not in self.store]
        return meta
        # END SOLUTION

    def start_load_kv(self, meta: ConnectorMeta, pool) -> None:
        """Fill each job's blocks in order; at the first block that cannot be loaded, stop that
        job: it and the blocks after it are computed instead (take_load_failures)."""
        for job in meta.loads:
            for i, (block, key) in enumerate(zip(job.blocks, job.keys)):
                kv = self._load(key)
                if kv is None:
                    self.load_failures[job.request_id] = job.first_position + i * self.block_size
                    self.counters.blocks_failed += len(job.blocks) - i
                    break
                write_block(pool, block, kv)
                self.counters.blocks_loaded += 1
                self.counters.bytes_loaded += kv.numel() * kv.element_size()
                self.counters.tokens_loaded += self.block_size

    def _load(self, key: bytes) -> torch.Tensor | None:
        """The stored block, or None if it cannot be served into this pool: gone, corrupt, or of
        another shape or dtype (`copy_` would convert it silently)."""
        try:
            kv = self.store.load(key)
        except (KeyError, BlockLoadError):
            return None
        if (self.block_shape is not None and tuple(kv.shape) != tuple(self.block_shape)) or \
                (self.dtype is not None and kv.dtype != self.dtype):
            return None
        return kv

    def take_load_failures(self) -> dict[int, int]:
        failures, self.load_failures = self.load_failures, {}
        return failures

    def wait_for_save(self, meta: ConnectorMeta, pool) -> None:
        for block, key in meta.saves:
            self._save(block, key, pool)

    def on_device_evict(self, block: int, key: bytes, pool) -> None:
        if self.mode == "write-back":
            self._save(block, self.store_key(key), pool)

    def _save(self, block: int, key: bytes, pool) -> None:
        if key in self.store:
            return
        kv = read_block(pool, block)
        try:
            self.store.save(key, kv)
        except (OSError, BlockLoadError):  # a full disk, a file another process deleted: not kept, the step goes on
            self.counters.save_errors += 1
            return
        self.counters.blocks_saved += 1
        self.counters.bytes_saved += kv.numel() * kv.element_size()
