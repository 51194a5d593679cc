"""L5 and L8: a step is all or nothing, whatever interrupts it.

A KeyboardInterrupt (what Ctrl-C raises; a BaseException, not an Exception) is raised once from a
patched function at one point of a step: inside the forward, after it, while sampling, during the
commit, while preempting, during a swap out or in, a copy-on-write, a fork, a cache hit or an
eviction. Right after it the engine must be exactly as before the step (a victim the step
preempted may come back preempted for recompute, see `Engine.step`), with every invariant holding;
then the workload runs to the end and every request's ids equal those of an uninterrupted run
(which other tests prove equal to HF's alone). Engine.step is provided code: no points.
"""

from __future__ import annotations

import sys

import pytest

import l5_eviction.preempt
import l8_prefix.sampling
from l5_eviction import State, load_engine_model, make_engine
from l8_prefix import SampledWorkItem
from test_l5_engine import BLOCK_SIZE, WORKLOAD, hf_alone, quarter_pool
from test_l5_invariants import check_all_released as l5_all_released
from test_l5_invariants import check_invariants as l5_invariants
from test_l8_engine import PREFIX, WORKLOAD as L8_WORKLOAD, by_sample, make as make_l8, tail
from test_l8_engine import check_all_released as l8_all_released
from test_l8_engine import check_invariants as l8_invariants

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


class Trigger:
    """True once: the first time it is asked at or after step `at` (and, if given, from `caller`)."""

    def __init__(self, engine, at: int = 0, caller: str | None = None, nth: int = 1):
        self.engine, self.at, self.caller, self.nth = engine, at, caller, nth
        self.fired, self.seen = False, 0

    def __call__(self) -> bool:
        if self.fired or self.engine.now < self.at:
            return False
        if self.caller and not any(sys._getframe(i).f_code.co_name == self.caller for i in range(2, 5)):
            return False
        self.seen += 1
        self.fired = self.seen == self.nth
        return self.fired


