"""The lesson packages' Python API refuses bad input at the door, with one line, and changes nothing.

Each case makes one bad call, asserts the exception type and a one-line message, asserts the
object is exactly as before, and then (engines) runs a normal request whose ids must equal HF's
alone, or (allocators) checks every invariant. The checks live in provided code (add_request,
abort, make_engine, acquire, register) and in the allocators' free/alloc_blocks, whose rules the
lessons state (L2 §2.2, L8 §2.5); the graded versions of the latter are in the lessons' own tests,
so this module carries no points.
"""

from __future__ import annotations

import math

import pytest

from helpers import random_prompt
from l1_contiguous import InputError
from l2_paged import BlockAllocator, OutOfBlocksError
from l5_eviction import RequestTooLargeError, WorkItem, load_engine_model, make_engine
from l8_prefix import PrefixBlockAllocator, SampledWorkItem, make_prefix_engine
from l8_prefix.block_hash import block_key
from test_l5_engine import engine_state, hf_alone

pytestmark = [pytest.mark.course, pytest.mark.usefixtures("one_torch_thread")]

GOOD = WorkItem(random_prompt(6, 512, 3), 4)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_engine_model(tiny_model_dir)


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert text and "\n" not in text, repr(text)
    return text


def item(**changes) -> dict:
    return {"prompt_ids": [1, 2, 3], "max_new_tokens": 3, **changes}


VOCAB = 512  # the random tiny model's vocabulary (harness.tiny_models)
# name: WorkItem fields; the L5 engine and the L8 engine must both refuse each.
BAD_ITEMS = {
    "prompt a string": item(prompt_ids="1,2,3"),
    "prompt None": item(prompt_ids=None),
    "prompt id a string": item(prompt_ids=[1, "2"]),
    "prompt id a float": item(prompt_ids=[1.0, 2]),
    "prompt id a bool": item(prompt_ids=[True, 2]),
    "prompt id negative": item(prompt_ids=[-1, 2]),
    "prompt id past the vocabulary": item(prompt_ids=[1, VOCAB]),
    "empty prompt": item(prompt_ids=[]),
    "max_new_tokens a string": item(max_new_tokens="3"),
    "max_new_tokens a float": item(max_new_tokens=2.5),
    "max_new_tokens 0": item(max_new_tokens=0),
    "past the model's positions": item(max_new_tokens=10**6),
    "priority None": item(priority=None),
    "priority a string": item(priority="high"),
    "priority NaN": item(priority=math.nan),
    "arrival_step negative": item(arrival_step=-1),
    "arrival_step a float": item(arrival_step=1.5),
    "arrival_step past 10**9": item(arrival_step=10**20),  # run() used to fail 100,000 steps later
    "stop id past the vocabulary": item(stop_token_ids=(VOCAB + 5,)),
}
BAD_SAMPLES = {
    "n 0": dict(n=0), "n negative": dict(n=-1), "n a float": dict(n=1.5),
    "temperature NaN": dict(temperature=math.nan), "temperature negative": dict(temperature=-1.0),
    "temperature infinite": dict(temperature=math.inf), "seed negative": dict(seed=-1), "seed a string": dict(seed="x"),
}


def finishes_like_hf(engine, tiny_model_dir) -> None:
    engine.run(max_steps=200)
    first = engine.requests[0]
    assert first.output_ids == hf_alone(tiny_model_dir, GOOD)


def refused(engine, make_item, exc_type=ValueError) -> str:
    before = engine_state(engine)
    with pytest.raises(exc_type) as exc_info:
        engine.add_request(make_item())
    assert engine_state(engine) == before
    return one_line(exc_info)


@pytest.mark.parametrize("name", list(BAD_ITEMS))
def test_l5_add_request_refuses(name, model, tiny_model_dir):
    engine = make_engine(model, 64, 4)
    engine.add_request(GOOD)
    message = refused(engine, lambda: WorkItem(**BAD_ITEMS[name]))
    assert "request 1" in message
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("name", [*BAD_ITEMS, *BAD_SAMPLES])
def test_l8_add_request_refuses(name, model, tiny_model_dir):
    engine = make_prefix_engine(model, 64, 4)
    engine.add_request(GOOD)
    fields = BAD_ITEMS.get(name) or item(**BAD_SAMPLES[name])
    message = refused(engine, lambda: SampledWorkItem(**fields))
    assert "request 1" in message
    finishes_like_hf(engine, tiny_model_dir)


