"""L13's engine against HF on hybrid models, with every step checked (lessons/L13-sliding-window.md §3):
between steps each sliding group holds exactly the blocks its window still reaches, and during a
step no more than ceil((W - 1 + n) / block_size) + 1 for n new tokens; full groups hold their whole
history; no forward writes into a shared block; a swapped request's trimmed tables and host copy
wait off the device (§2.7); no block is held twice or lost; everything is back in the pool at the end. The pool's
peak is compared with the test's own count of what each step must hold."""

from __future__ import annotations

import pytest
import torch

from harness import hf_reference as hf
from helpers import assert_tables_hold_hf_kv, blocks_for, kjv_prompts, random_prompt
from probes_l13 import engine_state, outputs, pool_kv, record_builds, step
from l1_contiguous import InputError
from l5_eviction import WorkItem, load_engine_model
from l8_prefix import make_prefix_engine
from l13_sliding_window import NULL_BLOCK, grow_tables, kv_cache_groups, load_hybrid_model, make_hybrid_engine

pytestmark = [pytest.mark.l13, pytest.mark.usefixtures("one_torch_thread")]

# A random hybrid whose kinds differ in size: 4 sliding layers and 2 full ones, so 3 groups of 2.
RANDOM_HYBRID = dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=12,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)


@pytest.fixture(scope="module")
def hybrid(hybrid_model_dir):
    return load_hybrid_model(hybrid_model_dir)


@pytest.fixture(scope="module")
def prompts(hybrid_model_dir):
    return kjv_prompts(hybrid_model_dir, [(0, 150), (700, 90), (1400, 40), (2100, 130)])


@pytest.fixture(scope="module")
def oracle(hybrid_model_dir):
    return hf.load_hf_model(str(hybrid_model_dir))


@pytest.fixture(scope="module")
def hf_hybrid_ids(oracle, prompts):
    return [hf.hf_greedy(oracle, p, 50) for p in prompts]


def check_builds(state: dict) -> None:
    """During a step: no forward's sliding table holds more than the window bound for its new tokens,
    and no forward writes into a block that another table holds (§2.7: copy-on-write first)."""
    bs = state["block_size"]
    for build in state["builds"]:
        assert not build["shared_writes"], (f"request {build['request']} writes positions from {build['cur_len']} "
                                            f"into shared blocks (group, entry) {build['shared_writes']}: "
                                            f"every group's shared block is copied before it is written")
        for window, held in zip(state["windows"], build["held"]):
            if window is not None:
                bound = blocks_for(window - 1 + build["new"], bs) + 1
                assert held <= bound, (f"request {build['request']} computes {build['new']} tokens from position "
                                       f"{build['cur_len']} holding {held} blocks in a window of {window}")


def check_between_steps(state: dict) -> None:
    """Each running request's tables are exactly what its next token needs, and it is RUNNING; a
    swapped one's are on the host (check_swapped); every block's reference count is the number of
    tables holding it; blocks add up."""
    bs, owners = state["block_size"], {}
    for req in state["requests"]:
        assert req["queue"] != "running" or req["state"] == "RUNNING", \
            f"request {req['id']} is running in state {req['state']}"
        if req["queue"] == "swapped":
            check_swapped(req, state["windows"], bs)
        if req["finished"] or not req["tables"]:
            assert not req["finished"] or (not req["tables"] and not req["blocks"]), \
                f"finished request {req['id']} still holds blocks"
            continue
        for g, (window, table) in enumerate(zip(state["windows"], req["tables"])):
            assert len(table) >= blocks_for(req["cur_len"], bs), f"request {req['id']}: group {g} lost entries"
            # The next token (position cur_len) reads cur_len - W + 1 .. cur_len: blocks wholly
            # before that are NULL_BLOCK, every other entry holds a block.
            oldest = 0 if window is None else max(0, req["cur_len"] - window + 1)
            for i, block in enumerate(table):
                behind = (i + 1) * bs <= oldest
                assert (block == NULL_BLOCK) == behind, \
                    f"request {req['id']} at {req['cur_len']}, group {g} (window {window}): entry {i} is {block}"
                if block != NULL_BLOCK:
                    holders = owners.setdefault(block, [])
                    assert not holders or holders[0][1] == g, f"block {block} is in groups {holders[0][1]} and {g}"
                    holders.append((req["id"], g))
    for block, holders in owners.items():
        count = state["ref_count"].get(block, 0)
        assert count == len(holders), f"block {block}: {count} references, held by {holders}"
    assert state["num_used"] == len(owners), f"{state['num_used']} blocks in use, {len(owners)} held by requests"


