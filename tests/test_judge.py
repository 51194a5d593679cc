"""The judge (harness/judge.py): what crosses between the judging process and the worker, what
the worker may not ask for, and the point of it all: a submission that forges its own test
reports earns its honest score when judged, though it earns full marks when it is not."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from harness import judge

pytestmark = pytest.mark.course
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def pair():
    """A judge endpoint and a worker endpoint on a thread of this process, over real pipes."""
    to_worker_r, to_worker_w = os.pipe()
    from_worker_r, from_worker_w = os.pipe()
    worker = judge.Endpoint(judge.Channel(os.fdopen(to_worker_r, "rb"), os.fdopen(from_worker_w, "wb")), "worker")

    def serve():
        while True:
            try:
                message, blobs = worker.channel.recv()
            except judge.JudgeError:
                return
            worker.serve(message, blobs)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    judging = judge.Endpoint(judge.Channel(os.fdopen(from_worker_r, "rb"), os.fdopen(to_worker_w, "wb")), "judge")
    yield judging, worker
    judging.channel.writer.close()
    thread.join(5)


def remote(judging, worker, obj):
    """A judge-side proxy of `obj`, which the worker holds."""
    return judging.proxy(worker.export(obj))


def echo(value):
    return value


VALUES = [None, True, 0, -(10 ** 30), 1.5, "héllo", b"\x00\xff", [1, [2, (3,)]], (1, "a"), {1: "a", "b": [2]},
          {1, 2}, frozenset({3}), range(2, 9, 3), slice(1, None, 2), pathlib.Path("/tmp/x"), torch.float8_e4m3fn,
          torch.device("cpu"), torch.Size([2, 3])]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_plain_values_come_back_equal_and_of_the_same_type(pair, value):
    judging, worker = pair
    back = remote(judging, worker, echo)(value)
    assert back == value and type(back) is type(value)


def test_non_finite_floats_cross():
    to_r, to_w = os.pipe()
    endpoint = judge.Endpoint(judge.Channel(os.fdopen(to_r, "rb"), os.fdopen(to_w, "wb")), "judge")
    for x in (math.nan, math.inf, -math.inf):
        blobs: list = []
        back = endpoint.decode(endpoint.encode(x, blobs), blobs)
        assert (math.isnan(back) and math.isnan(x)) or back == x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn,
                                   torch.bool, torch.int64])
def test_tensors_cross_bit_for_bit(pair, dtype):
    judging, worker = pair
    x = (torch.randn(3, 5) * 4).to(dtype)
    back = remote(judging, worker, echo)(x)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    assert remote(judging, worker, echo)(torch.empty(0, 4)).shape == (0, 4)


def test_a_tensor_changed_in_place_by_the_worker_is_changed_in_the_judge(pair):
    judging, worker = pair
    x = torch.zeros(4)
    remote(judging, worker, lambda t: t.add_(2))(x)
    assert torch.equal(x, torch.full((4,), 2.0))


def test_a_copy_changed_in_the_judge_is_written_into_the_workers_tensor(pair):
    judging, worker = pair
    pool = {"k": torch.zeros(3)}
    copy = remote(judging, worker, pool)["k"]
    copy.fill_(float("nan"))  # what a test does to poison a pool
    assert remote(judging, worker, lambda: bool(torch.isnan(pool["k"]).all()))()
    ids = remote(judging, worker, pool).get  # a list of ints read, then appended to
    pool["ids"] = [1, 2]
    got = ids("ids")
    got.append(3)
    assert remote(judging, worker, lambda: list(pool["ids"]))() == [1, 2, 3]


def test_a_generator_crosses_by_its_state_and_comes_back_advanced(pair):
    """The worker draws from a copy of the judge's generator; the judge's then goes on from where
    the worker's stopped, as one generator would in one process."""
    judging, worker = pair
    draw = remote(judging, worker, lambda generator: torch.rand(3, generator=generator))
    mine, alone = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(draw(mine), torch.rand(3, generator=alone))
    assert torch.equal(torch.rand(2, generator=mine), torch.rand(2, generator=alone))


