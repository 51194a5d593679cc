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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from l8_prefix import chain_keys

from .tiers import TieredStore

MODES = ("write-through", "write-back")


@dataclass
class LoadJob:
    request_id: int
    blocks: list[int]  # the request's own block ids, to be filled ...
    keys: list[bytes]  # ... with the blocks stored under these keys, in order


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

    def on_device_evict(self, block: int, key: bytes, pool) -> None:
        """The pool is about to reuse a cached free block (write-back saves it here)."""


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

    def __init__(self, store: TieredStore, block_size: int, mode: str = "write-through"):
        if mode not in MODES:
            raise ValueError(f"unknown offload mode {mode!r}; choose {' or '.join(MODES)}")
        super().__init__()
        self.store, self.block_size, self.mode = store, block_size, mode
        self.pending_loads: dict[int, LoadJob] = {}  # promised by update_state_after_alloc

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        """Prompt tokens past the `num_computed_tokens` the device already holds whose blocks the
        store holds: whole blocks, a run from the first missing one, never the block of the
        request's last token (it must be computed to give logits). Changes nothing."""
        # BEGIN SOLUTION
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0
        keys = chain_keys(req.tokens[:-1], bs)
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
        keys = chain_keys(req.tokens[:end * bs], bs)[first:]
        self.pending_loads[req.request_id] = LoadJob(req.request_id, req.blocks[first:end], keys)

    def build_connector_meta(self, plan) -> ConnectorMeta:
        """This step's work: the loads promised for requests in the plan, and (write-through) a save
        for every block the forward fills completely that the store does not hold yet."""
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
            keys = chain_keys(req.tokens[:end * bs], bs)
            meta.saves += [(req.blocks[i], keys[i]) for i in range(first, end) if keys[i] not in self.store]
        return meta
        # END SOLUTION

    def start_load_kv(self, meta: ConnectorMeta, pool) -> None:
        for job in meta.loads:
            for block, key in zip(job.blocks, job.keys):
                kv = self.store.load(key)
                write_block(pool, block, kv)
                self.counters.blocks_loaded += 1
                self.counters.bytes_loaded += kv.numel() * kv.element_size()
            self.counters.tokens_loaded += len(job.blocks) * self.block_size

    def wait_for_save(self, meta: ConnectorMeta, pool) -> None:
        for block, key in meta.saves:
            self._save(block, key, pool)

    def on_device_evict(self, block: int, key: bytes, pool) -> None:
        if self.mode == "write-back":
            self._save(block, key, pool)

    def _save(self, block: int, key: bytes, pool) -> None:
        if key in self.store:
            return
        kv = read_block(pool, block)
        self.store.save(key, kv)
        self.counters.blocks_saved += 1
        self.counters.bytes_saved += kv.numel() * kv.element_size()