def check_swapped(req: dict, windows: list, bs: int) -> None:
    """A swapped request (§2.7): state SWAPPED, no device block; its tables' shape waits on the host,
    trimmed to the blocks holding K/V (cur_len's), NULL_BLOCK behind each window as before; the
    host copy holds one block for each live entry, in each of the pool's tensors."""
    where = f"swapped request {req['id']} at {req['cur_len']}"
    assert req["state"] == "SWAPPED" and not req["tables"] and not req["blocks"], \
        f"{where}: state {req['state']}, holding {req['blocks']} device blocks"
    assert len(req["swapped_tables"]) == len(windows), f"{where}: {len(req['swapped_tables'])} tables kept"
    for g, (window, table) in enumerate(zip(windows, req["swapped_tables"])):
        assert len(table) == blocks_for(req["cur_len"], bs), \
            f"{where}: group {g} kept {len(table)} entries: only the blocks holding K/V travel (trim first)"
        oldest = 0 if window is None else max(0, req["cur_len"] - window + 1)
        for i, block in enumerate(table):
            assert (block == NULL_BLOCK) == ((i + 1) * bs <= oldest), f"{where}: group {g}'s entry {i} is {block}"
    live = sum(b != NULL_BLOCK for table in req["swapped_tables"] for b in table)
    assert req["host_blocks"] and set(req["host_blocks"]) == {live}, \
        f"{where}: the host copy holds {req['host_blocks']} blocks per tensor for {live} live entries"


def run_checked(engine, items: list[WorkItem], oracle=None) -> dict[int, list[int]]:
    """Runs `items` to the end, checking every forward (check_builds) and every step's end
    (check_between_steps). The engine's state comes as data (probes_l13), one request a step. With
    `oracle` (HF's model of the same folder), once, at the first step's end where a table has let
    go of blocks behind a window: what every running request's tables point at is HF's K/V
    (check_tables_against_hf), so the tables checked above are the ones attention reads."""
    record_builds(engine)
    for item in items:
        engine.add_request(item)
    state, seen = engine_state(engine), None
    while state["unfinished"]:
        state = step(engine)
        check_builds(state)
        check_between_steps(state)
        if oracle is not None and seen is None and past_a_window(state):
            seen = check_tables_against_hf(engine, state, oracle)
    assert state["num_free"] == state["num_blocks"], "blocks leaked"
    ids = outputs(engine)
    if oracle is not None:
        assert seen is not None, "no step's end had a table past its window: this run checks no pool against HF"
        for request, output in seen.items():
            assert ids[request][:len(output)] == output, f"request {request}'s ids changed after they were read"
    return ids


def past_a_window(state: dict) -> bool:
    return any(r["queue"] == "running" and any(NULL_BLOCK in t for t in r["tables"]) for r in state["requests"])


def check_tables_against_hf(engine, state: dict, oracle) -> dict[int, list[int]]:
    """Every running request's tables hold HF's K/V for its tokens so far (helpers.
    assert_tables_hold_hf_kv); returns the ids each had then, for run_checked to hold to."""
    kv, read = pool_kv(engine), {}
    for req in state["requests"]:
        if req["queue"] != "running" or not req["tables"]:
            continue
        seq = (req["prompt"] + req["output"])[:req["cur_len"]]
        assert assert_tables_hold_hf_kv(oracle, kv, req["tables"], state["group_layers"], seq, state["block_size"],
                                        NULL_BLOCK) > 0, f"request {req['id']}: no position left to compare"
        read[req["id"]] = req["output"]
    return read