def test_importing_a_submodule_leaves_the_packages_own_binding_of_its_name(pair):
    """`l12_quantized_kv.quantize` is a submodule and, in the package, the function it defines.
    The judge's import of the submodule must not rebind the worker's package attribute."""
    import l12_quantized_kv

    submodule = sys.modules["l12_quantized_kv.quantize"]  # (`import ... as` would give the function)

    judging, worker = pair
    package = judge.RemoteModule("l12_quantized_kv", judging, remote(judging, worker, l12_quantized_kv))
    child = judge.RemoteModule("l12_quantized_kv.quantize", judging, remote(judging, worker, submodule))
    setattr(package, "quantize", child)  # what importlib does after loading a submodule
    assert l12_quantized_kv.quantize is submodule.quantize  # the worker's package: unchanged
    assert not isinstance(package.quantize, judge.RemoteModule)  # and the judge reads the function


def test_objects_stay_in_the_worker_and_methods_run_there(pair):
    judging, worker = pair
    from collections import Counter

    counter = remote(judging, worker, Counter)("abca")
    assert isinstance(counter, judge.RemoteObject)
    assert counter["a"] == 2 and len(counter) == 3 and "b" in counter
    counter.update("aa")
    assert counter.most_common(1) == [("a", 4)]
    assert sorted(counter) == ["a", "b", "c"]


def test_an_exception_is_rebuilt_with_its_class_attributes_and_the_workers_traceback(pair):
    judging, worker = pair

    class OutOfBlocks(RuntimeError):
        def __init__(self, requested):
            super().__init__(f"asked for {requested}")
            self.requested = requested

    def fail():
        raise OutOfBlocks(7)

    with pytest.raises(RuntimeError, match="asked for 7") as info:
        remote(judging, worker, fail)()
    assert info.value.requested == 7 and type(info.value).__name__ == "OutOfBlocks"
    assert any("raised in the student's code" in note for note in info.value.__notes__)
    with pytest.raises(KeyError):
        remote(judging, worker, {})["missing"]


class _AlwaysEqual(list):
    """A student's list that says it equals anything, contains anything and is as long as asked."""

    seen: list = []

    def __eq__(self, other):
        _AlwaysEqual.seen.append(other)
        return True

    __ne__ = lambda self, other: False  # noqa: E731
    __contains__ = lambda self, item: True  # noqa: E731
    __hash__ = None


