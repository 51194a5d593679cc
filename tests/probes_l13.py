"""L13's engine probes (see probes.py: under the judge, imported in the worker, beside the engine
they watch). They record what the engine holds, as plain data, and judge nothing: the checks are
the test's (tests/test_l13_engine.py), in the judge's process. One step and its record are one
request to the worker, where reading every table from the judge would be hundreds."""

from __future__ import annotations

from l13_sliding_window import NULL_BLOCK


class RecordedBuilds:
    """Mixed into the engine's runner class: before each forward, records for every request the
    new tokens it computes and the live blocks each group's table holds (the window bound is
    checked on these by the test)."""

    def build_meta(self, reqs, num_new):
        builds = self.__dict__.setdefault("recorded_builds", [])
        for req, n in zip(reqs, num_new):
            builds.append({"request": req.request_id, "cur_len": req.cur_len, "new": n,
                           "held": [sum(b != NULL_BLOCK for b in table) for table in req.tables]})
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
    alloc = engine.alloc
    return {
        "unfinished": engine.has_unfinished(),
        "block_size": alloc.block_size,
        "windows": [group.window for group in engine.pool.groups],
        "requests": [{"id": r.request_id, "finished": r.state.name == "FINISHED", "cur_len": r.cur_len,
                      "tables": [list(t) for t in r.tables], "blocks": len(r.blocks)}
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


def outputs(engine) -> dict[int, list[int]]:
    return {i: list(r.output_ids) for i, r in engine.requests.items()}