@pytest.mark.points(3)
def test_hybrid_engine_matches_hf_on_the_embedded_hybrid(hybrid, prompts, hf_hybrid_ids, oracle):
    engine = make_hybrid_engine(hybrid, 200, 16)
    ids = run_checked(engine, [WorkItem(p, 50) for p in prompts], oracle)
    assert [ids[i] for i in range(len(prompts))] == hf_hybrid_ids


def test_the_pool_check_fails_a_table_that_names_blocks_the_kv_never_went_to(hybrid, prompts, oracle):
    """The check that makes the table checks above about the run, not its report: two live entries
    of a table swapped (as a forged report would name them) no longer hold HF's K/V."""
    engine = make_hybrid_engine(hybrid, 200, 16)
    engine.add_request(WorkItem(prompts[0], 50))
    state = engine_state(engine)
    while not past_a_window(state):
        state = step(engine)
    check_tables_against_hf(engine, state, oracle)
    table = state["requests"][0]["tables"][1]
    live = [i for i, block in enumerate(table) if block != NULL_BLOCK]
    table[live[0]], table[live[-1]] = table[live[-1]], table[live[0]]
    with pytest.raises(AssertionError, match="does not hold HF"):
        check_tables_against_hf(engine, state, oracle)


def check_a_swap_round_trip(hybrid, prompt: list[int]) -> None:
    """swap_out and swap_in called directly (§2.7) on a request past its window whose tables also
    reserve blocks beyond its K/V (as after a failed step): only the blocks holding K/V travel (the
    reserved ones are freed, not copied), NULL_BLOCK entries stay where they were, every live block's
    K and V come back bit for bit into fresh blocks, the counters count the bytes, and the request
    is SWAPPED, then RUNNING."""
    engine = make_hybrid_engine(hybrid, 40, 16, preempt="swap")
    engine.add_request(WorkItem(prompt, 20))
    engine.step()
    engine.step()  # the prompt, then one decode: the sliding table starts with NULL_BLOCK entries
    (req,) = engine.requests.values()
    bs, alloc, counters = 16, engine.alloc, engine.preemptor.counters
    kept = [list(table) for table in req.tables]
    assert all(len(table) == blocks_for(req.cur_len, bs) for table in kept) and NULL_BLOCK in kept[-1]
    grow_tables(req, engine.pool.groups, alloc, req.cur_len + 2 * bs)  # reserved, holding no K/V
    tensors = list(engine.pool.k_block_tensors) + list(engine.pool.v_block_tensors)
    live = [b for table in kept for b in table if b != NULL_BLOCK]
    before = [t[live].clone() for t in tensors]
    moved = sum(t.numel() * t.element_size() for t in before)
    out, back = counters.bytes_swapped_out, counters.bytes_swapped_in
    engine.scheduler.running.remove(req)
    engine.preemptor.preempt(req)
    assert req.state.name == "SWAPPED" and req.tables == () and req.blocks == [], \
        "swap_out left the request holding blocks"
    assert alloc.num_free == alloc.num_blocks, "swap_out freed fewer blocks than the request held"
    assert [list(table) for table in req.swapped_tables] == kept, \
        "the tables' shape waits on the host, NULL_BLOCK entries included, trimmed to the blocks holding K/V"
    assert counters.bytes_swapped_out - out == moved, "only the live blocks holding K/V travel, each once"
    alloc.alloc_blocks(3)  # the request comes back into other blocks
    engine.preemptor.swap_in(req)
    assert req.state.name == "RUNNING" and req.swapped is None and req.swapped_tables == ()
    tables = [list(table) for table in req.tables]
    assert [[b == NULL_BLOCK for b in table] for table in tables] == \
        [[b == NULL_BLOCK for b in table] for table in kept], "swap_in moved the tables' NULL_BLOCK entries"
    fresh = [b for table in tables for b in table if b != NULL_BLOCK]
    assert len(set(fresh)) == len(live) and alloc.num_used == 3 + len(live)
    tensors = list(engine.pool.k_block_tensors) + list(engine.pool.v_block_tensors)  # read again (judged: a copy)
    for i, (t, was) in enumerate(zip(tensors, before)):
        assert torch.equal(t[fresh].view(torch.uint8), was.view(torch.uint8)), \
            f"the pool's tensor {i} did not get its K/V back, bit for bit, at the same entries"
    assert counters.bytes_swapped_in - back == moved


