"""L8's engine with a connector: prefix hits the device pool lost are loaded, not recomputed.

Admission: L8 shares the device's cached run of full blocks; then the connector is asked how many
  more prompt tokens it holds (the run continues from there), the request's cur_len counts them,
  blocks are reserved for them as for computed ones, and the load is promised.
A step: the connector's metadata for the plan; loads into the promised blocks; the forward; the
  saves. The loads write only into blocks the request was handed this step, and the saves only
  copy out, so L5's rollback rule (the pool is not saved) still holds. A load that fails (a bad or
  vanished block) makes its request compute from the first block it lacks, in the same forward:
  its blocks already cover those positions, so nothing else changes and no other request notices.
Finish: a connector may keep a finished request's blocks (a send in flight) until it reports the
  request done; only then are they freed.
"""

from __future__ import annotations

from dataclasses import dataclass

from l1_contiguous import InputError
from l2_paged import release
from l5_eviction import make_engine
from l5_eviction.lifecycle import State
from l8_prefix import PrefixEngine, PrefixKvManager, PrefixRequest

from .connector import MODES, KvConnector, OffloadConnector, block_shape, kv_identity
from .tiers import CpuTier, FileTier, TieredStore


@dataclass
class OffloadRequest(PrefixRequest):
    external_tokens: int = 0  # tokens the connector promised at this admission


class OffloadKvManager(PrefixKvManager):
    """L8's manager that asks a connector for the prompt blocks past the device's cached run."""

    def __init__(self, alloc, pool, sharing: bool, connector: KvConnector):
        super().__init__(alloc, pool, sharing)
        self.connector = connector

    def attach_computed_prefix(self, req: OffloadRequest) -> int:
        hits = super().attach_computed_prefix(req)
        req.external_tokens = self.connector.get_num_new_matched_tokens(req, hits)
        req.cur_len += req.external_tokens  # allocate() then gives them blocks like computed ones
        return hits + req.external_tokens

    def release_computed_prefix(self, req: OffloadRequest) -> None:
        super().release_computed_prefix(req)
        req.external_tokens = 0

    def admitted(self, req: OffloadRequest) -> None:
        super().admitted(req)
        if req.external_tokens:  # blocks are reserved for them now: the load is promised
            self.connector.update_state_after_alloc(req, req.external_tokens)
        req.external_tokens = 0

    def stateful(self) -> list:
        return [*super().stateful(), self.connector, self.connector.counters]


class OffloadEngine(PrefixEngine):
    request_cls = OffloadRequest
    kv_manager_cls = OffloadKvManager

    def __init__(self, model, pool, alloc, connector: KvConnector | None = None, **kwargs):
        connector = connector or KvConnector()
        if not kwargs.get("prefix_sharing", True) and type(connector) is not KvConnector:
            raise InputError("a connector finds blocks by their prefix keys: turn prefix sharing on")
        self._initial_connector = connector  # make_kv_manager hands it to the manager, then it goes
        self.delayed: dict[int, OffloadRequest] = {}  # finished, blocks kept for the connector
        self.recomputed_after_failed_loads = 0  # tokens computed because their blocks failed to load
        super().__init__(model, pool, alloc, **kwargs)
        del self._initial_connector
        alloc.on_evict = lambda block, key: self.connector.on_device_evict(block, key, self.pool)

    def make_kv_manager(self) -> OffloadKvManager:
        return self.kv_manager_cls(self.alloc, self.pool, self.sharing, self._initial_connector)

    @property
    def connector(self) -> KvConnector:
        """The KV manager's connector; setting it swaps the connector (between steps)."""
        return self.kv.connector

    @connector.setter
    def connector(self, connector: KvConnector) -> None:
        self.kv.connector = connector

    def step(self):
        record = super().step()
        self.release_finished()
        return record

    def run_plan(self, plan):
        meta = self.connector.build_connector_meta(plan)
        self.connector.start_load_kv(meta, self.pool)
        self._recompute_failed_loads(plan, self.connector.take_load_failures())
        tokens = super().run_plan(plan)
        self.connector.wait_for_save(meta, self.pool)
        return tokens

    def _recompute_failed_loads(self, plan: list, first_missing: dict[int, int]) -> None:
        """Each request whose loads failed computes from its first missing position in this
        step's forward: its entry in `plan` (the step's record counts it) grows by those tokens."""
        for i, (req, n) in enumerate(plan):
            start = first_missing.get(req.request_id)
            if start is not None and start < req.cur_len:
                plan[i] = (req, n + req.cur_len - start)
                self.recomputed_after_failed_loads += req.cur_len - start
                req.cur_len = start

    def finish(self, req: OffloadRequest, reason: str) -> None:
        if reason in ("aborted", "error") or not self.connector.request_finished(req):
            return super().finish(req, reason)
        self.scheduler.remove(req)  # its blocks stay until the connector says they may go
        req.state, req.finish_reason = State.FINISHED, reason
        self.delayed[req.request_id] = req

    def release_finished(self) -> list[int]:
        """Free the blocks of delayed requests the connector reports done; their ids."""
        done = [rid for rid in self.connector.get_finished() if rid in self.delayed]
        for rid in done:
            release(self.delayed.pop(rid), self.alloc)
        return done

    def summary(self) -> dict:
        out = {**super().summary(), **vars(self.connector.counters),
               "tokens_recomputed_after_failed_loads": self.recomputed_after_failed_loads}
        store = getattr(self.connector, "store", None)
        if store is not None:
            out.update(store.counters())
        return out


def make_store(cpu_blocks: int, file_blocks: int = 0, folder=None, pin: bool = False) -> TieredStore:
    """A CPU tier of `cpu_blocks`, then (if `file_blocks`) a file tier in `folder`."""
    tiers = [CpuTier(cpu_blocks, pin=pin)]
    if file_blocks:
        if folder is None:
            raise InputError("a file tier needs a folder")
        tiers.append(FileTier(file_blocks, folder))
    return TieredStore(tiers)


def make_offload_engine(model, num_blocks: int, block_size: int = 16, store: TieredStore | None = None,
                        mode: str = "write-through", **kwargs) -> OffloadEngine:
    """L8's engine over a pool of `num_blocks`, with `store` behind it (None: no tier at all)."""
    if mode not in MODES:
        raise InputError(f"unknown offload mode {mode!r}; choose {' or '.join(MODES)}")
    connector = None
    if store is not None:  # keyed by what its blocks are K/V of, so a store shared with other pools stays safe
        connector = OffloadConnector(store, block_size, mode, kv_identity(model, block_size, model.dtype),
                                     block_shape(model.config, block_size), model.dtype)
    return make_engine(model, num_blocks, block_size, engine_cls=OffloadEngine, connector=connector, **kwargs)
