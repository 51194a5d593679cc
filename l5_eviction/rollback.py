"""Undoing a step: shallow snapshots of the objects a step may change, restored on failure.

A step changes ids, lists of blocks, queues of requests, counters and random generators; the pool's
K/V it does not need to save (see Engine.step). So a snapshot copies each object's attributes one
container deep, and a generator's state; everything else is kept by reference.
"""

from __future__ import annotations

import copy
import functools
from collections import deque
from dataclasses import dataclass

import torch

SKIPPED = "_pending_rollback"  # the engine's note of a rollback in progress is never rolled back


@dataclass
class PendingRollback:
    """A step's (or call's) saved state, kept until its rollback has completed."""

    saved: list  # (object, its attributes) pairs from `snapshot`
    victims: list  # requests the failed step preempted
    marks: object  # the KV manager's `failure_marks()` at the failure


def snapshot(objects: list) -> list:
    """Every step takes one (Engine.step), so it is kept cheap: a dict comprehension per object,
    one lookup per attribute for how its kind of value is saved."""
    return [(obj, {k: _saver(type(v))(v) for k, v in vars(obj).items() if k != SKIPPED}) for obj in objects]


def restore(saved: list) -> None:
    """Put every object of `saved` back; safe to repeat (each restore copies afresh)."""
    for obj, state in saved:
        current = vars(obj)
        current.update({k: _restored(v) for k, v in state.items()})
        for key in [k for k in current if k not in state and k != SKIPPED]:
            del current[key]


class _GeneratorState:
    def __init__(self, generator: torch.Generator):
        self.generator, self.state = generator, generator.get_state()


_CONTAINERS = (list, dict, set, deque)


def _by_reference(value):
    return value


@functools.cache
def _saver(kind: type):
    """How a value of `kind` is saved, deep enough to undo a step: containers one level down (they
    hold ids, blocks, requests or immutable keys), a random generator's state, anything else by
    reference. Decided once per type."""
    if kind in _CONTAINERS:
        return kind.copy
    if issubclass(kind, _CONTAINERS):  # a subclass's own copy() may return the base type
        return copy.copy
    if issubclass(kind, torch.Generator):
        return _GeneratorState
    return _by_reference


def _restored(value):
    if isinstance(value, (list, dict, set, deque)):  # a fresh copy: a repeated rollback starts clean
        return copy.copy(value)
    if isinstance(value, _GeneratorState):
        value.generator.set_state(value.state)
        return value.generator
    return value