@pytest.mark.points(3)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hybrid_engine_matches_hf_preempting_in_a_small_pool_with_chunked_prefill(hybrid, prompts,
                                                                                hf_hybrid_ids, oracle, mode):
    if mode == "swap":
        check_a_swap_round_trip(hybrid, prompts[0])
    engine = make_hybrid_engine(hybrid, 24, 16, prefill_chunk=32, preempt=mode)
    ids = run_checked(engine, [WorkItem(p, 50, arrival_step=3 * i) for i, p in enumerate(prompts)], oracle)
    assert [ids[i] for i in range(len(prompts))] == hf_hybrid_ids
    preempted = engine.summary()["preempted_" + mode]
    assert preempted > 0, "the pool was large enough: this test preempts nothing"


@pytest.mark.points(2)
def test_a_random_hybrid_with_kinds_of_unequal_size_matches_hf(make_model):
    model_dir = make_model(seed=5, **RANDOM_HYBRID)
    model = load_hybrid_model(model_dir)
    assert [g.window for g in kv_cache_groups(model.config)] == [None, 12, 12]
    oracle = hf.load_hf_model(str(model_dir))
    prompts = [random_prompt(n, 512, seed=50 + n) for n in (45, 30, 61, 9)]
    engine = make_hybrid_engine(model, 40, 4, prefill_chunk=16)
    ids = run_checked(engine, [WorkItem(p, 30, arrival_step=i) for i, p in enumerate(prompts)], oracle)
    assert [ids[i] for i in range(len(prompts))] == [hf.hf_greedy(oracle, p, 30) for p in prompts]
    assert engine.summary()["preempted_recompute"] > 0


