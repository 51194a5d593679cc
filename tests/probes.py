"""Code that must run in the process that runs the lesson's code: probes that watch it. Planted
bugs that subclass a lesson's classes live beside it, one module a lesson (probes_l2.py, ...), so
that a lesson's tests import only the lessons they test.

Under the judge (harness/judge.py) every `probes*` module is imported in the worker, beside the
lesson packages, and the tests hold handles to what it makes: a class cannot derive from an
object living in another process, and a hook on torch's modules sees only its own process's
forwards.
"""

from __future__ import annotations

import contextlib

import torch


class Recorded(list):
    """A list the probes append to. Not a plain list, so that under the judge the test holds a
    handle to this one, and sees what is appended after it got it, not a copy."""


@contextlib.contextmanager
def forward_lengths(model_cls):
    """Yields a list that every forward of a `model_cls` module run inside the block appends its
    number of input tokens to: how a test sees that decode feeds one new token per step (the
    cache holds the rest) instead of the whole sequence again, or HF's model instead of ours."""
    lengths = Recorded()

    def record(module, args):
        if isinstance(module, model_cls) and args:
            lengths.append(args[0].numel())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        yield lengths
    finally:
        handle.remove()


def data_ptr(tensor) -> int:
    """Where a tensor's data starts in the process that runs the lesson's code: how a test tells
    a view of the pool from a copy of it (under the judge, the test's own tensor is a copy)."""
    return tensor.data_ptr()