def test_a_request_larger_than_the_pool_is_refused(model, tiny_model_dir):
    engine = make_engine(model, 4, 4)
    engine.add_request(GOOD)
    refused(engine, lambda: WorkItem(list(range(1, 30)), 4), RequestTooLargeError)
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("bad_id", [999, -1, "0"])
def test_abort_of_an_unknown_id_says_so(bad_id, model, tiny_model_dir):
    engine = make_engine(model, 64, 4)
    engine.add_request(GOOD)
    before = engine_state(engine)
    with pytest.raises(InputError, match="no request has id") as exc_info:
        engine.abort(bad_id)
    one_line(exc_info)
    assert engine_state(engine) == before
    finishes_like_hf(engine, tiny_model_dir)


@pytest.mark.parametrize("num_blocks", [0, -3, "8", 2.0, True, 10**12])
def test_make_engine_refuses_a_pool_that_cannot_exist(num_blocks, model):
    with pytest.raises(InputError) as exc_info:
        make_engine(model, num_blocks, 4)
    one_line(exc_info)


# ---------------------------------------------------------------- allocators: all or nothing

def allocator_state(alloc) -> tuple:
    extra = ()
    if isinstance(alloc, PrefixBlockAllocator):
        extra = (list(alloc.ref_count), dict(alloc.key_of), list(alloc.cached_free))
    return (list(alloc.free_blocks), alloc.peak_used, *extra)


def l2_busy() -> BlockAllocator:
    alloc = BlockAllocator(8, 4)
    alloc.alloc_blocks(3)
    return alloc


def l8_busy() -> PrefixBlockAllocator:
    """Blocks: some in use (one keyed), one cached free, the rest free."""
    alloc = PrefixBlockAllocator(8, 4)
    blocks = alloc.alloc_blocks(3)
    alloc.register(blocks[0], block_key(None, [1, 2, 3, 4]))
    alloc.register(blocks[2], block_key(None, [5, 6, 7, 8]))
    alloc.free([blocks[2]])  # keyed, no reference left: cached free
    return alloc


def in_use(alloc) -> int:
    return next(b for b in range(alloc.num_blocks) if alloc.ref_count[b] > 0)


def cached(alloc) -> int:
    return next(iter(alloc.cached_free))


def plain_free(alloc) -> int:
    return alloc.free_blocks[-1]


ALLOCATOR_CASES = {  # name: (make, call, exception)
    "l2 alloc_blocks(-1)": (l2_busy, lambda a: a.alloc_blocks(-1), ValueError),
    "l2 alloc_blocks(too many)": (l2_busy, lambda a: a.alloc_blocks(6), OutOfBlocksError),
    "l2 free an id past the pool": (l2_busy, lambda a: a.free([8]), ValueError),
    "l2 free a negative id": (l2_busy, lambda a: a.free([-1]), ValueError),
    "l2 free a bool": (l2_busy, lambda a: a.free([True]), ValueError),
    "l2 free a string": (l2_busy, lambda a: a.free(["0"]), ValueError),
    "l2 free a free block": (l2_busy, lambda a: a.free([a.free_blocks[0]]), ValueError),
    "l2 free one block twice in a call": (l2_busy, lambda a: a.free([7, 7]), ValueError),
    "l8 alloc_blocks(too many)": (l8_busy, lambda a: a.alloc_blocks(7), OutOfBlocksError),
    "l8 acquire a negative id": (l8_busy, lambda a: a.acquire([-1]), ValueError),
    "l8 acquire a bool": (l8_busy, lambda a: a.acquire([True]), ValueError),
    "l8 acquire in use, then a free block": (l8_busy, lambda a: a.acquire([in_use(a), plain_free(a)]), ValueError),
    "l8 acquire in use, then past the pool": (l8_busy, lambda a: a.acquire([in_use(a), 99]), ValueError),
    "l8 register a free block": (l8_busy, lambda a: a.register(plain_free(a), block_key(None, [9] * 4)), ValueError),
    "l8 register a cached free block": (l8_busy, lambda a: a.register(cached(a), block_key(None, [9] * 4)),
                                        ValueError),
    "l8 register with a key not bytes": (l8_busy, lambda a: a.register(in_use(a), "key"), ValueError),
    "l8 free a bool": (l8_busy, lambda a: a.free([True]), ValueError),
    "l8 free in use, then past the pool": (l8_busy, lambda a: a.free([in_use(a), 10**9]), ValueError),
    "l8 free a cached block": (l8_busy, lambda a: a.free([cached(a)]), ValueError),
    "l8 free a plain free block": (l8_busy, lambda a: a.free([plain_free(a)]), ValueError),
}