@pytest.mark.points(2)
def test_one_requests_peak_blocks_are_what_each_step_must_hold(hybrid, prompts, oracle):
    """Counted here step by step: a full group holds every position so far, a sliding group the
    blocks from its window's oldest position to the step's last new token."""
    bs, chunk, window = 16, 32, 64
    prompt, new = prompts[0], 40  # 150 prompt tokens: five chunks, then decodes
    engine = make_hybrid_engine(hybrid, 200, bs, prefill_chunk=chunk)
    run_checked(engine, [WorkItem(prompt, new)], oracle)
    peak, start = 0, 0
    for n in [chunk] * (len(prompt) // chunk) + [len(prompt) % chunk] + [1] * (new - 1):
        end = start + n
        sliding = (end - 1) // bs - max(0, start - window + 1) // bs + 1
        peak = max(peak, blocks_for(end, bs) + sliding)  # one full group, one sliding group
        start = end
    assert engine.alloc.peak_used == peak
    full_attention_blocks = 2 * blocks_for(len(prompt) + new - 1, bs)  # both groups kept every block
    assert peak < full_attention_blocks


def test_a_full_attention_model_runs_as_one_group_and_equals_l8(embedded_model_dir, prompts):
    l13 = make_hybrid_engine(load_hybrid_model(embedded_model_dir), 60, 16, prefill_chunk=64)
    l8 = make_prefix_engine(load_engine_model(embedded_model_dir), 60, 16, prefill_chunk=64, prefix_sharing=False)
    items = [WorkItem(p, 20) for p in prompts]
    assert len(l13.pool.groups) == 1
    assert run_checked(l13, items) == {i: r.output_ids for i, r in l8.run(items).items()}


def test_the_hybrid_engine_refuses_what_it_cannot_run(hybrid, embedded_model_dir):
    with pytest.raises(InputError, match="load_hybrid_model"):
        make_hybrid_engine(load_engine_model(embedded_model_dir), 20, 16)


# ---------------------------------------------------------------- prefix sharing on a hybrid

def second_turn(engine, first_prompt: list[int], follow: list[int], new: int) -> tuple[list[int], list[int], int]:
    """Turn 1 runs to its end; turn 2 (turn 1's prompt, its answer, then `follow`) arrives after it.
    Returns both turns' ids and the prefix tokens turn 2 found cached."""
    first = run_checked(engine, [WorkItem(first_prompt, new)])[0]
    engine.add_request(WorkItem(first_prompt + first + follow, new))
    before = engine.prefix.prefix_hit_tokens
    ids = run_checked(engine, [])
    return first, ids[1], engine.prefix.prefix_hit_tokens - before


@pytest.mark.points(2)
def test_a_second_turn_hits_its_whole_first_turn_under_the_hybrid_rule_and_nothing_without_it(
        hybrid, hybrid_model_dir, prompts):
    bs, new = 16, 30
    first_prompt, follow = prompts[1], prompts[2][:20]
    oracle = hf.load_hf_model(str(hybrid_model_dir))
    hits = {}
    for rule, keep in ((True, False), (False, False), (False, True)):
        engine = make_hybrid_engine(hybrid, 60, bs, hybrid_hit_rule=rule, keep_behind_window=keep)
        first, second, hits[rule, keep] = second_turn(engine, first_prompt, follow, new)
        assert first == hf.hf_greedy(oracle, first_prompt, new)
        assert second == hf.hf_greedy(oracle, first_prompt + first + follow, new)
    # Turn 1 keyed every full block of what it computed (its prompt and all answers but the last):
    # the full group kept them all; the sliding group kept its last window, released at the end.
    computed = len(first_prompt) + new - 1
    whole = computed // bs * bs
    assert hits[True, False] == whole, "the hybrid rule should reuse all of turn 1's full blocks"
    assert hits[False, False] == 0, "asking for every sliding block finds those behind the window gone"
    assert hits[False, True] == whole, "kept behind the window, every block is there for either rule"


@pytest.mark.points(1)
def test_samples_of_one_prompt_share_it_and_copy_on_write_in_every_group(hybrid, prompts, hf_hybrid_ids):
    from l8_prefix import SampledWorkItem

    engine = make_hybrid_engine(hybrid, 60, 16)
    ids = run_checked(engine, [SampledWorkItem(prompts[0], 50, n=3)])
    assert list(ids.values()) == [hf_hybrid_ids[0]] * 3
    assert engine.prefix.fork_shared_tokens == 2 * len(prompts[0])
    assert engine.prefix.cow_copies == 2 * 2, "two forks each copy their shared last block in both groups"


@pytest.mark.points(1)
def test_speculative_decoding_rewinds_every_group_and_the_window_follows_the_accepted_end(hybrid, prompts,
                                                                                          hf_hybrid_ids, oracle):
    """L10's verify writes k + 1 positions in every group; the tables are cut back to the accepted end
    and only then is the window moved (check_between_steps sees each sliding table exactly right)."""
    from l10_speculative import PromptLookupDrafter
    from l13_sliding_window.speculative import make_hybrid_spec_engine

    engine = make_hybrid_spec_engine(hybrid, 24, 16, drafter=PromptLookupDrafter(), k=4, prefill_chunk=32)
    ids = run_checked(engine, [WorkItem(p, 50) for p in prompts], oracle)
    assert [ids[i] for i in range(len(prompts))] == hf_hybrid_ids
    s = engine.summary()
    assert 0 < s["accepted"] < s["proposed"], "no proposal was rejected (or none accepted): nothing was rewound"
    assert s["preempted_recompute"] > 0
