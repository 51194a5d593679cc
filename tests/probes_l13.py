"""L13's engine probes (see probes.py: under the judge, imported in the worker, beside the engine
they watch). They record what the engine holds, as plain data, and judge nothing: the checks are
the test's (tests/test_l13_engine.py), in the judge's process. One step and its record are one
request to the worker, where reading every table from the judge would be hundreds. `grow_watched`
runs one grow_tables call for tests/test_l13_tables.py, watching from the worker what the judge
cannot see: the allocator's calls, and a shallow copy of the request taken before."""

from __future__ import annotations

import copy

from l2_paged import OutOfBlocksError
from l8_prefix import PrefixBlockAllocator
from l13_sliding_window import NULL_BLOCK, grow_tables


class RecordedBuilds:
    """Mixed into the engine's runner class: before each forward, records for every request the
    new tokens it computes, the live blocks each group's table holds (the window bound is checked
    on these by the test), and the (group, entry) of every block this forward writes to that
    another table also holds (copy-on-write should have left none)."""

    def build_meta(self, reqs, num_new):
        builds = self.__dict__.setdefault("recorded_builds", [])
        bs, ref_count = self.alloc.block_size, self.alloc.ref_count
        for req, n in zip(reqs, num_new):
            written = range(req.cur_len // bs, (req.cur_len + n - 1) // bs + 1)
            shared = [(g, i) for g, table in enumerate(req.tables) for i in written
                      if i < len(table) and table[i] != NULL_BLOCK and ref_count[table[i]] > 1]
            builds.append({"request": req.request_id, "cur_len": req.cur_len, "new": n,
                           "held": [sum(b != NULL_BLOCK for b in table) for table in req.tables],
                           "shared_writes": shared})
        return super().build_meta(reqs, num_new)


def record_builds(engine) -> None:
    """The engine's runner starts recording its forwards' tables (its class gains RecordedBuilds)."""
    runner_cls = type(engine.runner)
    if not isinstance(engine.runner, RecordedBuilds):
        engine.runner.__class__ = type(f"Recorded{runner_cls.__name__}", (RecordedBuilds, runner_cls), {})


def engine_state(engine) -> dict:
    """What the test's between-step checks read, as plain data; takes the builds recorded so far."""
    builds = engine.runner.__dict__.get("recorded_builds", [])
    engine.runner.__dict__["recorded_builds"] = []
    alloc, scheduler = engine.alloc, engine.scheduler
    queues = {id(r): name for name in ("running", "waiting", "swapped") for r in getattr(scheduler, name)}
    return {
        "unfinished": engine.has_unfinished(),
        "block_size": alloc.block_size,
        "windows": [group.window for group in engine.pool.groups],
        "group_layers": [list(group.layers) for group in engine.pool.groups],
        "requests": [{"id": r.request_id, "prompt": list(r.prompt_ids), "output": list(r.output_ids),
                      "finished": r.state.name == "FINISHED", "cur_len": r.cur_len,
                      "tables": [list(t) for t in r.tables], "blocks": len(r.blocks),
                      "state": r.state.name, "queue": queues.get(id(r)),
                      "swapped_tables": [list(t) for t in r.swapped_tables],
                      "host_blocks": r.swapped and [int(t.shape[0]) for t in r.swapped.k + r.swapped.v]}
                     for r in engine.requests.values()],
        "ref_count": {b: int(alloc.ref_count[b]) for b in range(alloc.num_blocks) if alloc.ref_count[b]},
        "num_used": alloc.num_used,
        "num_free": alloc.num_free,
        "num_blocks": alloc.num_blocks,
        "builds": builds,
    }


def step(engine) -> dict:
    """One engine step, then `engine_state`."""
    engine.step()
    return engine_state(engine)


def pool_kv(engine) -> dict[int, tuple]:
    """The pool's K and V of every model layer, as the engine's attention indexes them."""
    pool = engine.pool
    return {layer: (pool.K[layer], pool.V[layer]) for layer in range(len(pool.K))}


def outputs(engine) -> dict[int, list[int]]:
    return {i: list(r.output_ids) for i, r in engine.requests.items()}


def grow_watched(req, groups, alloc, num_positions: int) -> dict:
    """`grow_tables(req, groups, alloc, num_positions)` as the engine sees it, for the test of its
    contract (tests/test_l13_tables.py): the sizes of the `alloc.alloc_blocks` calls it made, and
    the tables that a shallow copy of the request, taken just before, holds after it (L5 undoes a
    failed step by restoring such a copy: an edit in place reaches it). An OutOfBlocksError comes
    back as `raised`, so that the calls it made before raising come back too."""
    saved, calls, real = copy.copy(req), [], alloc.alloc_blocks

    def counted(n):
        calls.append(n)
        return real(n)

    alloc.alloc_blocks = counted  # this allocator only, for this call
    try:
        taken, raised = grow_tables(req, groups, alloc, num_positions), False
    except OutOfBlocksError:
        taken, raised = None, True
    finally:
        del alloc.alloc_blocks
    return {"taken": taken, "raised": raised, "alloc_calls": calls,
            "copy_tables": [list(table) for table in saved.tables]}


class TaggedAllocator(PrefixBlockAllocator):
    """Keeps every key within a tag of its own, as L12's allocator does: only `lookup` finds them.
    (A subclass of a lesson's class: under the judge it must live in the worker, here.)"""

    def lookup(self, keys):
        return super().lookup([b"tag:" + k for k in keys])

    def register(self, block, key):
        super().register(block, b"tag:" + key)