@pytest.mark.parametrize("name", list(ALLOCATOR_CASES))
def test_an_allocator_refuses_a_bad_call_and_changes_nothing(name):
    make, call, exc_type = ALLOCATOR_CASES[name]
    alloc = make()
    before = allocator_state(alloc)
    with pytest.raises(exc_type) as exc_info:
        call(alloc)
    one_line(exc_info)
    assert allocator_state(alloc) == before
    if isinstance(alloc, PrefixBlockAllocator):
        alloc.check()


def test_check_sees_a_free_block_registered_under_a_key():
    alloc = l8_busy()
    block = plain_free(alloc)
    alloc.key_of[block] = b"stale"  # what a buggy register would leave
    alloc.block_of[b"stale"] = block
    with pytest.raises(AssertionError, match="free block is registered"):
        alloc.check()


# ---------------------------------------------------------------- L2's generate

L2_BAD = {  # name: Request fields
    "empty prompt": dict(prompt_ids=[]),
    "prompt id past the vocabulary": dict(prompt_ids=[1, VOCAB]),
    "prompt id negative": dict(prompt_ids=[-4]),
    "prompt id a bool": dict(prompt_ids=[False, 1]),
    "prompt a tuple": dict(prompt_ids=(1, 2)),
    "max_new_tokens 0": dict(prompt_ids=[1, 2], max_new_tokens=0),
    "max_new_tokens a float": dict(prompt_ids=[1, 2], max_new_tokens=2.0),
    "past the model's positions": dict(prompt_ids=[1, 2], max_new_tokens=10**6),
}


def test_l2_generate_refuses_a_request_listed_twice(tiny_model_dir):
    from l2_paged import KvPool, PagedRunner, Request, load_paged_model

    model = load_paged_model(tiny_model_dir)
    alloc = BlockAllocator(16, 4)
    runner = PagedRunner(model, KvPool(model.config, 16, 4, model.dtype, model.device), alloc)
    req = Request(list(GOOD.prompt_ids), GOOD.max_new_tokens, request_id=7)
    with pytest.raises(InputError, match="request 7 is listed twice") as exc_info:
        runner.generate([req, req])
    one_line(exc_info)
    assert alloc.num_free == 16 and req.cur_len == 0 and req.output_ids == []
    runner.generate([req])
    assert req.output_ids == hf_alone(tiny_model_dir, GOOD) and alloc.num_free == 16


def test_a_pool_larger_than_the_machines_memory_is_refused_before_allocating(model):
    """torch.empty would hand out address space and the run would die later (l8_smoke --n 1000000)."""
    from l5_eviction.workload import available_host_memory

    free = available_host_memory()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    per_block = 4 * model.config.kv_bytes_per_token(4)
    with pytest.raises(InputError, match="GiB of memory available") as exc_info:
        make_engine(model, free // per_block + 1, 4)
    one_line(exc_info)


@pytest.mark.parametrize("name", list(L2_BAD))
def test_l2_generate_refuses_before_taking_a_block(name, tiny_model_dir):
    from l2_paged import KvPool, PagedRunner, Request, load_paged_model

    model = load_paged_model(tiny_model_dir)
    alloc = BlockAllocator(16, 4)
    runner = PagedRunner(model, KvPool(model.config, 16, 4, model.dtype, model.device), alloc)
    good = Request(list(GOOD.prompt_ids), GOOD.max_new_tokens, request_id=0)
    with pytest.raises(InputError, match="request 1") as exc_info:
        runner.generate([good, Request(**{"max_new_tokens": 3, **L2_BAD[name]}, request_id=1)])
    one_line(exc_info)
    assert alloc.num_free == 16 and good.cur_len == 0
    runner.generate([good])
    assert good.output_ids == hf_alone(tiny_model_dir, GOOD) and alloc.num_free == 16


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 5e-6])
def test_a_temperature_below_the_floor_is_greedy_not_nan(model, tiny_model_dir, temperature):
    """1e-39 passed the check and then made softmax(logits / T) NaN: the request ended with no text.
    Below GREEDY_BELOW (1e-5, vLLM's rule) a temperature is greedy."""
    from l8_prefix import GREEDY_BELOW

    assert temperature < GREEDY_BELOW
    engine = make_prefix_engine(model, 64, 4)
    engine.add_request(SampledWorkItem(list(GOOD.prompt_ids), GOOD.max_new_tokens, temperature=temperature, seed=1))
    engine.run(max_steps=200)
    req = engine.requests[0]
    assert req.finish_reason == "length" and req.output_ids == hf_alone(tiny_model_dir, GOOD)