def interrupt(monkeypatch, obj, name: str, trigger: Trigger, after: bool = False) -> None:
    """Make obj.name raise KeyboardInterrupt once, before (or after) doing its work."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        if not after and trigger():
            raise KeyboardInterrupt
        out = real(*args, **kwargs)
        if after and trigger():
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(obj, name, wrapper)


def view(engine) -> dict:
    return {i: (r.state, r.cur_len, list(r.output_ids)) for i, r in engine.requests.items()}


def run_interrupted(engine, trigger: Trigger, check, monkeypatch) -> None:
    """Step until the interrupt; check the rollback; then run to the end with the patch removed."""
    while engine.has_unfinished():
        before, now = view(engine), engine.now
        try:
            engine.step()
        except KeyboardInterrupt:
            break
        check(engine)
    assert trigger.fired, "test setup: the interrupt point was never reached"
    monkeypatch.undo()
    assert engine.now == now and len(engine.timeline) == now  # the step did not happen
    check(engine)
    after = view(engine)
    assert after.keys() == before.keys()  # no fork or request appeared
    for i, (state, cur_len, out) in before.items():
        assert after[i][2] == out, f"request {i}: outputs changed by the interrupted step"
        dropped = state is State.RUNNING and after[i][:2] == (State.WAITING, 0)
        assert after[i][:2] == (state, cur_len) or dropped, (i, before[i][:2], after[i][:2])
    while engine.has_unfinished():
        engine.step()
        check(engine)


# ---------------------------------------------------------------- L5

def l5_engine(model, mode):
    engine = make_engine(model, quarter_pool(WORKLOAD), BLOCK_SIZE, preempt=mode)
    for item in WORKLOAD:
        engine.add_request(item)
    return engine


_clean_l5 = {}


def clean_l5(model, mode):
    if mode not in _clean_l5:
        engine = l5_engine(model, mode)
        engine.run()
        _clean_l5[mode] = engine
    return _clean_l5[mode]


def first_preemption(engine) -> int:
    return next(r.step for r in engine.timeline if r.preempted)


# name: (modes, arm(engine, monkeypatch, at) -> trigger); `at` is the clean run's first preempting step.
L5_POINTS = {
    "forward, first layer": (("recompute", "swap"), lambda e, mp, at: _layer(e, mp, at, 0)),
    "forward, last layer": (("recompute", "swap"), lambda e, mp, at: _layer(e, mp, at, -1)),
    "after the forward": (("recompute", "swap"),
                          lambda e, mp, at: _arm(mp, e.runner, "forward_logits", Trigger(e, at), after=True)),
    "sampling": (("recompute", "swap"), lambda e, mp, at: _arm(mp, e, "sample", Trigger(e, at))),
    "commit, one request done": (("recompute",),
                                 lambda e, mp, at: _arm(mp, e, "maybe_finish", Trigger(e, at), after=True)),
    "commit, a request finished": (("recompute",), lambda e, mp, at: _arm(
        mp, e.preemptor, "discard", Trigger(e, 0, caller="maybe_finish"), after=True)),
    "timeline record": (("recompute",), lambda e, mp, at: _arm(mp, e, "record", Trigger(e, at))),
    "admission, blocks reserved": (("recompute",), lambda e, mp, at: _arm(
        mp, e.scheduler, "_try_admit", Trigger(e, at), after=True)),
    "preemption for recompute, before the free": (("recompute",), lambda e, mp, at: _arm(
        mp, l5_eviction.preempt, "release", Trigger(e, 0, caller="drop_for_recompute"))),
    "preemption for recompute, done": (("recompute",), lambda e, mp, at: _arm(
        mp, e.preemptor, "preempt", Trigger(e, 0), after=True)),
    "swap out, mid-copy": (("swap",), lambda e, mp, at: _arm(
        mp, l5_eviction.preempt, "to_host", Trigger(e, 0, nth=2))),
    "swap out, copied, before the free": (("swap",), lambda e, mp, at: _arm(
        mp, l5_eviction.preempt, "release", Trigger(e, 0, caller="swap_out"))),
    "swap in, blocks allocated, not copied": (("swap",), lambda e, mp, at: _arm(
        mp, l5_eviction.preempt, "reserve", Trigger(e, 0))),
    "swap in, done": (("swap",), lambda e, mp, at: _arm(mp, e.preemptor, "swap_in", Trigger(e, 0), after=True)),
}


def _arm(monkeypatch, obj, name, trigger, after=False) -> Trigger:
    interrupt(monkeypatch, obj, name, trigger, after)
    return trigger


def _layer(engine, monkeypatch, at, index) -> Trigger:
    return _arm(monkeypatch, engine.model.model.layers[index].mlp, "forward", Trigger(engine, at))


@pytest.mark.l5
@pytest.mark.parametrize("point,mode", [(p, m) for p, (modes, _) in L5_POINTS.items() for m in modes])
def test_l5_an_interrupted_step_leaves_no_trace(point, mode, model, tiny_model_dir, monkeypatch):
    clean = clean_l5(model, mode)
    engine = l5_engine(model, mode)
    trigger = L5_POINTS[point][1](engine, monkeypatch, first_preemption(clean))
    run_interrupted(engine, trigger, l5_invariants, monkeypatch)
    l5_all_released(engine)
    assert [r.output_ids for r in engine.requests.values()] == [r.output_ids for r in clean.requests.values()]
    for item, req in zip(WORKLOAD, engine.requests.values()):
        assert req.output_ids == hf_alone(tiny_model_dir, item)


# ---------------------------------------------------------------- L8

SAMPLED = [SampledWorkItem(PREFIX + tail(5), 8, arrival_step=0, temperature=1.0, seed=7, n=3),
           SampledWorkItem(PREFIX + tail(9), 8, arrival_step=1, temperature=0.7, seed=100, n=2),
           SampledWorkItem(PREFIX + tail(2), 8, arrival_step=1, temperature=1.5, seed=3)]
L8_RUNS = {  # name: (workload, engine options)
    "greedy": (L8_WORKLOAD, dict(num_blocks=14)),
    "greedy, swap": (L8_WORKLOAD, dict(num_blocks=14, preempt="swap")),
    "sampled": (SAMPLED, dict(prefill_chunk=8)),
}

L8_POINTS = {  # name: (runs, arm)
    "forward": (("greedy", "sampled"), lambda e, mp: _layer(e, mp, 3, 0)),
    "sampling": (("greedy", "sampled"), lambda e, mp: _arm(mp, l8_prefix.sampling, "draw", Trigger(e, 0, nth=3))),
    "after a draw": (("sampled",), lambda e, mp: _arm(mp, l8_prefix.sampling, "draw", Trigger(e, 0, nth=2),
                                                      after=True)),
    "commit, registering full blocks": (("greedy",), lambda e, mp: _arm(mp, e.alloc, "register",
                                                                        Trigger(e, 0, nth=2), after=True)),
    "commit, forking samples": (("greedy", "sampled"), lambda e, mp: _arm(
        mp, e.alloc, "acquire", Trigger(e, 0, caller="fork", nth=2), after=True)),
    "admission, cached prefix attached": (("greedy",), lambda e, mp: _arm(
        mp, e.kv, "attach_computed_prefix", Trigger(e, 1), after=True)),
    "copy-on-write, block allocated, not copied": (("greedy", "sampled"), lambda e, mp: _arm(
        mp, e.alloc, "alloc_blocks", Trigger(e, 0, caller="copy_on_write"), after=True)),
    "copy-on-write, copied, table unchanged": (("greedy",), lambda e, mp: _arm(
        mp, e.alloc, "free", Trigger(e, 0, caller="copy_on_write"))),
    "copy-on-write, shared block released, table unchanged": (("greedy",), lambda e, mp: _arm(
        mp, e.alloc, "free", Trigger(e, 0, caller="copy_on_write"), after=True)),
    "evicting a cached block": (("greedy", "greedy, swap"), lambda e, mp: _arm(
        mp, e.alloc, "forget", Trigger(e, 0, caller="_evict_lru"), after=True)),
    "preemption": (("greedy", "greedy, swap"), lambda e, mp: _arm(mp, e.preemptor, "preempt", Trigger(e, 0),
                                                                 after=True)),
    "swap in": (("greedy, swap",), lambda e, mp: _arm(mp, l5_eviction.preempt, "reserve", Trigger(e, 0))),
}

_clean_l8 = {}


def clean_l8(model, run):
    if run not in _clean_l8:
        items, options = L8_RUNS[run]
        engine = make_l8(model, **options)
        engine.run(items)
        _clean_l8[run] = by_sample(engine.requests)
    return _clean_l8[run]


@pytest.mark.l8
@pytest.mark.parametrize("point,run", [(p, r) for p, (runs, _) in L8_POINTS.items() for r in runs])
def test_l8_an_interrupted_step_leaves_no_trace(point, run, model, monkeypatch):
    items, options = L8_RUNS[run]
    engine = make_l8(model, **options)
    for item in items:
        engine.add_request(item)
    trigger = L8_POINTS[point][1](engine, monkeypatch)
    run_interrupted(engine, trigger, l8_invariants, monkeypatch)
    l8_all_released(engine)
    assert by_sample(engine.requests) == clean_l8(model, run)