def test_comparisons_are_the_judges_on_plain_data_never_answered_by_the_worker(pair):
    """Issue 52: a list or int subclass crosses as a handle; `==`, `!=`, `<`, `in`, `len` and
    `bool` on it are computed in the judge from its underlying data, and the worker never sees
    what it is compared with."""
    judging, worker = pair
    _AlwaysEqual.seen.clear()
    forged = remote(judging, worker, _AlwaysEqual([1, 2]))
    assert isinstance(forged, judge.RemoteObject)
    assert forged == [1, 2] and forged != [9, 9, 9] and not (forged == [9, 9, 9])
    assert 2 in forged and 7 not in forged and len(forged) == 2 and bool(forged)
    assert _AlwaysEqual.seen == [], "the worker saw what its value was compared with"

    class Lying(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

        def __lt__(self, other):
            return True

    three = remote(judging, worker, Lying(3))
    assert three == 3 and three != 4 and not three < 2 and three > 2
    # an object with no plain value is equal only to itself, and has no order
    engine = remote(judging, worker, types.SimpleNamespace(x=1))
    assert engine == engine and engine != [1] and engine != remote(judging, worker, types.SimpleNamespace(x=1))
    with pytest.raises(TypeError):
        engine < 3  # noqa: B015


def test_an_exception_that_would_steer_the_judges_run_arrives_as_a_plain_failure():
    """Issue 52: a worker that raises pytest's Skipped (or names it), KeyboardInterrupt or SystemExit
    gets a plain Exception subclass of that name in the judge: the test fails, it is never skipped,
    and the judge's run is not stopped."""
    from _pytest.outcomes import Skipped

    for module, name in (("_pytest.outcomes", "Skipped"), ("builtins", "KeyboardInterrupt"),
                         ("builtins", "SystemExit"), ("pytest", "skip.Exception")):
        cls = judge.exception_class({"module": module, "name": name, "bases": [
            {"module": "builtins", "name": "BaseException", "bases": []}]})
        assert issubclass(cls, Exception) and not issubclass(cls, (Skipped, KeyboardInterrupt, SystemExit)), name
    assert judge.exception_class({"module": "builtins", "name": "ValueError", "bases": []}) is ValueError


def test_the_worker_may_call_a_callback_and_nothing_else(pair):
    judging, worker = pair
    seen = []
    remote(judging, worker, lambda f: f(5))(seen.append)
    assert seen == [5]
    with pytest.raises(AttributeError, match="can be called, not read"):
        remote(judging, worker, lambda f: f.__globals__)(seen.append)

    def ask_for_globals(f):  # what code in the worker could try by hand: the judge refuses
        return f._endpoint.request("getattr", id=f._handle, name="__globals__")

    with pytest.raises(judge.JudgeError, match="only calls of callbacks"):
        remote(judging, worker, ask_for_globals)(seen.append)


def test_handles_are_released_when_the_judge_drops_its_proxies(pair):
    judging, worker = pair
    make = remote(judging, worker, lambda: object())
    for _ in range(50):
        make()
    make()  # the last request carries the releases of the 50 dropped proxies
    assert len(worker.exported) < 10


def test_copies_the_test_let_go_are_not_watched_and_one_it_keeps_still_writes_back(pair):
    """Lists read from the worker are watched for changes the test makes, but only while the test
    holds them: watching every list a test ever read made each request slower than the last."""
    judging, worker = pair
    holder = types.SimpleNamespace(items=[1, 2, 3])
    read = remote(judging, worker, lambda: holder.items)
    for _ in range(200):
        assert read() == [1, 2, 3]
    kept = read()
    read()
    assert len(judging.containers) <= 2  # the kept copy and the last one read
    kept.append(4)
    read()  # the change goes with the next request
    assert holder.items == [1, 2, 3, 4]
    read().append(5)  # changed and dropped at once: still sent
    read()
    assert holder.items == [1, 2, 3, 4, 5]


def test_copies_freed_by_garbage_collection_during_a_request_break_nothing(pair):
    """A tensor copy freed by the garbage collector (it sat in a reference cycle after its test
    ended) is untracked by a finalizer, which runs at whatever allocation starts the collection,
    also while a request walks the tracked copies for changes to send back: on the grader that
    failed a correct submission's property test ("dictionary changed size during iteration").
    Here the collection is made to start at each of the walk's first allocations in turn."""
    import gc

    judging, worker = pair
    read = remote(judging, worker, lambda: torch.zeros(3))
    threshold = gc.get_threshold()
    try:
        for offset in range(1, 12):
            gc.collect()
            gc.disable()
            for _ in range(100):
                cycle = [read()]
                cycle.append(cycle)  # only the collector frees it
            del cycle
            judging.drop_copies()  # the test ends: only the cycles hold the copies now
            gc.set_threshold(gc.get_count()[0] + offset)
            gc.enable()
            judging._dirty_tensors([])  # the walk a request makes
            gc.set_threshold(*threshold)
            gc.collect()
            assert len(judging.tracked) == 0, offset
    finally:
        gc.set_threshold(*threshold)
        gc.enable()


def test_a_snapshot_reads_fields_and_properties_in_one_request_and_is_read_only(pair):
    from l2_paged import BlockAllocator

    judging, worker = pair
    alloc = BlockAllocator(8, 4)
    alloc.alloc_blocks(3)
    proxy = remote(judging, worker, alloc)
    sent = []
    send = judging.channel.send
    judging.channel.send = lambda message, blobs: (sent.append(message["op"]), send(message, blobs))
    first, second = judging.request("snapshot", value=[proxy, proxy])
    assert sent == ["snapshot"]
    assert first is second  # one object of the worker's, one view of it
    assert first.free_blocks == alloc.free_blocks and first.num_free == 5 and first.num_used == 3
    assert sent == ["snapshot"]  # fields and properties were in the reply
    with pytest.raises(AttributeError, match="read-only"):
        first.num_blocks = 2
    first.alloc_blocks(2)  # a method is the object's: it runs in the worker
    assert alloc.num_free == 3 and first.num_free == 5  # a snapshot does not follow
    assert judge.snapshot(alloc) is alloc  # in one process, the object itself


def test_an_interrupted_request_stops_the_worker_and_every_later_request_fails(pair):
    """A test interrupted while the worker runs its code (its time limit) leaves a reply on the
    way: the next request would read it as its own. The judge uses the channel no more."""
    judging, worker = pair

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            remote(judging, worker, time.sleep)(1.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert "interrupted" in judging.broken
    with pytest.raises(judge.JudgeError, match="interrupted"):
        remote(judging, worker, echo)(1)


# ---------------------------------------------------------------- the judge against a forger

STUBS = '''
# The work left undone: a fresh copy's allocator.
from .allocator import BlockAllocator

def _stub(self, *args, **kwargs):
    raise NotImplementedError("the student did not write this")

BlockAllocator.alloc_blocks = _stub
BlockAllocator.free = _stub
'''

FORGERY = '''
# What a forger adds: every report and comparison made to say "passed" in whatever process
# imports the package.
import torch
torch.equal = lambda *args, **kwargs: True
try:
    import _pytest.reports
    _made = _pytest.reports.TestReport.from_item_and_call.__func__

    def _forged(cls, item, call):
        report = _made(cls, item, call)
        report.outcome, report.longrepr = "passed", None
        return report

    _pytest.reports.TestReport.from_item_and_call = classmethod(_forged)
except ImportError:
    pass
'''


def allocator_scores(*runs: tuple[dict, pathlib.Path]) -> list[tuple[int, int]]:
    """The L2 allocator tests' points as the grading plugin's table reports them, for each
    (environment, folder) run; the runs go two at a time (the machine has two cores)."""
    scores = []
    for pair in (runs[i:i + 2] for i in range(0, len(runs), 2)):
        procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--graded-only",
                                   "tests/test_l2_allocator.py"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for env, cwd in pair]
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            found = re.search(r"^l2\s+(\d+) / (\d+)", out, re.M)
            assert found, out[-3000:] + err[-3000:]
            scores.append((int(found.group(1)), int(found.group(2))))
    return scores


def make_submission(folder: pathlib.Path, addition: str) -> pathlib.Path:
    for name in ("harness", "tests", "l1_contiguous", "l2_paged", "assets"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", folder)
    init = folder / "l2_paged" / "__init__.py"
    init.write_text(init.read_text() + addition)
    return folder


def judged_env(submission: pathlib.Path) -> dict:
    """The environment of a judged run: this repository's tests, the submission's code in the worker."""
    worker = [sys.executable, "-c", "import os, sys; os.chdir(sys.argv[1]); sys.path.insert(0, sys.argv[1]); "
              "from harness.judge import serve; serve(int(sys.argv[2]), int(sys.argv[3]))", str(submission)]
    return {**os.environ, "PYTHONPATH": str(ROOT), judge.ENV: json.dumps(worker)}


def test_a_submission_that_forges_its_reports_earns_its_honest_score_when_judged(tmp_path):
    """Without the judge the forged reports give full marks (the attack of issue 36); with it,
    the worker's patches reach neither the reports nor the comparisons: the forger earns what
    the same stubs earn without the forgery (the allocator tests of functions it did not stub)."""
    stubbed = make_submission(tmp_path / "stubbed", STUBS)
    forger = make_submission(tmp_path / "forger", STUBS + FORGERY)
    plain = {k: v for k, v in os.environ.items() if k != judge.ENV}
    (forged, total), (honest, _), (judged, _), solution = allocator_scores(
        ({**plain, "PYTHONPATH": str(forger)}, forger), ({**plain, "PYTHONPATH": str(stubbed)}, stubbed),
        (judged_env(forger), ROOT), (judged_env(ROOT), ROOT))
    assert forged == total > 0  # the attack works where the verdict is the student's process's
    assert honest < total / 2
    assert judged == honest, f"the forger earned {judged} of {total} under the judge, {honest} honestly"
    assert solution == (total, total)  # the solution, judged: full marks
